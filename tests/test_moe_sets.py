"""Top-K set disagreement: every comparison path (column compares for K <= 2, lane-major copies in uint8,
int16 or the ids' own dtype above) against Python sets, at the dtype boundaries and with wrapped ids."""

from __future__ import annotations

import pytest
import torch

from opbc_metrics import RouterSetDisagreement
from opbc_metrics.functional import moe as FM


def python_sets_differ(rollout: torch.Tensor, trainer: torch.Tensor) -> list[list[bool]]:
    """Per token: some layer's two id lists differ as Python sets."""
    return [[any(set(r) != set(t) for r, t in zip(r_tok, t_tok)) for r_tok, t_tok in zip(r_row, t_row)]
            for r_row, t_row in zip(rollout.tolist(), trainer.tolist())]


def ids_batch(low: int, high: int, k: int, seed: int, b: int = 3, t: int = 50, layers: int = 3):
    """Ids in [low, high) with the edges of the range over-represented; the trainer permutes each row and
    then, per row, keeps it, repeats one of its ids, or swaps in a fresh id."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.tensor([low, low + 1, high - 2, high - 1, (low + high) // 2])
    rollout = torch.randint(low, high, (b, t, layers, k), generator=g)
    pick = torch.rand(b, t, layers, k, generator=g) < 0.4
    rollout = torch.where(pick, edges[torch.randint(0, 5, (b, t, layers, k), generator=g)], rollout)
    trainer = torch.gather(rollout, -1, torch.argsort(torch.rand(b, t, layers, k, generator=g), dim=-1))
    kind = torch.randint(0, 4, (b, t, layers, 1), generator=g)
    col = torch.randint(0, k, (b, t, layers, 1), generator=g)
    repeated = torch.gather(trainer, -1, (col + 1) % k)
    fresh = edges[torch.randint(0, 5, (b, t, layers, 1), generator=g)]
    new = torch.where(kind == 1, repeated, torch.where(kind == 2, fresh, trainer.gather(-1, col)))
    return rollout, trainer.scatter(-1, col, new)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_experts", [2, 256, 257, 2**15, 2**15 + 1, None])
def test_every_path_equals_python_sets(k, num_experts):
    # without num_experts K > 2 compares in int16: ids in [0, 2**15) (outside them compute raises, test_moe.py)
    low, high = (0, num_experts) if num_experts is not None else (-(2**62), 2**62) if k <= 2 else (0, 2**15)
    rollout, trainer = ids_batch(low, high, k, seed=k * 7 + (num_experts or 1) % 97)
    want = python_sets_differ(rollout, trainer)
    differs, outside = FM._set_differs_tokens(rollout, trainer, num_experts)
    assert differs.tolist() == want
    if num_experts is not None:
        assert not outside.any()
    if num_experts is None and k > 1:  # full-range int64 ids: the low bytes of distinct ids collide
        assert (rollout % 256 == trainer.roll(1, -1) % 256).any()


@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize(("num_experts", "bad"), [(256, 256), (256, -1), (200, 456), (257, 257 + 2**16), (300, -2**40)])
def test_ids_that_wrap_in_the_narrow_copy_are_flagged(k, num_experts, bad):
    """An id outside [0, E) that the narrow copy would alias to a valid one (256 -> 0 in uint8) is
    reported, so compute() raises instead of counting a wrong comparison."""
    rollout, trainer = ids_batch(0, num_experts, k, seed=1)
    rollout[1, 4, 2, k - 1] = bad
    _, outside = FM._set_differs_tokens(rollout, trainer, num_experts)
    assert outside.nonzero().tolist() == [[1, 4]]
    metric = RouterSetDisagreement(num_experts=num_experts)
    metric.update(rollout_experts=rollout, trainer_experts=trainer)
    with pytest.raises(ValueError, match="outside"):
        metric.compute()


def test_lane_dtype_is_the_narrowest_exact_one():
    assert [FM.lane_dtype(e, torch.int64) for e in (1, 256, 257, 2**15, 2**15 + 1, None)] == [
        torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int64, torch.int64]
    assert FM.lane_dtype(None, torch.int32) == torch.int32


@pytest.mark.parametrize("layers", [1, 2, 3, 4, 8, 16, 24])
def test_layer_reduction_in_words_equals_all(layers):
    g = torch.Generator().manual_seed(layers)
    same = torch.rand(50 * layers, generator=g) < 0.9
    assert torch.equal(FM._all_layers(same, layers), same.view(-1, layers).all(dim=-1))
    rollout, trainer = ids_batch(0, 64, 2, seed=layers, layers=layers)
    assert FM._set_differs_tokens(rollout, trainer, None)[0].tolist() == python_sets_differ(rollout, trainer)


@pytest.mark.parametrize("layers", [1, 2, 3, 4, 8, 48])
@pytest.mark.parametrize("num_experts", [2, 8, 64, 65, 129, 200, 256])
def test_k2_byte_pairs_equal_python_sets(layers, num_experts):
    """K = 2 with num_experts <= 256 compares uint8 copies in order and crosswise (shifted by one byte): a pair's
    crosswise compare must not leak into its neighbours, repeated ids ({a, a} vs {a, b}) must differ."""
    rollout, trainer = ids_batch(0, num_experts, 2, seed=layers * 31 + num_experts, t=40, layers=layers)
    same_neighbours = torch.tensor([[[[1, 2], [2, 1]]]]).expand(1, 1, 2, 2).clone() % num_experts
    for r, t in ((rollout, trainer), (same_neighbours, same_neighbours.flip(2))):
        differs, outside = FM._set_differs_tokens(r, t, num_experts)
        assert differs.tolist() == python_sets_differ(r, t)
        assert not outside.any()


def test_k2_byte_pairs_repeated_and_swapped_ids():
    rollout = torch.tensor([[[[3, 3]], [[3, 4]], [[4, 3]], [[5, 5]], [[0, 255]], [[255, 0]]]])
    trainer = torch.tensor([[[[3, 4]], [[3, 3]], [[3, 4]], [[5, 5]], [[255, 0]], [[0, 0]]]])
    differs, _ = FM._set_differs_tokens(rollout, trainer, 256)
    assert differs.tolist() == [[True, True, False, False, False, True]]


@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("chunk_ids", [2 * 8, 3 * 5 * 8, 7 * 5 * 8 + 1])
def test_cpu_chunks_equal_one_pass(monkeypatch, k, chunk_ids):
    rollout, trainer = ids_batch(0, 128, k, seed=k + chunk_ids, b=4, t=11, layers=5)
    whole = FM._set_differs_tokens(rollout, trainer, 128)
    monkeypatch.setattr(FM, "_CPU_CHUNK_IDS", chunk_ids)
    chunked = FM._set_differs_tokens(rollout, trainer, 128)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert whole[0].tolist() == python_sets_differ(rollout, trainer)


@pytest.mark.parametrize("layers", [1, 2, 3, 4, 5, 8, 16, 24, 48])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16])
def test_any_layer_in_words_equals_amax(layers, dtype):
    g = torch.Generator().manual_seed(layers)
    differ = (torch.rand(40 * layers, generator=g) < 0.05).to(dtype) * torch.randint(1, 200, (40 * layers,),
                                                                                    generator=g).to(dtype)
    assert torch.equal(FM._any_layer(differ, layers), differ.view(-1, layers).amax(dim=-1) != 0)


@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("num_experts", [63, 64, 65, 127, 128, 129, 255, 256])
def test_ids_at_word_and_byte_boundaries(k, num_experts):
    """Ids at the edges of 64-bit words, of int8 and of uint8 (63 / 64, 127 / 128, 255)."""
    rollout, trainer = ids_batch(0, num_experts, k, seed=num_experts + k, t=30, layers=8)
    differs, outside = FM._set_differs_tokens(rollout, trainer, num_experts)
    assert differs.tolist() == python_sets_differ(rollout, trainer)
    assert not outside.any()
    bad = rollout.clone()
    bad[0, 3, 7, k - 1] = num_experts  # one past the last expert
    assert FM._set_differs_tokens(bad, trainer, num_experts)[1].nonzero().tolist() == [[0, 3]]


# --- the compiled comparison (compiled=True, CPU, K > 2): one torch.compile graph, same values ---------------------
@pytest.fixture
def small_compiled_chunks(monkeypatch):
    """Chunks of 3 tokens at L * K = 24 ids: every batch below goes in several, the last one shorter."""
    monkeypatch.setattr(FM, "_COMPILED_CHUNK_IDS", 72)


@pytest.mark.parametrize("k", [3, 4, 8])
@pytest.mark.parametrize("num_experts", [4, 128, 257])
def test_compiled_sets_equal_python_sets(k, num_experts, small_compiled_chunks):
    rollout, trainer = ids_batch(0, num_experts, k, seed=k * 11 + num_experts, t=20, layers=24 // k)
    differs, outside = FM._compiled_set_differs(rollout, trainer, num_experts)
    assert differs.tolist() == python_sets_differ(rollout, trainer)
    assert differs.dtype == torch.bool and not outside.any()


@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int64), (torch.uint8, torch.int16), (torch.int64, torch.int64)])
def test_compiled_sets_mixed_id_dtypes(dtypes, small_compiled_chunks):
    rollout, trainer = ids_batch(0, 200, 8, seed=5, t=20, layers=3)
    rollout, trainer = rollout.to(dtypes[0]), trainer.to(dtypes[1])
    assert FM._compiled_set_differs(rollout, trainer, 200)[0].tolist() == python_sets_differ(rollout, trainer)


@pytest.mark.parametrize(
    ("num_experts", "bad"), [(256, 256), (256, -1), (128, 2**40 + 3), (300, -(2**40)), (2**15, 2**15)]
)
def test_compiled_sets_flag_ids_outside_the_range(num_experts, bad, small_compiled_chunks):
    """The outside flag as the eager path's; on the other tokens the comparison is the eager one."""
    rollout, trainer = ids_batch(0, num_experts, 8, seed=2, t=20, layers=3)
    trainer[1, 4, 2, 5] = bad
    rollout[2, 19, 0, 0] = bad
    differs, outside = FM._compiled_set_differs(rollout, trainer, num_experts)
    eager_differs, eager_outside = FM._set_differs_tokens(rollout, trainer, num_experts)
    assert outside.nonzero().tolist() == [[1, 4], [2, 19]] == eager_outside.nonzero().tolist()
    assert torch.equal(differs[~outside], eager_differs[~outside])


@pytest.mark.parametrize("num_experts", [128, None])
def test_compiled_metric_equals_eager_metric(num_experts, small_compiled_chunks, monkeypatch):
    """RouterSetDisagreement(compiled=True) over several batches (token counts differ: one dynamic-shape graph)
    reports what the eager metric does, and raises where it raises. The compiled one does take the compiled path
    (else this compares eager with eager), the eager one does not."""
    calls = []
    real = FM._compiled_set_differs
    monkeypatch.setattr(FM, "_compiled_set_differs", lambda *a: calls.append(a[2]) or real(*a))
    compiled, eager = (RouterSetDisagreement(num_experts=num_experts, compiled=c) for c in (True, False))
    for seed, t in ((1, 20), (2, 7), (3, 33)):
        rollout, trainer = ids_batch(0, num_experts or 2**15, 8, seed=seed, t=t, layers=3)
        mask = torch.rand(3, t, generator=torch.Generator().manual_seed(seed)) < 0.7
        for metric in (compiled, eager):
            metric.update(rollout_experts=rollout, trainer_experts=trainer, response_mask=mask)
    assert calls == [num_experts or 2**15] * 3
    assert compiled.compute().item() == eager.compute().item() > 0
    rollout[0, 0, 0, 0] = (num_experts or 2**15) + 1
    for metric in (compiled, eager):
        metric.update(rollout_experts=rollout, trainer_experts=trainer)
        with pytest.raises(ValueError, match="outside"):
            metric.compute()


def test_compiled_collection_compiles_the_set_comparison(monkeypatch):
    """OPBCCollection(compiled=True) runs the MoE set comparison compiled (on CPU, K > 2), the same value."""
    from opbc_metrics import OPBCCollection

    calls = []
    real = FM._compiled_set_differs
    monkeypatch.setattr(FM, "_compiled_set_differs", lambda *a: calls.append(a[2]) or real(*a))
    rollout, trainer = ids_batch(0, 64, 8, seed=9, t=30, layers=4)
    batch = {"rollout_experts": rollout, "trainer_experts": trainer}
    values = []
    for compiled in (True, False):
        collection = OPBCCollection(sections=["moe"], section_options={"moe": {"num_experts": 64}}, compiled=compiled)
        collection.update(batch)
        values.append(collection.compute()["moe/router/topk_disagreement_rate"].item())
    assert calls == [64]
    assert values[0] == values[1] > 0
