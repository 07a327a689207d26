"""No made-up values from the public functional API: a batch without the data a value needs raises.

A public function of the training, rollout, perf, validation, agent and endpoint sections, given a batch with
no valid data (empty, or every item masked out), raises a ``ValueError`` naming itself and what the batch
lacks (``require_data``), where it returned 0 (or 1, or ``{}``). A key that needs two samples (a sample std) is
left out of a dict with one; :func:`explained_variance`, one such key alone, raises. The metric classes leave
their keys out instead (``test_contracts.py::test_collection_without_data_reports_no_keys``).

To add a function: one row in ``EMPTY`` (and in ``ONE_ITEM`` for a sample statistic), or, for a function
without an empty-batch value to make up (per item, host arithmetic), one entry in ``NO_EMPTY_VALUE``.
"""

from __future__ import annotations

import math

import pytest
import torch

from opbc_metrics import functional as F
from opbc_metrics.functional import rollout as R

NAN = float("nan")
E = torch.zeros(0)
NO_IDS = torch.zeros(0, dtype=torch.long)
X = torch.tensor([[1.0, 2.0, 3.0]])
MASKED = torch.zeros(1, 3, dtype=torch.long)
ONE = torch.tensor([[1, 0, 0]])

# (id, call, the message's start)
EMPTY = [
    # training
    ("scalar_mean", lambda: F.scalar_mean([]), r"scalar_mean\(\): no observation with a positive weight"),
    ("scalar_mean/zero_weights", lambda: F.scalar_mean([1.0, 2.0], weights=[0.0, 0.0]),
     r"scalar_mean\(\): no observation with a positive weight"),
    ("policy_entropy", lambda: F.policy_entropy(X, MASKED), r"policy_entropy\(\): no valid token .*`entropies`"),
    ("policy_entropy/logits", lambda: F.policy_entropy(logits=torch.zeros(0, 3, 4)),
     r"policy_entropy\(\): no valid token .*`logits`"),
    ("policy_kl", lambda: F.policy_kl(-X, -X, MASKED), r"policy_kl\(\): no valid token"),
    ("pg_clipfrac", lambda: F.pg_clipfrac(-X, -X, X, MASKED), r"pg_clipfrac\(\): no valid token"),
    *((f"critic_stats/{name}", lambda name=name: F.critic_stats(name, X, MASKED),
       rf"critic_stats\(\): no (valid token|sequence) .*`{name}`")
      for name in ("values", "returns", "advantages", "rewards", "scores")),
    ("explained_variance", lambda: F.explained_variance(X, X + 1, MASKED), r"explained_variance\(\): no valid token"),
    ("length_stats", lambda: F.length_stats([], max_length=8), r"length_stats\(\): no sequence"),
    ("aborted_ratio", lambda: F.aborted_ratio([]), r"aborted_ratio\(\): no sample"),
    ("turn_stats", lambda: F.turn_stats([]), r"turn_stats\(\): no sample"),
    ("dpo_metrics", lambda: F.dpo_metrics(E, E, E, E), r"dpo_metrics\(\): no preference pair"),
    ("reward_model_metrics", lambda: F.reward_model_metrics(E, E), r"reward_model_metrics\(\): no preference pair"),
    # rollout
    ("reward_stats", lambda: F.reward_stats(E), r"reward_stats\(\): no sample with a reward"),
    ("reward_stats/masked", lambda: F.reward_stats(X, MASKED), r"reward_stats\(\): no sample with a reward"),
    ("advantage_stats", lambda: F.advantage_stats(X, MASKED), r"advantage_stats\(\): no sample with an advantage"),
    ("token_stats", lambda: F.token_stats(E, E), r"token_stats\(\): no sample"),
    ("gini", lambda: F.gini(E), r"gini\(\): no value"),
    ("group_gini", lambda: F.group_gini(E, NO_IDS), r"group_gini\(\): no group with a value"),
    ("group_max_median_ratio", lambda: F.group_max_median_ratio(E, NO_IDS),
     r"group_max_median_ratio\(\): no group with a positive median length"),
    ("group_length_cv", lambda: R.group_length_cv(E, NO_IDS), r"group_length_cv\(\): no group with a length CV"),
    ("stop_reason_length_pct", lambda: F.stop_reason_length_pct([]), r"stop_reason_length_pct\(\): no stop reason"),
    ("discarded_counts", lambda: F.discarded_counts([]), r"discarded_counts\(\): no rollout"),
    ("off_policy_steps", lambda: R.off_policy_steps(NO_IDS), r"off_policy_steps\(\): no rollout"),
    ("sample_metric_stats", lambda: F.sample_metric_stats({}), r"sample_metric_stats\(\): no reported sample metric"),
    ("sample_metric_stats/unreported", lambda: F.sample_metric_stats({"a": torch.tensor([NAN, NAN])}),
     r"sample_metric_stats\(\): no reported sample metric"),
    # perf
    ("seqlen_balance", lambda: F.seqlen_balance([], num_ranks=2), r"seqlen_balance\(\): no sequence"),
    ("mfu", lambda: F.mfu(1e12, 0.0, 1, 1e12), r"mfu\(\): no measured time"),
    # validation
    ("validation_accuracy", lambda: F.validation_accuracy(torch.ones(2, 2), ["a", "b"], val_mask=torch.zeros(2, 2)),
     r"validation_accuracy\(\): no valid sample"),
    ("validation_reward", lambda: F.validation_reward(torch.ones(0, 2), "a"),
     r"validation_reward\(\): no valid sample"),
    ("validation_turns", lambda: F.validation_turns([]), r"validation_turns\(\): no valid sample"),
    ("validation_turns/masked", lambda: F.validation_turns([[1, 2]], val_mask=torch.zeros(1, 2)),
     r"validation_turns\(\): no valid sample"),
    # agent, endpoint
    ("agent_metrics", lambda: F.agent_metrics([]), r"agent_metrics\(\): no trajectory pair"),
    ("endpoint_capabilities", lambda: F.endpoint_capabilities([]), r"endpoint_capabilities\(\): no response"),
]

# Public functions of these sections with no value over an empty batch to make up: per item (a pair, a response,
# a sample, a prompt, a position) or host arithmetic whose empty result is exact (empty partitions load 0).
NO_EMPTY_VALUE = {
    "TransformerFlops", "karmarkar_karp", "lpt_partition", "partition", "partition_loads", "peak_flops",
    "entropy_from_logits", "zero_advantage_mask", "discard_reasons", "pass_at_k", "best_at_k",
    "answer_match", "answer_soft_match", "first_divergence", "normalize_text", "tool_call_jaccard",
    "tool_choice_disagreement", "probe_responses",
}
SECTIONS = ("training", "rollout", "perf", "validation", "agent", "endpoint")


@pytest.mark.parametrize("call,match", [pytest.param(c, m, id=i) for i, c, m in EMPTY])
def test_a_batch_without_data_raises(call, match):
    with pytest.raises(ValueError, match="^" + match + r".* in the batch, so there is no value to return"):
        call()


def test_every_public_function_of_these_sections_is_covered():
    covered = {i.split("/")[0] for i, _, _ in EMPTY}
    public = {name for name in F.__all__
              if getattr(F, name).__module__.rsplit(".", 1)[-1] in SECTIONS}
    assert public - covered - NO_EMPTY_VALUE == set(), "add a row to EMPTY (or to NO_EMPTY_VALUE)"
    assert not covered & NO_EMPTY_VALUE


# (id, call, the keys a sample statistic leaves out with one item; None: the function raises)
ONE_ITEM = [
    ("explained_variance", lambda: F.explained_variance(X, X + 1, ONE), None),
    ("reward_stats", lambda: F.reward_stats(torch.tensor([3.0])), {"rollout/reward/std"}),
    ("advantage_stats", lambda: F.advantage_stats(X, ONE), {"rollout/advantage/std"}),
    ("off_policy_steps", lambda: R.off_policy_steps(torch.tensor([2])), {"rollout/off_policy_steps/std"}),
    ("token_stats", lambda: F.token_stats(torch.tensor([4]), torch.tensor([6])),
     {f"rollout/tokens_{k}/std" for k in ("prompt", "completion", "total")}),
    ("sample_metric_stats", lambda: F.sample_metric_stats({"a": torch.tensor([1.0, NAN])}), {"sample_metrics/a/std"}),
]


@pytest.mark.parametrize("call,left_out", [pytest.param(c, k, id=i) for i, c, k in ONE_ITEM])
def test_one_item_has_no_sample_statistic(call, left_out):
    if left_out is None:
        with pytest.raises(ValueError, match=r"^explained_variance\(\): 1 valid token .* in the batch, it needs at "
                                             r"least 2, so there is no value to return"):
            call()
        return
    out = call()
    assert out and not left_out & set(out)
    assert {k.rsplit("/", 1)[0] + "/std" for k in out} == left_out  # the other keys of the same quantities stay


def test_one_item_values_that_exist():
    # A population std (ddof 0) and a Gini of one value are 0, not made up: they stay.
    out = F.critic_stats("advantages", X, ONE)
    assert {k.rsplit("/", 1)[1]: v.item() for k, v in out.items()} == {"mean": 1.0, "std": 0.0, "max": 1.0,
                                                                       "min": 1.0}
    assert F.gini(torch.tensor([5.0])).item() == 0.0
    assert F.explained_variance(X, X + 1, torch.tensor([[1, 1, 0]])).item() == pytest.approx(1.0)


def test_a_metric_no_sample_reported_has_no_keys():
    out = F.sample_metric_stats({"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([NAN, NAN])})
    assert [k.split("/")[1] for k in out] == ["a"] * 4


def test_values_with_data_are_unchanged():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    expected = 1 - 0.25 / (5 / 3 + 1e-5)  # sample variances of r - v and of r, verl's epsilon
    assert F.explained_variance(torch.tensor([[1.0, 2.0, 3.0, 3.0]]), returns).item() == pytest.approx(expected)
    assert F.scalar_mean([1.0, 3.0], weights=[300, 100]).item() == 1.5
    assert F.policy_entropy(torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[1, 1, 0]])).item() == 1.5
    assert [v.item() for v in F.length_stats([10, 512, 0, 200], max_length=512).values()] == [180.5, 512, 0, 0.25]
    assert F.aborted_ratio([0, 12, 7, 0]).item() == 0.5
    out = F.reward_stats(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert [v.item() for v in out.values()] == pytest.approx([0.5, math.sqrt(1 / 3), 0.0, 1.0])
    assert F.mfu(2e12, 1.0, 1, 1e12) == 2.0
    assert F.seqlen_balance([3, 5], num_ranks=1)["global_seqlen/mean"] == 8.0
    assert F.discarded_counts([0, 1])["rollout/discarded/pct"].item() == 50.0


@pytest.mark.parametrize("call,field", [
    pytest.param(lambda: F.length_stats(torch.tensor([-1, 5])), "lengths", id="length_stats"),
    pytest.param(lambda: F.aborted_ratio(torch.tensor([3.0, NAN])), "response_lengths", id="aborted_ratio"),
    pytest.param(lambda: F.turn_stats(torch.tensor([NAN])), "num_turns", id="turn_stats"),
])
def test_bad_counts_raise_before_no_data(call, field):
    # (tensor counts the update zeroed and counted: these three computed on without looking at the count)
    with pytest.raises(ValueError, match=rf"batch field `{field}` held 1 invalid value"):
        call()
