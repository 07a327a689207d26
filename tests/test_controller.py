"""OPBC controller: per-group statistics against a plain-Python reference and against the core metrics on
each group's rows alone, contract validation, correction weights, JSON, host-sync discipline."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from opbc_metrics import OPBCCollection
from opbc_metrics import functional as F
from opbc_metrics.batch import BatchView
from opbc_metrics.controller import (
    Action,
    BatchDecisions,
    DecisionGroupShare,
    GroupDecision,
    OPBCController,
    OPBCPolicy,
    Reason,
    budget_metrics,
    load_decisions,
)
from opbc_metrics.functional import controller as FC
from opbc_metrics.testing import assert_no_host_sync
from tests.data import make_batch
from tests.reference import FLIP, mismatch_reference, router_reference
from tests.support import load_module

# The group reports under DESIGN's definitions: each group's rows through the independent mismatch and router
# references (tests/reference.py), read under the report's field names.
CORE_KEYS = {
    "ess": "opbc/is/ess", "seq_ess": "opbc/is/seq_ess", "second_moment": "opbc/is/second_moment",
    "weight_mean": "opbc/is/weight_mean", "clipped_fraction": "opbc/is/clipped_fraction",
    "veto_fraction": "opbc/is/veto_fraction", "max_abs_log_ratio": "opbc/log_ratio/max_abs",
    "seq_log_ratio_mean": "opbc/sequence/log_ratio_mean", "seq_log_ratio_abs_mean": "opbc/sequence/log_ratio_abs_mean",
    "seq_log_ratio_max_abs": "opbc/sequence/log_ratio_max_abs",
    "geo_log_ratio_mean": "opbc/sequence/geo_log_ratio_mean", "num_tokens": "opbc/input/num_tokens",
    "num_valid_sequences": "opbc/input/num_sequences", "nonfinite_count": "opbc/input/nonfinite_count",
}


def reference_group_stats(batch, clamp=20.0, veto=30.0):
    """{group id: {stat: value}}."""
    t, r = (batch[k].double().numpy() for k in ("trainer_logprobs", "rollout_logprobs"))
    m = batch.get("response_mask")
    m = np.ones(t.shape, dtype=bool) if m is None else m.numpy() != 0
    gids, lag = batch["group_ids"].tolist(), batch.get("policy_lag")
    out = {}
    for g in sorted(set(gids)):
        rows = [i for i, x in enumerate(gids) if x == g]
        ref = mismatch_reference(t[rows], r[rows], m[rows], clamp=clamp, veto=veto)
        s = {name: ref[key] for name, key in CORE_KEYS.items()}
        s.update(num_sequences=len(rows), num_response_tokens=int(m[rows].sum()),
                 top_1pct_gradient_mass=ref["opbc/is/top_1pct_gradient_mass"],
                 policy_lag=None if lag is None else float(lag[rows].max()), router_flip_rate=None)
        if batch.get("rollout_experts") is not None:
            experts = (batch["rollout_experts"][rows].numpy(), batch["trainer_experts"][rows].numpy())
            s["router_flip_rate"] = router_reference(*experts, m[rows])[FLIP]
        out[g] = s
    return out


def _grouped_batch(seed=0, batch=12, seq=24, dtype=torch.float64, heavy=True, drift=1.5):
    b = make_batch(batch=batch, seq=seq, seed=seed, dtype=dtype, heavy_tail=heavy, drift=drift)
    g = torch.Generator().manual_seed(seed + 100)
    b["group_ids"] = torch.tensor([10**12, -3, 7, 7])[torch.randint(0, 4, (batch,), generator=g)]
    b["policy_lag"] = torch.randint(0, 12, (batch,), generator=g)
    experts = torch.randint(0, 6, (batch, seq, 3, 2), generator=g)
    b["rollout_experts"] = experts
    b["trainer_experts"] = torch.where(torch.rand(batch, seq, 3, 1, generator=g) < 0.2, (experts + 1) % 6, experts)
    return b


# -- Per-group statistics ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_group_reports_match_plain_python_reference(seed):
    b = _grouped_batch(seed)
    b["rollout_logprobs"][0, 0] = -9999.0  # a vetoed token
    b["response_mask"][0, 0] = 1
    b["rollout_logprobs"][1, 1] = float("nan")  # a non-finite response token
    b["response_mask"][1, 1] = 1
    ref = reference_group_stats(b)
    out = OPBCController(track_budget=False).step(b)
    assert [d.group_id for d in out.decisions] == sorted(ref)
    for d in out.decisions:
        for key, want in ref[d.group_id].items():
            got = getattr(d.report, key)
            assert got is None if want is None else got == pytest.approx(want, rel=1e-9, abs=1e-12), (d.group_id, key)


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-9), (torch.float32, 2e-5)])
def test_each_group_equals_the_core_metrics_on_its_rows_alone(dtype, rel):
    """A group's statistics of the FULL batch equal OPBCCollection (and the exact top-1% mass, and the
    router flip rate metric) on that group's rows alone."""
    from opbc_metrics.moe import RouterFlipRate

    b = _grouped_batch(seed=5, batch=16, seq=40, dtype=dtype)
    b["rollout_logprobs"][2, 0] = b["trainer_logprobs"][2, 0] - 25.0  # clipped
    b["response_mask"][2, 0] = 1
    clamp, veto = 20.0, 30.0
    out = OPBCController(OPBCPolicy(clamp=clamp, veto=veto), track_budget=False).step(b)
    gids = b["group_ids"]
    assert len(out.decisions) == 3
    for d in out.decisions:
        rows = (gids == d.group_id).nonzero().flatten()
        sub = {k: v[rows] for k, v in b.items() if k in ("trainer_logprobs", "rollout_logprobs", "response_mask")}
        core = OPBCCollection(clamp=clamp, veto=veto)(sub)
        for name, key in CORE_KEYS.items():
            assert getattr(d.report, name) == pytest.approx(core[key].item(), rel=rel, abs=1e-6), (name, d.group_id)
        exact = F.top_gradient_mass(sub["trainer_logprobs"], sub["rollout_logprobs"], sub["response_mask"], clamp=clamp)
        assert d.report.top_1pct_gradient_mass == pytest.approx(exact.item(), rel=rel)
        flip = RouterFlipRate()(rollout_experts=b["rollout_experts"][rows], trainer_experts=b["trainer_experts"][rows],
                                response_mask=sub["response_mask"])
        assert d.report.router_flip_rate == pytest.approx(flip["moe/router/flip_rate"].item(), rel=1e-12)
        assert d.report.policy_lag == b["policy_lag"][rows].max().item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_top_mass_per_group_is_exact_with_ties_and_many_tokens(dtype):
    """k = floor(0.01 N) > 1 inside some groups; ties and zero-weight invalid tokens do not change the sum.
    (float32 weights take the one-sort composite-key path, float64 the two stable sorts.)"""
    g = torch.Generator().manual_seed(3)
    trainer = (-torch.rand(8, 500, generator=g, dtype=torch.float64)).to(dtype)
    rollout = trainer - (torch.round(torch.randn(8, 500, generator=g, dtype=torch.float64) * 4) / 2).to(dtype)
    mask = torch.rand(8, 500, generator=g) < 0.8
    b = {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask,
         "group_ids": torch.tensor([4, 4, 4, 1, 1, 9, 9, 9])}
    ref = reference_group_stats(b)
    out = OPBCController(track_budget=False).step(b)
    for d in out.decisions:
        assert d.report.num_tokens >= 400
        want = ref[d.group_id]["top_1pct_gradient_mass"]
        assert d.report.top_1pct_gradient_mass == pytest.approx(want, rel=1e-12 if dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("chunk_tokens", [1000, 2400])
def test_large_batches_in_chunks_give_the_same_decisions(monkeypatch, chunk_tokens):
    """A batch larger than one chunk is processed chunk by chunk: the same statistics, checks, weights and
    decisions; the top-1% mass from the per-group histogram, within the sketch's documented bound."""
    g = torch.Generator().manual_seed(5)
    trainer = -torch.rand(12, 500, generator=g, dtype=torch.float64) * 3
    # log-probabilities (< 0): positive ones reject every group (logprobs_positive), exact zeros look unfilled
    rollout = (trainer - torch.randn(12, 500, generator=g, dtype=torch.float64) * 0.5).clamp(max=-1e-3)
    rollout[3, :] = 0.0  # one sequence without rollout logprobs
    trainer[7, 10] = float("nan")
    rollout[9, 4] = trainer[9, 4] - 40.0  # vetoed
    mask = torch.rand(12, 500, generator=g) < 0.9
    mask[7, 10] = mask[9, 4] = True  # the non-finite and the vetoed token are response tokens
    b = {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask,
         "group_ids": torch.tensor([5, 5, 2, 2, 2, 8, 8, 1, 1, 3, 3, 3]),
         "policy_lag": torch.tensor([0, 1, 0, 0, 2, 5, 0, 0, 0, 1, 1, 9])}
    ref = reference_group_stats(b)
    whole = OPBCController("truncated_is", track_budget=False).step(b)
    monkeypatch.setattr(FC, "CHUNK_TOKENS", chunk_tokens)
    assert len(FC.row_chunks(BatchView(b))) > 1
    chunked = OPBCController("truncated_is").step(b)
    assert torch.equal(whole.loss_mask, chunked.loss_mask) and torch.equal(whole.weights, chunked.weights)
    assert torch.equal(whole.action, chunked.action) and torch.equal(whole.reasons, chunked.reasons)
    bound = F.sketch_relative_error_bound(20.0, FC.group_top_mass_bins(12))
    for d, e in zip(whole.decisions, chunked.decisions, strict=True):
        for name, value in vars(d.report).items():
            if name == "top_1pct_gradient_mass":
                assert value == pytest.approx(ref[d.group_id][name], rel=1e-12)  # one chunk: exact
                assert getattr(e.report, name) == pytest.approx(value, rel=bound)
            elif isinstance(value, float):
                assert getattr(e.report, name) == pytest.approx(value, rel=1e-12, abs=1e-15, nan_ok=True), name
            else:  # counts (the non-finite token among them) exactly
                assert getattr(e.report, name) == value, name
    assert {d.group_id: d.report.nonfinite_count for d in chunked.decisions}[1] == 1
    assert {k: v.item() for k, v in whole.counts.items()} == {k: v.item() for k, v in chunked.counts.items()}
    with assert_no_host_sync():  # the chunked path keeps the discipline
        OPBCController("truncated_is").step(b)


def test_functional_group_statistics_and_empty_groups():
    t = torch.zeros(3, 2, dtype=torch.float64) - 1.0
    r = t.clone()
    r[0, 1] -= 1.0
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    ids, stats = FC.group_statistics(t, r, torch.tensor([2, 2, 5]), response_mask=mask)
    assert ids.tolist() == [2, 5]
    # group 5 has no valid token: no value (NaN), not the core's empty-window values (ESS 1, fractions 0)
    counts = ("num_sequences", "num_response_tokens", "num_tokens", "nonfinite_count", "num_valid_sequences")
    assert stats["num_tokens"][1] == 0 and stats["num_valid_sequences"][1] == 0
    assert all(math.isnan(v[1]) for k, v in stats.items() if k not in counts), stats
    w = [1.0, math.e, 1.0]
    assert stats["ess"][0].item() == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)))
    assert math.isnan(stats["router_flip_rate"][0]) and math.isnan(stats["policy_lag"][0])


@given(st.integers(0, 10**6), st.randoms(use_true_random=False))
def test_permuting_rows_changes_no_group_report(seed, rnd):
    b = _grouped_batch(seed % 1000, batch=7, seq=9)
    perm = list(range(7))
    rnd.shuffle(perm)
    a = OPBCController(track_budget=False).step(b).decisions
    c = OPBCController(track_budget=False).step({k: v[perm] for k, v in b.items()}).decisions
    assert [d.group_id for d in a] == [d.group_id for d in c]
    for x, y in zip(a, c):
        assert x.action == y.action and x.reasons == y.reasons
        for name in FC.STAT_NAMES:
            vx, vy = getattr(x.report, name), getattr(y.report, name)
            assert vx == pytest.approx(vy, rel=1e-9, abs=1e-12), name


# -- Contract validation ----------------------------------------------------------------------------
def _clean(b=4, t=5, groups=(0, 0, 1, 1)):
    g = torch.Generator().manual_seed(0)
    trainer = -0.1 - torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    return {
        "trainer_logprobs": trainer,
        "rollout_logprobs": trainer + 0.01 * torch.randn(b, t, generator=g, dtype=torch.float64),
        "response_mask": torch.ones(b, t, dtype=torch.int64),
        "group_ids": torch.tensor(groups),
    }


def _decide(batch, policy=None):
    return {d.group_id: d for d in OPBCController(policy, track_budget=False).step(batch).decisions}


NAN = float("nan")


def _confident_zeros(b):
    b["trainer_logprobs"][2, 0], b["rollout_logprobs"][2, 0] = -1e-7, 0.0
    b["trainer_logprobs"][3, 0], b["rollout_logprobs"][3, 0] = 0.0, 0.0


@pytest.mark.parametrize(
    "corrupt,policy,action,reasons",
    [
        (lambda b: None, None, Action.TRAIN, ()),
        (lambda b: b["rollout_logprobs"][2:].zero_(), None, Action.REJECT, (Reason.LOGPROBS_MISSING,)),
        (lambda b: b["trainer_logprobs"][2:].zero_(), None, Action.REJECT, (Reason.LOGPROBS_MISSING,)),
        (lambda b: b["rollout_logprobs"][3, 1].fill_(NAN), None, Action.REJECT, (Reason.NON_FINITE,)),
        (lambda b: b["trainer_logprobs"][2, 4].fill_(-math.inf), None, Action.REJECT, (Reason.NON_FINITE,)),
        # zero where the mask is 1
        (lambda b: b["rollout_logprobs"][2, 2].fill_(0.0), None, Action.REJECT, (Reason.LOGPROBS_MISALIGNED,)),
        (lambda b: b["response_mask"][2:].zero_(), None, Action.REJECT, (Reason.NO_RESPONSE_TOKENS,)),
        # masked positions are not checked
        (lambda b: (b["response_mask"][2, :2].zero_(), b["rollout_logprobs"][2, 0].fill_(NAN),
                    b["trainer_logprobs"][2, 1].fill_(0.0)), None, Action.TRAIN, ()),
        # values on the prompt, zeros on the response; a trainer this confident does not trip the zero-gap check
        (lambda b: (b["response_mask"][2:].copy_(torch.tensor([0, 0, 1, 1, 1])), b["rollout_logprobs"][2:, 2:].zero_(),
                    b["trainer_logprobs"][2:, 2:].fill_(-0.001)),
         None, Action.REJECT, (Reason.LOGPROBS_MISSING, Reason.LOGPROBS_MISALIGNED)),
        # a near-certain token: the rollout rounds to exactly 0 (and both sides 0) is not misaligned ...
        (_confident_zeros, None, Action.TRAIN, ()),
        # ... the gap is a policy threshold: with gap 0 any exact zero against a non-zero side is misaligned
        (_confident_zeros, OPBCPolicy(alignment_gap=0.0), Action.REJECT, (Reason.LOGPROBS_MISALIGNED,)),
        # a one-token response both engines find certain, with trainer logprobs on the prompt positions only
        (lambda b: (b["response_mask"][2:].copy_(torch.tensor([0, 0, 0, 0, 1])), b["trainer_logprobs"][2:, 4].zero_(),
                    b["rollout_logprobs"][2:].zero_()), None, Action.TRAIN, ()),
    ],
)
def test_contract_checks_decide_only_their_group(corrupt, policy, action, reasons):
    b = _clean()
    corrupt(b)
    out = _decide(b, policy)
    assert out[0].action is Action.TRAIN and out[0].reasons == ()
    assert out[1].action is action and set(reasons) <= set(out[1].reasons), out[1]
    assert out[1].primary_reason is (reasons[0] if reasons else None)


def _reference_missing_groups(batch):
    """The origin's check, per sequence: response logprobs all exactly 0.0 on one side and not on the other."""
    groups = set()
    for i, g in enumerate(batch["group_ids"].tolist()):
        mask = batch["response_mask"][i].tolist()
        sides = [[v for v, m in zip(batch[k][i].tolist(), mask) if m] for k in ("rollout_logprobs", "trainer_logprobs")]
        if sides[0] and (all(v == 0.0 for v in sides[0]) != all(v == 0.0 for v in sides[1])):
            groups.add(g)
    return groups


@pytest.mark.parametrize("side", ["rollout_logprobs", "trainer_logprobs"])
def test_one_sequence_without_logprobs_rejects_its_group(side):
    b = _clean()
    b[side][3].zero_()  # one of group 1's two sequences has no logprobs; its neighbour has them
    assert _reference_missing_groups(b) == {1}
    out = _decide(b)
    assert out[0].action is Action.TRAIN
    assert out[1].action is Action.REJECT and out[1].primary_reason is Reason.LOGPROBS_MISSING
    b["trainer_logprobs" if side == "rollout_logprobs" else "rollout_logprobs"][3].zero_()  # both sides zero agree
    assert _reference_missing_groups(b) == set()
    assert Reason.LOGPROBS_MISSING not in _decide(b)[1].reasons


def test_token_id_mismatch_rejects_the_group():
    b = _clean()
    ids = torch.arange(20).view(4, 5)
    b["rollout_token_ids"], b["trainer_token_ids"] = ids, ids.clone()
    assert all(d.action is Action.TRAIN for d in _decide(b).values())
    b["trainer_token_ids"][1, 3] = 99
    out = _decide(b)
    assert out[0].action is Action.REJECT and out[0].reasons == (Reason.TOKEN_IDS_MISMATCH,)
    b["response_mask"][1, 3] = 0  # only response tokens are compared
    assert _decide(b)[0].action is Action.TRAIN


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda b: b.pop("rollout_logprobs"), Reason.LOGPROBS_MISSING),
        (lambda b: b.update(rollout_logprobs=b["rollout_logprobs"][:, :-1]), Reason.SHAPE_MISMATCH),
        (lambda b: b.update(trainer_logprobs=b["trainer_logprobs"][:-1]), Reason.SHAPE_MISMATCH),
        (lambda b: b.update(response_mask=b["response_mask"][:, 1:]), Reason.SHAPE_MISMATCH),
        (lambda b: b.update(rollout_experts=torch.zeros(4, 5, 2, 2, dtype=torch.long),
                            trainer_experts=torch.zeros(4, 5, 3, 2, dtype=torch.long)), Reason.SHAPE_MISMATCH),
        (lambda b: b.update(rollout_token_ids=torch.zeros(4, 5), trainer_token_ids=torch.zeros(4, 4)),
         Reason.SHAPE_MISMATCH),
    ],
)
def test_batch_wide_contract_failures_reject_every_group(change, reason):
    b = _clean()
    change(b)
    out = OPBCController(track_budget=False).step(b)
    assert [d.action for d in out.decisions] == [Action.REJECT, Action.REJECT]
    assert all(d.reasons == (reason,) for d in out.decisions)
    assert out.loss_mask.sum() == 0 and out.weights.sum() == 0
    assert out.loss_mask.shape[0] == 4


@pytest.mark.parametrize(
    "change,field",
    [
        (lambda b: b.pop("group_ids"), "group_ids"),
        (lambda b: b.update(group_ids=torch.zeros(4, 1, dtype=torch.long)), "group_ids"),
        (lambda b: b.update(group_ids=torch.zeros(4)), "group_ids"),
        (lambda b: b.update(trainer_logprobs=b["trainer_logprobs"].long()), "trainer_logprobs"),
        (lambda b: b.update(rollout_logprobs=b["rollout_logprobs"].tolist()), "rollout_logprobs"),
        (lambda b: b.update(rollout_experts=torch.zeros(4, 5, 2, 2, dtype=torch.long)), "trainer_experts"),
        (lambda b: b.update(trainer_token_ids=torch.zeros(4, 5, dtype=torch.long)), "rollout_token_ids"),
        (lambda b: b.update(policy_lag=torch.zeros(3)), "policy_lag"),
        (lambda b: b.update(policy_lag={0: 1}), "policy_lag"),
        (lambda b: b.update(policy_lag="stale"), "policy_lag"),
    ],
)
def test_inputs_that_cannot_be_data_raise_naming_the_field(change, field):
    b = _clean()
    change(b)
    with pytest.raises(ValueError, match=field):
        OPBCController(track_budget=False).step(b)


def test_policy_lag_forms_agree():
    b = _clean()
    as_tensor = _decide(dict(b, policy_lag=torch.tensor([1, 1, 6, 6])))
    as_mapping = _decide(dict(b, policy_lag={0: 1, 1: 6}))
    as_rows_max = _decide(dict(b, policy_lag=torch.tensor([0, 1, 6, 2])))  # a group's lag: its stalest row
    for out in (as_tensor, as_mapping, as_rows_max):
        assert out[0].action is Action.TRAIN and out[0].report.policy_lag == 1
        assert out[1].action is Action.REPLAY and out[1].report.policy_lag == 6
    scalar = _decide(dict(b, policy_lag=9))
    assert all(d.action is Action.QUARANTINE for d in scalar.values())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_invalid_policy_lag_rejects_its_group_with_its_own_reason(bad):
    b = _clean()
    out = _decide(dict(b, policy_lag=torch.tensor([0.0, 1.0, bad, 2.0])))
    assert out[0].action is Action.TRAIN
    assert out[1].action is Action.REJECT and out[1].primary_reason is Reason.INVALID_POLICY_LAG
    mapped = _decide(dict(b, policy_lag={0: 1, 1: bad}))
    assert mapped[1].primary_reason is Reason.INVALID_POLICY_LAG and mapped[0].action is Action.TRAIN


# -- What the trainer consumes ----------------------------------------------------------------------
def _correction_batch():
    """Group 0 clean; group 1 with ratios e^{+-0.9} and one token clipped (1/8 > 0.10) at r = -25, whose
    weight e^-20 keeps ESS at 0.70 (train_with_correction, default); group 2 stale (replay); group 3 vetoed
    (quarantine)."""
    t = torch.full((8, 4), -2.0, dtype=torch.float64)
    r = t.clone()
    r[2] = t[2] - torch.tensor([0.9, -0.9, 0.0, 0.2], dtype=torch.float64)
    t[3, 0], r[3, 0] = -30.0, -5.0  # r = -25: clipped at C = 20
    r[6, 0] = t[6, 0] - 40.0
    return {
        "trainer_logprobs": t, "rollout_logprobs": r, "response_mask": torch.ones(8, 4, dtype=torch.bool),
        "group_ids": torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), "policy_lag": torch.tensor([0, 0, 0, 0, 5, 5, 0, 0]),
    }


def _plain_weights(r, level, mode, floor, cap):
    """Reference correction weights of one sequence (a list of log ratios): (weights, kept, number outside the
    bounds)."""
    logs = r if level == "token" else [sum(r) if level == "sequence" else sum(r) / len(r)] * len(r)
    outside = sum(not (floor <= math.exp(x) <= cap) for x in logs)
    if mode == "truncate":
        return [min(max(math.exp(x), floor), cap) for x in logs], [True] * len(r), outside
    keep = [floor <= math.exp(x) <= cap for x in logs]
    return [math.exp(x) if k else 0.0 for x, k in zip(logs, keep)], keep, outside


def test_default_policy_trains_flagged_groups_with_the_core_weights():
    b = _correction_batch()
    out = OPBCController(track_budget=False).step(b)
    actions = {d.group_id: d.action for d in out.decisions}
    assert actions == {0: Action.TRAIN, 1: Action.TRAIN_WITH_CORRECTION, 2: Action.REPLAY, 3: Action.QUARANTINE}
    core_w = BatchView(b).weights(20.0)
    assert torch.equal(out.weights[2:4], core_w[2:4])  # exactly w = exp(clamp(r, -C, C))
    assert torch.equal(out.weights[:2], torch.ones(2, 4, dtype=torch.float64))  # train: weight 1
    assert out.loss_mask[:4].all() and not out.loss_mask[4:].any() and not out.weights[4:].any()
    assert out.replay_group_ids == [2] and out.quarantine_group_ids == [3] and out.trained_group_ids == [0, 1]
    assert out.rows("replay").tolist() == [4, 5]
    picked = out.select(b, Action.REPLAY, Action.QUARANTINE)
    assert picked["group_ids"].tolist() == [2, 2, 3, 3]
    assert torch.equal(picked["trainer_logprobs"], b["trainer_logprobs"][4:])


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_correction_weights_match_reference(level, mode):
    b = _correction_batch()
    policy = OPBCPolicy(correction_level=level, correction_mode=mode, weight_cap=2.0, weight_floor=0.5,
                        correct_train=True)
    out = OPBCController(policy, track_budget=False).step(b)
    r = (b["trainer_logprobs"] - b["rollout_logprobs"]).tolist()
    truncated = masked = trained = 0
    for i in range(8):
        gid = b["group_ids"][i].item()
        action = {d.group_id: d.action for d in out.decisions}[gid]
        if not action.trains:
            assert not out.loss_mask[i].any() and not out.weights[i].any()
            continue
        w, keep, outside = _plain_weights(r[i], level, mode, 0.5, 2.0)
        trained += len(w)
        assert out.loss_mask[i].tolist() == keep
        assert out.weights[i].tolist() == pytest.approx(w, rel=1e-12)
        truncated += outside if mode == "truncate" else 0
        masked += outside if mode == "mask" else 0
    stats = out.budget_stats()
    assert stats["trained_tokens"].item() == trained
    assert stats["truncated_tokens"].item() == truncated and stats["masked_tokens"].item() == masked
    assert (truncated if mode == "truncate" else masked) > 0


def test_truncated_is_preset_caps_every_trained_token_at_two():
    b = _correction_batch()
    out = OPBCController("truncated_is", track_budget=False).step(b)
    r = b["trainer_logprobs"] - b["rollout_logprobs"]
    trained = out.row_action == Action.TRAIN.code
    trained |= out.row_action == Action.TRAIN_WITH_CORRECTION.code
    expect = torch.where(trained[:, None], torch.exp(r).clamp(max=2.0), torch.zeros_like(r))
    assert torch.allclose(out.weights, expect, rtol=1e-12, atol=0)
    assert out.weights.max() == 2.0


def test_outputs_are_detached_and_weights_never_nan_on_masked_tokens():
    b = _correction_batch()
    t = b["trainer_logprobs"].clone().requires_grad_(True)
    b["trainer_logprobs"] = t
    b["rollout_logprobs"][0, 0] = -1e6  # vetoed, group quarantined: its exp(r) overflows
    out = OPBCController("masked_is", track_budget=False).step(b)
    assert not any(x.requires_grad for x in [out.weights, out.loss_mask, out.action, *out.values.values(),
                                             *out.counts.values()])
    assert out.decisions[0].report.ess > 0 and torch.isfinite(out.weights).all()
    (out.weights * t * out.loss_mask).sum().backward()
    assert torch.isfinite(t.grad).all()


def test_functional_correction_weights():
    t = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    r = torch.tensor([[-2.0, -1.0, -0.5, -4.0]], dtype=torch.float64)
    mask, w = FC.correction_weights(t, r, level="token", mode="truncate", cap=2.0, floor=0.0)
    assert mask.all() and w.tolist()[0] == pytest.approx([2.0, 1.0, math.exp(-0.5), 2.0])
    mask, w = FC.correction_weights(t, r, level="sequence", mode="mask", cap=2.0, floor=0.5)
    assert not mask.any() and not w.any()  # e^{1 + 0 - 0.5 + 3} = e^{3.5} > 2: the whole sequence goes
    mask, w = FC.correction_weights(t, r, level="geometric", mode="mask", cap=2.5, floor=0.5)
    assert mask.all() and w.tolist()[0] == pytest.approx([math.exp(3.5 / 4)] * 4)
    with pytest.raises(ValueError, match="level"):
        FC.correction_weights(t, r, level="segment")
    with pytest.raises(ValueError, match="mode"):
        FC.correction_weights(t, r, mode="clip")


# -- JSON, host sync, budget metrics ----------------------------------------------------------------
def test_decisions_round_trip_through_json():
    b = _grouped_batch(seed=2)
    b["rollout_logprobs"][0, 0] = -9999.0
    b["response_mask"][0, 0] = 1
    out = OPBCController("truncated_is", track_budget=False).step(b)
    text = out.to_json(step=3)
    back = load_decisions(text)
    assert back == out.decisions
    assert any(d.reasons for d in back)
    for d in out.decisions:
        assert GroupDecision.from_json(d.to_json()) == d
    assert OPBCPolicy.from_dict(json.loads(text)["policy"]) == OPBCPolicy.preset("truncated_is")
    no_router = OPBCController(track_budget=False).step(_clean()).decisions[0]
    assert no_router.report.router_flip_rate is None and GroupDecision.from_json(no_router.to_json()) == no_router


def test_step_and_budget_update_never_sync_host_and_device():
    b = _grouped_batch(seed=1)
    b["rollout_token_ids"] = b["trainer_token_ids"] = torch.zeros(12, 24, dtype=torch.long)
    for preset in ("default", "truncated_is", "masked_is"):
        controller = OPBCController(preset)
        with assert_no_host_sync():
            out = controller.step(b)
            for m in budget_metrics():
                m.update(out)
        assert isinstance(out, BatchDecisions)
    policy = OPBCPolicy(correction_level="geometric", correction_mode="mask", weight_cap=3.0, weight_floor=0.2)
    with assert_no_host_sync():
        OPBCController(policy).step(b)


def test_decisions_cost_one_device_to_host_copy(monkeypatch):
    out = OPBCController(track_budget=False).step(_grouped_batch(seed=4))
    calls = {"cpu": 0}
    original = torch.Tensor.cpu

    def counting(self, *args, **kwargs):
        calls["cpu"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting)
    from opbc_metrics.testing import _SyncDetector

    with _SyncDetector():  # no .item(), bool(tensor), nonzero ... on top of the one copy
        decisions = out.decisions
        _ = (out.replay_group_ids, out.quarantine_group_ids, out.rejected_group_ids, out.to_json())
    assert calls["cpu"] == 1
    assert len(decisions) == 3


def test_budget_metrics_values_and_empty_window():
    b = _correction_batch()
    b["rollout_logprobs"][0, 0] = float("nan")  # group 0 rejected
    controller = OPBCController("masked_is")
    controller.step(b)
    out = controller.compute_budget()
    assert out["opbc/decision/num_groups"] == 4 and out["opbc/decision/num_tokens"] == 32
    for a in ("reject", "train_with_correction", "replay", "quarantine"):
        assert out[f"opbc/decision/group_share/{a}"] == 0.25
        assert out[f"opbc/decision/token_share/{a}"] == 0.25
    assert out["opbc/decision/group_share/train"] == 0
    assert all(out[f"opbc/decision/reason_count/{r}"] == 1 for r in ("non_finite", "veto", "lag_above_replay"))
    # masked_is: group 1 rows 2, 3 are trained; tokens with ratio outside [0.5, 2]: e^{0.9}, e^{-0.9}, e^{-25}
    assert out["opbc/decision/masked_token_share"].item() == pytest.approx(3 / 8)
    assert out["opbc/decision/truncated_token_share"] == 0
    assert all(k.startswith("opbc/decision/") for m in budget_metrics() for k in m.keys)


def test_budget_metrics_sit_in_a_collection_and_skip_batches_without_decisions():
    collection = OPBCCollection([*OPBCCollection().members(), *budget_metrics()])
    b = _correction_batch()
    out = OPBCController(track_budget=False).step(b)
    collection.update(b)  # no decisions: budget members skipped
    collection.update({**b, "opbc_decisions": out})
    values = collection.compute()
    assert values["opbc/decision/num_groups"] == 4 and "opbc/is/ess" in values
    with pytest.raises(ValueError, match="opbc_decisions"):
        DecisionGroupShare().update({"opbc_decisions": "nope"})


def test_empty_batch():
    b = {"trainer_logprobs": torch.zeros(0, 5), "rollout_logprobs": torch.zeros(0, 5),
         "group_ids": torch.zeros(0, dtype=torch.long)}
    controller = OPBCController()
    out = controller.step(b)
    assert out.decisions == [] and out.loss_mask.shape == (0, 5)
    assert controller.compute_budget() == {}  # no group decided: no keys


def test_grpo_example_runs():
    module = load_module("grpo_controller")
    out = module.main(steps=8, verbose=False)
    assert out["opbc/decision/num_groups"] >= 8 * module.GROUPS_PER_STEP
    assert out["opbc/decision/reason_count/non_finite"] >= 1  # the injected engine bug (step 3)
    assert out["opbc/decision/reason_count/veto"] >= 1  # the injected catastrophic token (step 5)
    assert out["opbc/decision/group_share/train"] > 0.5
    shares = sum(out[f"opbc/decision/group_share/{a}"] for a in FC.ACTIONS)
    assert shares == pytest.approx(1.0)


@pytest.mark.parametrize("b,t,chunks", [(64, 32768, 16), (64, 4096, 4), (1000, 2048, 16), (7, 40000, 7), (3, 10, 1)])
def test_row_chunks_on_an_accelerator_are_at_most_sixteen(b, t, chunks):
    """On an accelerator a chunk costs its kernel launches, not its size: at most ACCELERATOR_CHUNKS row ranges
    (never smaller than the CPU's), covering every row once. Meta tensors stand in for a GPU's (shapes only)."""
    meta = {"device": "meta"}
    view = BatchView(trainer_logprobs=torch.empty(b, t, **meta), rollout_logprobs=torch.empty(b, t, **meta),
                     response_mask=torch.empty(b, t, dtype=torch.bool, **meta))
    ranges = FC.row_chunks(view)
    assert len(ranges) == chunks <= FC.ACCELERATOR_CHUNKS
    assert [i for i, _ in ranges] == [0, *(j for _, j in ranges[:-1])] and ranges[-1][1] == b
    cpu = BatchView(trainer_logprobs=torch.zeros(b, t), rollout_logprobs=torch.zeros(b, t))
    assert len(FC.row_chunks(cpu)) >= chunks  # the CPU keeps cache-sized chunks
    assert len(FC.row_chunks(view, chunk_tokens=t)) == b  # an explicit size is kept everywhere


@pytest.mark.parametrize("preset,clamp,dtype", [
    *((preset, 20.0, dtype) for preset in ("default", "truncated_is", "masked_is")
      for dtype in (torch.float32, torch.float64)),
    ("default", 50.0, torch.float64),  # a clamp above 40 needs float64 logprobs (check_clamp_dtype)
])
def test_fused_cpu_pass_equals_the_chunked_path(monkeypatch, preset, clamp, dtype):
    """On the CPU a batch of several chunks goes through FC.fused_pass (one sweep): the same bits as the
    chunked path, for every output of the step, with no host sync."""
    b = grouped_batch_for_chunks(dtype)
    monkeypatch.setattr(FC, "CHUNK_TOKENS", 1500)
    assert FC.fused_pass_applies(BatchView(b), FC.row_chunks(BatchView(b)))
    policy = OPBCPolicy.preset(preset) if clamp == 20.0 else OPBCPolicy(clamp=clamp, veto=60.0)  # clamp > 40: `where`
    with assert_no_host_sync():
        fused = OPBCController(policy).step(b)
    monkeypatch.setattr(FC, "fused_pass_applies", lambda *_: False)
    chunked = OPBCController(policy).step(b)
    for name in ("action", "reasons", "loss_mask", "weights"):
        assert torch.equal(getattr(fused, name), getattr(chunked, name)), name
    assert [d.to_json() for d in fused.decisions] == [d.to_json() for d in chunked.decisions]
    assert {k: v.item() for k, v in fused.counts.items()} == {k: v.item() for k, v in chunked.counts.items()}
    six = fused.decisions[6]  # the group with the non-finite response token
    assert six.group_id == 6 and six.report.nonfinite_count == 1 and "non_finite" in [r.value for r in six.reasons]


def grouped_batch_for_chunks(dtype: torch.dtype) -> dict:
    """7 groups of 4 rows in several chunks, every action: train, train_with_correction (clipped), replay (lag),
    quarantine (veto; lag), reject (a sequence without rollout logprobs), and a non-finite logprob."""
    g = torch.Generator().manual_seed(11)
    n, t = 28, 400
    trainer = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    rollout = (trainer - torch.randn(n, t, generator=g, dtype=torch.float64) * 0.05).clamp(max=0.0)
    spikes = torch.rand(4, t, generator=g) < 0.15
    trainer[4:8] = torch.where(spikes, rollout[4:8] - 25.0, trainer[4:8])  # group 1: clipped (w = e^-20)
    rollout[13, 40] = trainer[13, 40] - 35.0  # group 3: vetoed
    rollout[21, :] = 0.0  # group 5: a sequence without rollout logprobs
    trainer[26, 7] = float("nan")  # group 6: a non-finite logprob
    mask = torch.rand(n, t, generator=g) < 0.85
    mask[13, 40] = mask[26, 7] = True  # the vetoed token and the non-finite one are response tokens
    lag = torch.zeros(n, dtype=torch.long)
    lag[9], lag[17] = 6, 9  # group 2: replay, group 4: quarantine
    return {"trainer_logprobs": trainer.to(dtype), "rollout_logprobs": rollout.to(dtype), "response_mask": mask,
            "group_ids": torch.arange(n) // 4, "policy_lag": lag}


@pytest.mark.parametrize("fused", [True, False])
def test_a_negative_expert_id_rejects_its_group(monkeypatch, fused):
    """A -1 expert id (a token the engine did not route or record) on a response token is a contract failure of its
    group (reject, `expert_ids_negative`), on the fused and the chunked path alike, wherever it stands in the top-K;
    on a masked-out token it is ignored."""
    b = grouped_batch_for_chunks(torch.float64)
    n, t = b["response_mask"].shape
    g = torch.Generator().manual_seed(3)
    rollout = torch.argsort(torch.rand(n, t, 2, 8, generator=g), dim=-1)[..., :2].contiguous()
    b["rollout_experts"], b["trainer_experts"] = rollout, rollout.clone()
    b["trainer_experts"][0, 3, 1, 0] = -1  # group 0: a response token
    b["response_mask"][0, 3] = True
    b["rollout_experts"][9, 5, 0, 0] = -1  # group 2: a masked-out token
    b["response_mask"][9, 5] = False
    b["rollout_experts"][25, 2, 0, 1] = -1  # group 6: below the top-1
    b["response_mask"][25, 2] = True
    monkeypatch.setattr(FC, "CHUNK_TOKENS", 1500)
    if not fused:
        monkeypatch.setattr(FC, "fused_pass_applies", lambda *_: False)
    controller = OPBCController()
    out = {d.group_id: d for d in controller.step(b).decisions}
    assert controller.compute_budget()["opbc/decision/reason_count/expert_ids_negative"] == 2  # groups 0 and 6
    assert out[0].action is Action.REJECT and out[0].primary_reason is Reason.EXPERT_IDS_NEGATIVE
    assert Reason.ROUTER_FLIP_ABOVE_MAX not in out[0].reasons
    assert out[6].action is Action.REJECT and Reason.EXPERT_IDS_NEGATIVE in out[6].reasons
    for group in range(1, 6):
        assert Reason.EXPERT_IDS_NEGATIVE not in out[group].reasons, group
    assert out[2].action is Action.REPLAY
