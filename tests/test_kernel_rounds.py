"""The per-round statistics come out of the mismatch kernel's call: one call per batch for a collection,
the same sums eager and compiled, on long rows with many short rounds, and the view's request API."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from opbc_metrics import (
    ImportanceSamplingESS,
    OPBCCollection,
    PerRoundMismatch,
    ProbabilityDiff,
    TopGradientMass,
)
from opbc_metrics.batch import BatchView, valid_tokens
from opbc_metrics.functional import mismatch as fm
from opbc_metrics.functional.per_round import _per_round_update
from tests.data import logprobs_numpy, metric_values, multi_turn_batch
from tests.reference import assert_rounds_close, per_round_reference
from tests.support import compiled_graphs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _short_rounds(batch: int, seq: int, seed: int, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Rows longer than several chunks with rounds of 1-5 tokens: many starts per chunk, starts at chunk edges."""
    return multi_turn_batch(batch=batch, seq=seq, seed=seed, p_switch=0.45, dtype=dtype)


@pytest.mark.parametrize("seq", [31, 32, 33, 97, 300])
def test_kernel_round_sums_match_the_reference_on_long_rows(seq):
    b = _short_rounds(5, seq, seed=seq)
    b["trainer_logprobs"][1, seq // 2] = float("nan")
    for capacity in (2, 40):
        got = metric_values(PerRoundMismatch(capacity=capacity), b)
        assert_rounds_close(got, per_round_reference(*logprobs_numpy(b), capacity=capacity))


@pytest.mark.parametrize("seq", [33, 64, 97])
def test_eager_round_sums_of_strided_rows_equal_those_of_contiguous_ones(seq):
    """A slice of a wider padded batch (rows strided, as frameworks cut out the response) and a transposed copy
    (columns strided) give the per-round sums of the contiguous batch."""
    b = _short_rounds(4, seq, seed=seq)
    b["rollout_logprobs"][2, seq - 1] = float("-inf")
    inputs = (b["trainer_logprobs"], b["rollout_logprobs"], b["response_mask"].bool())
    wide = [torch.cat([torch.zeros_like(x[:, :7]), x, torch.ones_like(x[:, :5])], dim=1)[:, 7 : 7 + seq]
            for x in inputs]
    transposed = [x.t().contiguous().t() for x in inputs]
    assert wide[0].stride(0) == seq + 12 and transposed[0].stride(-1) != 1
    want = fm.token_statistics(*inputs, 20.0, 30.0, 64, True, True, 5)
    for strided in (wide, transposed):
        got = fm.token_statistics(*strided, 20.0, 30.0, 64, True, True, 5)
        for key in (*fm.ROUND_STATS, "max_rounds"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=0.0, msg=key)


@pytest.mark.parametrize("capacity,alone", [
    (0, ((ImportanceSamplingESS, (False, False)), (ProbabilityDiff, (True, False)), (TopGradientMass, (False, True)))),
    (4, ((lambda: PerRoundMismatch(capacity=4), (False, False)),)),
], ids=["mismatch", "mismatch+per_round"])
def test_one_kernel_call_per_batch_with_the_groups_its_members_read(monkeypatch, capacity, alone):
    """A collection computes the union of its members' statistic groups in one call; a metric alone skips the
    groups it does not read (the probability exps, the histogram, the rounds) and gets the same values."""
    calls = []
    kernel = fm._blocked_token_statistics
    monkeypatch.setattr(fm, "_blocked_token_statistics", lambda *args: calls.append(args[6:]) or kernel(*args))
    b = multi_turn_batch(seed=3)
    sections = ["mismatch", "per_round"] if capacity else ["mismatch"]
    collection = OPBCCollection(sections=sections, section_options={"per_round": {"capacity": capacity}}
                                if capacity else None)
    collection.update(b)
    assert calls == [(True, True, capacity)]
    for make, groups in alone:
        calls.clear()
        metric = make()
        metric.update(b)
        assert calls == [(*groups, capacity)], metric
        for key, value in metric.as_dict(metric.compute()).items():
            torch.testing.assert_close(value, collection.compute()[key], msg=key)


def test_two_capacities_share_one_call_and_fold_the_overflow(monkeypatch):
    calls = []
    kernel = fm._blocked_token_statistics
    monkeypatch.setattr(fm, "_blocked_token_statistics", lambda *a: calls.append(a[8]) or kernel(*a))
    b = _short_rounds(4, 60, seed=2)
    small, large = PerRoundMismatch(capacity=2), PerRoundMismatch(capacity=9)
    view = BatchView(b)
    for m in (small, large):
        m.request_shared(view)
    for m in (small, large):
        m.update(view)
    assert calls == [9]
    for m, capacity in ((small, 2), (large, 9)):
        assert_rounds_close(metric_values(m), per_round_reference(*logprobs_numpy(b), capacity=capacity))


# Both compiled paths: the per-round sums inside the mismatch kernel's graph, or (CPU, rows longer than
# SEPARATE_ROUNDS_ROW) in a graph of their own after the mismatch-only one; the threshold set so that every row
# takes each.
ROUND_PATHS = {"inside": 1 << 62, "separate": 0}


@pytest.fixture(params=sorted(ROUND_PATHS))
def round_path(request, monkeypatch):
    monkeypatch.setattr(fm, "SEPARATE_ROUNDS_ROW", ROUND_PATHS[request.param])
    return request.param


@pytest.mark.parametrize("shape", [(4, 200), (3, 256), (2, 1000)])
def test_compiled_round_sums_equal_eager(shape, round_path):
    b = _short_rounds(*shape, seed=shape[1], dtype=torch.float32)
    b["rollout_logprobs"][0, 5] = float("-inf")
    args = (b["trainer_logprobs"], b["rollout_logprobs"], b["response_mask"].bool(), 20.0, 30.0, 64, True, True, 6)
    eager = fm.token_statistics(*args)
    compiled = fm.compiled_token_statistics()(*args)
    assert compiled_graphs() >= 1
    for key in (*fm.ROUND_STATS, "max_rounds", "rounds"):
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-6, atol=1e-6, msg=key)
    ref = per_round_reference(*logprobs_numpy(b), capacity=6)
    assert eager["round_tokens"].tolist() == [ref[f"per_round/round_{i}_token_count"] for i in range(6)] + [
        ref["per_round/overflow_token_count"]]


def test_compiled_collection_per_round_matches_the_reference(round_path):
    b = _short_rounds(3, 130, seed=9, dtype=torch.float32)
    got = metric_values(OPBCCollection(sections=["mismatch", "per_round"], compiled=True), b)
    assert compiled_graphs() >= 1
    got = {k: v for k, v in got.items() if k.startswith("per_round/")}
    assert_rounds_close(got, per_round_reference(*logprobs_numpy(b)), rel=2e-6, abs_tol=1e-6)


def test_view_requests_are_public_and_generic():
    view = BatchView(multi_turn_batch(seed=1))
    assert view.requested(fm.TOKEN_STATISTICS) == frozenset()
    PerRoundMismatch(capacity=3).request_shared(view)
    fm_metric = OPBCCollection(sections=["mismatch"]).members()[0]
    fm_metric.request_shared(view)
    needs = view.requested(fm.TOKEN_STATISTICS)
    assert fm.rounds_need(3) in needs and fm.settings_need(20.0, 30.0, fm.DEFAULT_TOP_MASS_BINS) in needs
    assert view.shared("key", lambda: 1) == 1 and view.shared("key", lambda: 2) == 1


def test_section_factories_take_only_their_own_options():
    from opbc_metrics.collection import SECTIONS

    for name, factory in SECTIONS.items():
        if name == "mismatch":
            continue
        with pytest.raises((TypeError, ValueError)):  # refused, not silently ignored
            factory(clamp=20.0)


def test_valid_tokens_is_the_rule_of_every_path():
    d = torch.tensor([[0.5, float("nan"), float("inf"), -1.0, 3e38]])
    mask = torch.tensor([[True, True, True, False, True]])
    np.testing.assert_array_equal(valid_tokens(d, mask).numpy(), [[True, False, False, False, True]])
    trainer = torch.tensor([[-1.0, float("nan"), -1.0, -2.0, -3.0e38]])
    rollout = trainer - d
    view = BatchView(trainer_logprobs=trainer, rollout_logprobs=rollout, response_mask=mask)
    assert torch.equal(view.valid, valid_tokens(trainer - rollout, mask))
    stats = fm.token_statistics(trainer, rollout, mask, 20.0, 30.0, 16, True, True, 2)
    assert stats["n"].item() == valid_tokens(trainer - rollout, mask).sum().item()


def test_row_layout_checks_adjacency():
    layout = fm._RowLayout("a", "b", "c")
    assert layout.span("b", "c") == slice(1, 3)
    with pytest.raises(AssertionError):
        layout.span("a", "c")
    assert fm._PRODUCT_POSITIONS == (0, 7, 4, 5)  # rc rc; q q, dp dp, dp q (the second Gram pair at 4)


def test_per_round_update_under_a_larger_request_folds():
    b = _short_rounds(3, 70, seed=4)
    view = BatchView(b)
    view.request(fm.TOKEN_STATISTICS, fm.rounds_need(12))
    folded = _per_round_update(view, 3)
    direct = _per_round_update(BatchView(b), 3)
    for key in direct:
        torch.testing.assert_close(folded[key], direct[key], rtol=1e-13, atol=0.0)


def test_compiled_collections_of_several_sections_and_shapes_do_not_hit_the_recompile_limit(round_path):
    """Each (groups, capacity) combination is a graph of its own: more than dynamo's default 8 per function. Hitting
    the limit would fall back to eager with a warning: here it raises."""
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for b, t in [(4, 64), (6, 64), (4, 96), (3, 40), (5, 33)]:
            x = _short_rounds(b, t, seed=t, dtype=torch.float32)
            for sections in (["mismatch", "per_round"], ["mismatch"], ["per_round"]):
                OPBCCollection(sections=sections, compiled=True).update(x)
    assert compiled_graphs() > 8


def test_compiled_rounds_under_dynamic_shapes_with_rows_no_whole_chunks_match_eager(round_path):
    """Rows of T not a multiple of the compiled chunk, once dynamo has made the shapes dynamic (the main loop reads
    the inputs unpadded there, the chunk sums ragged rows): the per-round sums equal the eager kernel's. The speed
    of this case (once a scalar loop, ~700x the mismatch-only call) is timed by bench.py's 128 x 8100 shape."""
    run = fm.compiled_token_statistics()
    # (T > 4096: the main loop cuts rows into pieces; 8256: whole chunks per row, not per piece)
    for (b, t), late in itertools.product([(4, 256), (8, 512), (3, 1000), (4, 4200), (2, 8256)], (False, True)):
        x = _short_rounds(b, t, seed=t, dtype=torch.float32)
        if late:  # every round in the rows' last tokens: the tracked rounds start in a row's last (partial) chunk,
            # or in the chunk before and go on into it
            for row in range(b):
                x["response_mask"][row, : t - (t % 64 or 64) - (0, 3, 9, 40)[row % 4]] = 0
        args = (x["trainer_logprobs"], x["rollout_logprobs"], x["response_mask"].bool(), 20.0, 30.0, 64, True, True)
        got = {r: run(*args, r) for r in (0, 6)}
        assert compiled_graphs() >= 2  # (with and without rounds)
        eager = fm.token_statistics(*args, 6)
        assert eager["max_rounds"] > 6, "the batch must fill the tracked rounds"
        for key in (*fm.ROUND_STATS, "max_rounds", "rounds"):  # (float32 sums of up to 8K tokens in other orders)
            torch.testing.assert_close(got[6][key], eager[key], rtol=1e-5, atol=1e-6, msg=f"{key} at {b} x {t}")


def test_separate_round_graph_leaves_the_mismatch_only_graph_unchanged(monkeypatch):
    """On the separate path the mismatch statistics come from the mismatch-only graph (rounds = 0): a call with rounds
    after one without compiles only the per-round graph, and its mismatch statistics are the mismatch-only call's."""
    monkeypatch.setattr(fm, "SEPARATE_ROUNDS_ROW", 0)
    x = _short_rounds(4, 256, seed=4, dtype=torch.float32)
    args = (x["trainer_logprobs"], x["rollout_logprobs"], x["response_mask"].bool(), 20.0, 30.0, 64, True, True)
    run = fm.compiled_token_statistics()
    alone = run(*args, 0)
    graphs = compiled_graphs()
    both = run(*args, 6)
    assert compiled_graphs() == graphs + 1  # the per-round graph only
    assert both["rounds"] > 0
    assert alone["rounds"] == 0  # (the mismatch-only graph leaves the rounds row 0: the per-round graph fills it)
    for key, value in alone.items():
        if key != "rounds":
            torch.testing.assert_close(both[key], value, rtol=0, atol=0, msg=key)
    eager = fm.token_statistics(*args, 6)
    for key in (*fm.ROUND_STATS, "max_rounds", "rounds"):
        torch.testing.assert_close(both[key], eager[key], rtol=1e-6, atol=1e-6, msg=key)
