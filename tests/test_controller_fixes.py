"""Controller regressions: no statistic for a group without data, framework field names refused, router logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from opbc_metrics.batch import PROBABILITY_TOLERANCE, BatchView
from opbc_metrics.controller import Action, OPBCController, Reason
from opbc_metrics.functional import controller as FC
from opbc_metrics.testing import assert_no_host_sync

TOKEN_STATS = ("ess", "second_moment", "weight_mean", "clipped_fraction", "veto_fraction", "max_abs_log_ratio",
               "top_1pct_gradient_mass")
SEQUENCE_STATS = ("seq_ess", "seq_log_ratio_mean", "seq_log_ratio_abs_mean", "seq_log_ratio_max_abs",
                  "geo_log_ratio_mean")


def _batch(b=6, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    trainer = -0.1 - torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    return {
        "trainer_logprobs": trainer,
        "rollout_logprobs": trainer + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64),
        "response_mask": torch.ones(b, t, dtype=torch.int64),
        "group_ids": torch.tensor([0, 0, 1, 1, 2, 2])[:b],
    }


@pytest.mark.parametrize("chunk_tokens", [None, 7])  # one chunk; one row per chunk (the fused pass)
def test_a_group_without_valid_tokens_has_no_weight_statistics(monkeypatch, chunk_tokens):
    """It was reported as ESS 1, weight mean 1, fractions 0 (on-policy) although nothing was measured."""
    if chunk_tokens is not None:
        monkeypatch.setattr(FC, "CHUNK_TOKENS", chunk_tokens)
    b = _batch()
    b["response_mask"][2:4] = 0  # group 1: no response token
    b["rollout_experts"] = torch.randint(0, 4, (6, 7, 2, 1), generator=torch.Generator().manual_seed(1))
    b["trainer_experts"] = (b["rollout_experts"] + 1) % 4
    assert (len(FC.row_chunks(BatchView(b))) > 1) == (chunk_tokens is not None)
    out = OPBCController(track_budget=False).step(b)
    d = {x.group_id: x for x in out.decisions}
    # the decision is unchanged: rejected for its contract, and no rule fired on a missing value
    assert d[1].action is Action.REJECT and d[1].reasons == (Reason.NO_RESPONSE_TOKENS,)
    report = d[1].report
    assert report.num_response_tokens == 0 and report.num_tokens == 0 and report.num_valid_sequences == 0
    for name in (*TOKEN_STATS, *SEQUENCE_STATS, "router_flip_rate"):
        assert getattr(report, name) is None, name
        assert getattr(d[0].report, name) is not None and math.isfinite(getattr(d[0].report, name)), name
    stats = json.loads(out.to_json())["decisions"][1]["report"]
    assert stats["ess"] is None and stats["seq_ess"] is None and stats["weight_mean"] is None
    # device values: NaN, so that `ess < min_ess` and every other rule compares false
    assert math.isnan(out.values["ess"][1]) and out.reasons[1].sum() == 1


def test_batch_wide_rejection_reports_no_weight_statistics():
    b = _batch()
    b["rollout_logprobs"] = b["rollout_logprobs"][:, :-1]  # shape mismatch: every group rejected, nothing measured
    out = OPBCController(track_budget=False).step(b)
    assert all(d.reasons == (Reason.SHAPE_MISMATCH,) for d in out.decisions)
    assert all(d.report.ess is None and d.report.num_response_tokens == 7 * 2 for d in out.decisions)


def test_sequence_statistics_need_a_valid_sequence():
    """A group whose every sequence has a non-finite token has token statistics but no sequence statistics."""
    b = _batch()
    b["trainer_logprobs"][4, 0] = b["trainer_logprobs"][5, 3] = float("nan")
    d = {x.group_id: x for x in OPBCController(track_budget=False).step(b).decisions}
    assert d[2].action is Action.REJECT and Reason.NON_FINITE in d[2].reasons
    assert d[2].report.num_tokens == 12 and d[2].report.num_valid_sequences == 0
    assert d[2].report.ess is not None and 0 < d[2].report.ess <= 1
    assert all(getattr(d[2].report, name) is None for name in SEQUENCE_STATS)


@pytest.mark.parametrize(
    "renames,adapter",
    [({"response_mask": "completion_mask"}, "trl.trl_to_batch"),
     ({"trainer_logprobs": "old_log_probs", "rollout_logprobs": "rollout_log_probs"}, "verl.verl_to_batch")],
)
def test_framework_field_names_are_refused_with_the_adapter(renames, adapter):
    """TRL's mask was ignored (an all-ones mask), verl's logprobs rejected every group with no hint."""
    b = _batch()
    for schema, name in renames.items():
        b[name] = b.pop(schema)
    first = next(iter(renames.values()))
    with pytest.raises(ValueError, match=rf"`{first}` is not read by opbc-metrics.*{adapter}"):
        OPBCController().step(b)


def test_a_framework_name_next_to_the_schema_name_is_accepted():
    b = _batch()
    b["completion_mask"] = b["response_mask"]
    out = OPBCController(track_budget=False).step(b)
    assert len(out.decisions) == 3


def _router_logits(b=6, t=7, layers=3, experts=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = torch.randn(b, t, layers, experts, generator=g)
    trainer = rollout + 0.8 * torch.randn(b, t, layers, experts, generator=g)
    return rollout, trainer


def test_router_logits_give_the_flip_rate_of_their_top1_experts():
    """Router logits were ignored (flip rate None, `train`); the moe section reads them."""
    rollout, trainer = _router_logits()
    b = _batch()
    b["response_mask"][0, 5:] = 0
    ids = dict(b, rollout_experts=rollout.argmax(-1, keepdim=True), trainer_experts=trainer.argmax(-1, keepdim=True))
    want = {d.group_id: d.report.router_flip_rate for d in OPBCController(track_budget=False).step(ids).decisions}
    assert all(0 < v < 1 for v in want.values()), want
    for pair in ({"rollout_router_logits": rollout, "trainer_router_logits": trainer},
                 {"rollout_experts": ids["rollout_experts"], "trainer_router_logits": trainer},
                 {"rollout_router_logits": rollout, "trainer_experts": ids["trainer_experts"]}):
        out = OPBCController(track_budget=False).step(dict(b, **pair))
        assert {d.group_id: d.report.router_flip_rate for d in out.decisions} == want, sorted(pair)
    logits = dict(b, rollout_router_logits=rollout, trainer_router_logits=trainer)
    with assert_no_host_sync():
        OPBCController(track_budget=False).step(logits)
    # every token flipped: quarantined for the router, as with expert ids
    flipped = dict(logits, trainer_router_logits=-rollout)
    d = OPBCController(track_budget=False).step(flipped).decisions
    assert all(x.action is Action.QUARANTINE and Reason.ROUTER_FLIP_ABOVE_MAX in x.reasons for x in d)
    assert all(x.report.router_flip_rate == 1.0 for x in d)


def test_router_logits_are_validated_like_expert_ids():
    rollout, trainer = _router_logits()
    b = _batch()
    for pair in ({"rollout_router_logits": rollout, "trainer_router_logits": trainer[:, :-1]},  # T differs
                 {"rollout_router_logits": rollout, "trainer_router_logits": trainer[:, :, :2]},  # L differs
                 {"rollout_router_logits": rollout[0], "trainer_router_logits": trainer[0]}):  # not 4-D
        out = OPBCController(track_budget=False).step(dict(b, **pair))
        assert all(d.reasons == (Reason.SHAPE_MISMATCH,) for d in out.decisions), sorted(pair)
    with pytest.raises(ValueError, match="`trainer_experts` \\(or `trainer_router_logits`\\) is required"):
        OPBCController().step(dict(b, rollout_router_logits=rollout))
    with pytest.raises(ValueError, match="`rollout_router_logits` must be floating-point"):
        OPBCController().step(dict(b, rollout_router_logits=rollout.long(), trainer_router_logits=trainer))
    with pytest.raises(ValueError, match="`trainer_router_logits` must have at least one layer"):
        OPBCController().step(dict(b, rollout_router_logits=rollout, trainer_router_logits=trainer[..., :0]))


# -- probabilities / logits as logprobs, non-binary masks: contract failures per group ----------------------------
PATHS = ("one_chunk", "fused", "chunked")


def _evaluate_on(path, monkeypatch, b):
    """Evaluate ``b`` on one path: one chunk, several chunks swept by FC.fused_pass, or the chunked path."""
    with monkeypatch.context() as m:
        if path != "one_chunk":
            m.setattr(FC, "CHUNK_TOKENS", 7)  # one row per chunk
            assert len(FC.row_chunks(BatchView(b))) > 1
        assert FC.fused_pass_applies(BatchView(b), FC.row_chunks(BatchView(b))) == (path != "one_chunk")
        if path == "chunked":
            m.setattr(FC, "fused_pass_applies", lambda *_: False)
        with assert_no_host_sync():
            return OPBCController(track_budget=False).evaluate(b)


def _logprob_batch():
    b = _batch()
    for name in ("trainer_logprobs", "rollout_logprobs"):
        b[name] = b[name].clamp(max=-0.05)  # log-probabilities: every group trains or replays, none rejected
    return b


def _contract_reasons(out):
    return {d.group_id: [r.value for r in d.reasons if r.is_contract] for d in out.decisions}


@pytest.mark.parametrize("path", PATHS)
def test_positive_logprobs_reject_their_group(monkeypatch, path):
    """Probabilities or logits passed as logprobs were decided on as logprobs (`train`); the collection refuses them."""
    b = _logprob_batch()
    b["trainer_logprobs"][2, 3] = 0.5  # group 1: a probability on a response token
    b["rollout_logprobs"][5, 6] = 4.0  # group 2: a logit on the other side
    b["response_mask"][0, 1] = 0
    b["trainer_logprobs"][0, 1] = 3.0  # group 0: off the response, not a logprob the controller reads
    b["rollout_logprobs"][1, 2] = PROBABILITY_TOLERANCE / 2  # group 0: rounding above 0 passes
    b["trainer_logprobs"][1, 4] = float("inf")  # group 0: not finite, so `non_finite` alone
    out = _evaluate_on(path, monkeypatch, b)
    assert _contract_reasons(out) == {0: ["non_finite"], 1: ["logprobs_positive"], 2: ["logprobs_positive"]}
    assert [d.action for d in out.decisions] == [Action.REJECT] * 3
    b["trainer_logprobs"][1, 4] = -1.0
    assert _contract_reasons(_evaluate_on(path, monkeypatch, b))[0] == []


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", [-100.0, 0.5, 2.0, -1.0, float("nan")])
def test_a_mask_with_values_other_than_0_and_1_rejects_the_group(monkeypatch, path, value):
    """A label mask (-100) or weights were read as `mask != 0` and decided on; the collection refuses them."""
    b = _logprob_batch()
    b["response_mask"] = b["response_mask"].to(torch.float64)
    b["response_mask"][3, 6] = value  # group 1
    b["response_mask"][4, :2] = 0.0  # 0 and 1 elsewhere: the other groups keep their decisions
    out = _evaluate_on(path, monkeypatch, b)
    assert _contract_reasons(out) == {0: [], 1: ["mask_not_binary"], 2: []}
    assert out.decisions[1].action is Action.REJECT and out.decisions[1].primary_reason is Reason.MASK_NOT_BINARY
    assert all(d.action is not Action.REJECT for d in out.decisions if d.group_id != 1)
    if value in (-100.0, 2.0, -1.0):  # an integer mask is judged as well
        b["response_mask"] = b["response_mask"].to(torch.int64)
        assert _contract_reasons(_evaluate_on(path, monkeypatch, b))[1] == ["mask_not_binary"]


def test_new_contract_reasons_agree_between_paths(monkeypatch):
    b = _logprob_batch()
    b["response_mask"] = b["response_mask"].to(torch.float32)
    b["response_mask"][0, 0] = -100.0
    b["trainer_logprobs"][3, 0] = 0.9
    outs = [_evaluate_on(path, monkeypatch, b) for path in PATHS]
    for out in outs[1:]:
        assert torch.equal(out.action, outs[0].action) and torch.equal(out.reasons, outs[0].reasons)
    assert _contract_reasons(outs[0]) == {0: ["mask_not_binary"], 1: ["logprobs_positive"], 2: []}


def test_expert_ids_on_one_side_and_router_logits_on_the_other_give_top1_flips():
    """Ids [B, T, L, K] beside logits [B, T, L, E] raised a shape error naming a field the user never gave; each
    side now gives its top-1 expert as the moe section reads it."""
    from opbc_metrics.moe import RouterFlipRate

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 4, (2, 3, 2, 2), generator=g)
    logits = torch.randn(2, 3, 2, 4, generator=g)
    t = torch.full((2, 3), -1.0)
    out = OPBCController(track_budget=False).evaluate(trainer_logprobs=t, rollout_logprobs=t - 0.1,
                                                      group_ids=torch.tensor([0, 0]), rollout_experts=ids,
                                                      trainer_router_logits=logits)
    moe = RouterFlipRate(top_k=2)
    moe.update(rollout_experts=ids, trainer_router_logits=logits)
    assert out.decisions[0].report.router_flip_rate == pytest.approx(float(moe.compute_dict()["moe/router/flip_rate"]))
