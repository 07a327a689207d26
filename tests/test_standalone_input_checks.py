"""A mismatch metric used alone, and a functional call, refuse what InputHealth refuses in a collection:
probabilities or logits passed as logprobs, and a response_mask with values other than 0 and 1."""

from __future__ import annotations

import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics import functional as F
from opbc_metrics.metric import INPUT_CHECK_STATES, NoDataError
from opbc_metrics.mismatch import MISMATCH_METRICS, InputHealth
from opbc_metrics.per_round import PerRoundMismatch

ALONE = [cls for cls in MISMATCH_METRICS if cls is not InputHealth] + [PerRoundMismatch]
FUNCTIONS = ["chi_square", "clipped_fraction", "importance_ess", "importance_weight_mean",
             "importance_weight_second_moment", "importance_weight_std", "kl_estimators", "log_ratio_range",
             "logprob_diff", "per_round_mismatch", "perplexity_gap", "probability_diff", "sequence_ess",
             "sequence_log_ratio", "top_gradient_mass", "veto_fraction"]


def _logprobs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(3, 40, generator=g) * 4
    return trainer, trainer - 0.05 * torch.rand(3, 40, generator=g)


@pytest.mark.parametrize("cls", ALONE, ids=lambda c: c.__name__)
def test_a_metric_alone_refuses_probabilities_and_a_non_binary_mask(cls):
    trainer, rollout = _logprobs()
    probabilities = cls()
    probabilities.update(trainer_logprobs=trainer.exp(), rollout_logprobs=rollout.exp())
    with pytest.raises(ValueError, match="`trainer_logprobs` holds values in \\[0, 1\\] only"):
        probabilities.compute()
    labels = cls()
    labels.update(trainer_logprobs=trainer, rollout_logprobs=rollout, response_mask=torch.full(trainer.shape, 2))
    with pytest.raises(ValueError, match="`response_mask` held 120 value"):
        labels.compute()
    with pytest.raises(ValueError, match="logits, rewards or scores"):  # forward: the batch's own value
        cls()(trainer_logprobs=trainer + 3.0, rollout_logprobs=rollout)


@pytest.mark.parametrize("cls", ALONE, ids=lambda c: c.__name__)
def test_the_checks_change_no_value(cls):
    trainer, rollout = _logprobs(1)
    alone, unchecked = cls(), cls(input_checks=False)
    for m in (alone, unchecked):
        m.update(trainer_logprobs=trainer, rollout_logprobs=rollout)
    got, want = alone.compute(), unchecked.compute()
    got, want = (x if isinstance(x, dict) else {"value": x} for x in (got, want))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert len(alone.state_dict()) == len(unchecked.state_dict()) + len(INPUT_CHECK_STATES) == \
        len(unchecked.state_dict()) + 4


def test_collection_members_leave_the_checks_to_input_health():
    metrics = OPBCCollection()
    members = [m for m in metrics.members() if type(m) in ALONE]
    assert len(members) == len(ALONE) and not any(m.input_checks for m in members)
    trainer, rollout = _logprobs()
    with pytest.raises(ValueError, match="probabilities"):
        metrics(trainer_logprobs=trainer.exp(), rollout_logprobs=rollout.exp())
    # without the mismatch section (no InputHealth), per_round checks on its own
    (per_round,) = OPBCCollection(sections=["per_round"]).members()
    assert per_round.input_checks
    with pytest.raises(ValueError, match="probabilities"):
        OPBCCollection(sections=["per_round"])(trainer_logprobs=trainer.exp(), rollout_logprobs=rollout.exp())


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_functional_call_refuses_probabilities_and_a_non_binary_mask(name):
    trainer, rollout = _logprobs()
    fn = getattr(F, name)
    with pytest.raises(ValueError, match="`rollout_logprobs` holds values in \\[0, 1\\] only"):
        fn(trainer, rollout.exp())
    with pytest.raises(ValueError, match="`response_mask` held"):
        fn(trainer, rollout, torch.full(trainer.shape, 2))
    fn(trainer, rollout)  # logprobs and a 0/1 mask pass


def _refused_then_good(rank, world, use_collection):
    import opbc_metrics as om

    g = torch.Generator().manual_seed(rank)
    trainer = -torch.rand(4, 32, generator=g) * 4
    rollout = trainer - (0.5 + rank) * torch.rand(4, 32, generator=g)
    metric = om.OPBCCollection(sections=["mismatch"]) if use_collection else om.ImportanceSamplingESS()
    metric(trainer_logprobs=trainer, rollout_logprobs=rollout)
    try:
        metric(trainer_logprobs=trainer.exp(), rollout_logprobs=rollout.exp())  # refused
        refused = False
    except ValueError:
        refused = True
    out = metric.compute()
    return refused, float(out["opbc/is/ess"] if use_collection else out), trainer, rollout


@pytest.mark.parametrize("use_collection", [False, True])
def test_a_refused_forward_leaves_the_window_and_the_sync_as_they_were(use_collection):
    # torchmetrics' forward swaps in the batch's states and local sync settings; a refusal used to leave them so:
    # the window held only the refused batch and compute() no longer synced across ranks.
    from opbc_metrics import ImportanceSamplingESS
    from tests.ddp import run_distributed

    results = run_distributed(_refused_then_good, world_size=2, args=(use_collection,), timeout=240)
    whole = ImportanceSamplingESS()
    for _, _, trainer, rollout in results:
        whole.update(trainer_logprobs=trainer, rollout_logprobs=rollout)
    for refused, ess, *_ in results:
        assert refused and ess == pytest.approx(float(whole.compute()), rel=1e-12)


def test_section_options_can_turn_the_members_checks_on():
    metrics = OPBCCollection(section_options={"mismatch": {"input_checks": True}, "per_round": {"input_checks": True}})
    checked = [m for m in metrics.members() if type(m) in ALONE]
    assert len(checked) == len(ALONE) and all(m.input_checks for m in checked)


def test_the_controller_functions_refuse_probabilities_and_a_non_binary_mask():
    from opbc_metrics.functional import controller as FC

    trainer, rollout = _logprobs()
    groups = torch.tensor([0, 0, 1])
    for call in (lambda t, r, m=None: FC.group_statistics(t, r, groups, m),
                 lambda t, r, m=None: FC.correction_weights(t, r, m)):
        call(trainer, rollout)  # logprobs pass
        with pytest.raises(ValueError, match="`trainer_logprobs` holds values in \\[0, 1\\] only"):
            call(trainer.exp(), rollout.exp())
        with pytest.raises(ValueError, match="`response_mask` held 120 value"):
            call(trainer, rollout, torch.full(trainer.shape, 2))
    FC.correction_weights(trainer.exp(), rollout.exp(), check_inputs=False)  # the caller's choice: no host read


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_ppo_metrics_refuse_probabilities(estimator):
    from opbc_metrics.training import PPOKL, ApproxKL, PolicyClipFraction

    policy, old = _logprobs()
    advantages = torch.ones(3)
    for metric, extra in ((PPOKL(estimator=estimator), {}), (ApproxKL(estimator=estimator), {}),
                          (PolicyClipFraction(), {"advantages": advantages})):
        metric.update(policy_logprobs=policy, old_logprobs=old, **extra)
        metric.compute()  # logprobs pass
        metric.reset()
        metric.update(policy_logprobs=policy.exp(), old_logprobs=old.exp(), **extra)
        with pytest.raises(ValueError, match=r"`policy_logprobs`, `old_logprobs` held 120 invalid .*probabilities"):
            metric.compute()
    with pytest.raises(ValueError, match="logprobs above 0"):
        F.training.policy_kl(policy.exp(), old, estimator=estimator)
    with pytest.raises(ValueError, match="logprobs above 0"):
        F.training.pg_clipfrac(policy, old + 2.0, advantages)
    assert float(F.training.policy_kl(policy + 0.005, old)) > -1  # within PROBABILITY_TOLERANCE of 0: rounding


def test_the_ppo_metrics_read_their_deferred_counts_in_one_host_read(monkeypatch):
    from opbc_metrics.training import PPOKL

    policy, old = _logprobs()
    metric = PPOKL()
    metric.update(policy_logprobs=policy, old_logprobs=old)
    reads = []
    for name in ("tolist", "item", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _f=original, _n=name: reads.append(_n) or _f(self))
    metric.compute()
    assert reads == ["tolist"]  # the non-finite and the positive counts together


@pytest.mark.parametrize("cls", ALONE)
def test_a_window_of_only_non_finite_tokens_says_so(cls):
    """A metric alone whose window held response tokens, all with a NaN or infinite logprob, said only that it saw no
    data; its NoDataError now counts those tokens and says they are excluded. A window with some finite tokens keeps
    its value (the excluded ones are InputHealth's count in a collection); a window of no tokens at all, and a metric
    without the checks, get the plain error."""
    trainer, rollout = _logprobs(2)
    bad = trainer.clone()
    bad[0::2, :] = float("nan")
    bad[1, :] = -float("inf")
    metric = cls()
    metric.update(trainer_logprobs=bad, rollout_logprobs=rollout)
    with pytest.raises(NoDataError, match=rf"held {bad.numel()} response token\(s\) on this rank whose trainer or "
                                          r"rollout logprob is NaN or infinite.*opbc/input/nonfinite_count"):
        metric.compute()
    assert metric.compute_dict() == {}
    some = bad.clone()
    some[0] = trainer[0]  # (a whole sequence: a sequence with a non-finite token is excluded from sequence statistics)
    metric = cls()
    metric.update(trainer_logprobs=some, rollout_logprobs=rollout)
    assert metric.compute_dict()
    for empty in (cls(), cls(input_checks=False)):
        if empty.input_checks:
            empty.update(trainer_logprobs=trainer, rollout_logprobs=rollout, response_mask=torch.zeros_like(trainer))
        else:
            empty.update(trainer_logprobs=bad, rollout_logprobs=rollout)
        with pytest.raises(NoDataError) as error:
            empty.compute()
        assert "NaN or infinite" not in str(error.value)
