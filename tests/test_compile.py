"""The tensor kernels compile with torch.compile(fullgraph=True): no graph breaks, same values."""

from __future__ import annotations

import pytest
import torch

from opbc_metrics import OPBCCollection
from opbc_metrics.batch import PROBABILITY_TOLERANCE
from opbc_metrics.functional.mismatch import LOGPROB_POSITIVE, _reduction_pieces, token_statistics
from opbc_metrics.functional.moe import router_set_disagreement, router_top1_flips
from opbc_metrics.functional.per_round import round_index
from tests.data import make_batch
from tests.support import compiled_graphs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _positive_logprobs(b):
    """Probability- and logit-like values, both sides on one token (counted for the trainer), the rollout's alone."""
    b["rollout_logprobs"][0, 1].fill_(float("-inf"))  # handled inside the graph
    for side, row, column, value in (("trainer_logprobs", 2, 3, 0.5), ("rollout_logprobs", 2, 3, 0.4),
                                     ("rollout_logprobs", 4, 20, 3.0), ("trainer_logprobs", 5, 9, 0.005)):
        b[side][row, column] = value  # (the last within the tolerance: rounding, not counted)
        b["response_mask"][row, column] = 1


def _long_rows_in_pieces(b):
    """T = 12288 goes as 4 pieces of 3072 per row: per-sequence statistics must be reassembled per sequence."""
    b["trainer_logprobs"][0, 9000] = float("nan")  # masked in: sequence 0 drops out of the sequence statistics
    b["response_mask"][0, 9000] = 1
    b["response_mask"][1, 6000:] = 0  # sequence 1 ends in its second piece


@pytest.mark.parametrize("batch,seq,seed,bins,poke", [
    (6, 40, 3, 256, _positive_logprobs),
    # T > 4096 (inductor sums such rows with a cascade) and an odd T; the eager kernel goes in blocks
    (3, 5001, 5, 8192, lambda b: (b["trainer_logprobs"][1, 7].fill_(float("nan")),
                                  b["rollout_logprobs"][2, 4999].fill_(float("inf")))),
    (3, 12288, 7, 8192, _long_rows_in_pieces),
], ids=["short", "long_rows", "rows_in_pieces"])
def test_token_statistics_compiles_fullgraph_and_matches_eager(batch, seq, seed, bins, poke):
    assert [_reduction_pieces(t) for t in (40, 4096, 5001, 8000, 8192, 8198, 12288, 49152)] == [1, 1, 1, 2, 2, 1, 4, 16]
    b = make_batch(batch=batch, seq=seq, seed=seed)
    poke(b)
    args = (b["trainer_logprobs"], b["rollout_logprobs"], b["response_mask"].bool(), 20.0, 30.0, bins)
    eager = token_statistics(*args)
    compiled = torch.compile(token_statistics, fullgraph=True, dynamic=False)(*args)
    # (the eager kernel also takes the input check's largest logprobs; the compiled one counts the positive ones)
    assert set(eager) - {"logprob_high"} == set(compiled) - {LOGPROB_POSITIVE}
    trainer, rollout, mask = args[:3]
    valid = mask & (trainer - rollout).isfinite()
    above = [trainer > PROBABILITY_TOLERANCE, rollout > PROBABILITY_TOLERANCE]
    expected = [(valid & above[0]).sum().item(), (valid & above[1] & ~above[0]).sum().item()]
    assert compiled.pop(LOGPROB_POSITIVE).tolist() == expected
    assert expected == ([1, 1] if poke is _positive_logprobs else [0, 0])
    for key in compiled:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-5, atol=1e-6, msg=key)
    assert torch.equal(compiled["hist"], eager["hist"])  # the same bin formula in both kernels
    if seq == 12288:
        assert eager["num_seqs"] == 2


def test_router_and_round_kernels_compile_fullgraph():
    g = torch.Generator().manual_seed(0)
    ro = torch.randint(0, 8, (3, 5, 2, 2), generator=g)
    tr = torch.randint(0, 8, (3, 5, 2, 2), generator=g)
    mask = torch.randint(0, 2, (3, 5), generator=g)
    for fn, args in ((router_top1_flips, (ro, tr)), (router_set_disagreement, (ro, tr)), (round_index, (mask,))):
        torch.testing.assert_close(torch.compile(fn, fullgraph=True, dynamic=False)(*args), fn(*args))


def test_compiled_collection_equals_eager_collection():
    # Three shapes: dynamo recompiles with dynamic B and T after the first change.
    batches = [make_batch(batch=b, seq=t, seed=s) for s, (b, t) in enumerate([(5, 30), (3, 17), (6, 41)])]
    eager, compiled = OPBCCollection(sections=["mismatch"]), OPBCCollection(sections=["mismatch"], compiled=True)
    for b in batches:
        eager.update(b)
        compiled.update(b)
    e, c = eager.compute(), compiled.compute()
    assert compiled_graphs() >= 1  # the compiled collection did run a graph
    for key in e:
        torch.testing.assert_close(c[key], e[key], rtol=1e-5, atol=1e-6, msg=key)


def test_strided_inputs_reuse_the_contiguous_graph_and_give_the_same_values():
    """A response cut out of a longer padded batch (``x[:, k:]``) is copied before the compiled CPU graph: the graph
    for non-contiguous strides was ~10x slower (benchmarks/README.md). So it reuses the graph of contiguous inputs of
    its shape (no new graph) and gives the same values bit for bit."""
    from opbc_metrics.functional.mismatch import compiled_token_statistics

    run = compiled_token_statistics()
    wide = make_batch(batch=4, seq=300 + 7, seed=11)
    cut = {k: wide[k][:, 7:] for k in ("trainer_logprobs", "rollout_logprobs", "response_mask")}
    assert not cut["trainer_logprobs"].is_contiguous()
    for rounds in (0, 6):
        args = [cut["trainer_logprobs"], cut["rollout_logprobs"], cut["response_mask"].bool()]
        before = compiled_graphs()
        contiguous = run(*(x.contiguous() for x in args), 20.0, 30.0, 256, True, True, rounds)
        graphs = compiled_graphs()
        assert graphs > before, "contiguous inputs of a new capacity compile a graph"
        strided = run(*args, 20.0, 30.0, 256, True, True, rounds)
        assert compiled_graphs() == graphs, "strided inputs compiled a graph of their own"
        assert set(strided) == set(contiguous)
        for key in contiguous:
            assert torch.equal(strided[key], contiguous[key]), key


def test_the_compiled_kernels_c_plus_plus_gets_pressure_aware_scheduling(monkeypatch):
    """Inductor builds the compiled mismatch kernels with GCC's register-pressure-aware scheduling (only GCC, only
    while they compile: another graph of the process keeps inductor's flags), read by the command that compiles."""
    import importlib

    from opbc_metrics.functional import mismatch as fm

    builder = importlib.import_module("torch._inductor.cpp_builder")
    own = builder._get_optimization_cflags
    assert not set(fm._GCC_SCHEDULING_FLAGS) & set(own("g++")[0])
    with fm._pressure_aware_scheduling():
        assert builder._get_optimization_cflags("g++")[0][-2:] == list(fm._GCC_SCHEDULING_FLAGS)
        assert not set(fm._GCC_SCHEDULING_FLAGS) & set(builder._get_optimization_cflags("clang++")[0])
    assert builder._get_optimization_cflags is own
    # The kernel's first call compiles under it: the command lines inductor builds carry the flags.
    commands: list[str] = []
    command_line = builder.CppBuilder.get_command_line

    def recording(self):
        commands.append(command_line(self))
        return commands[-1]

    monkeypatch.setattr(builder.CppBuilder, "get_command_line", recording)
    monkeypatch.setattr(fm, "_COMPILED", {})
    b = make_batch(batch=2, seq=37, seed=11)
    with torch._inductor.config.patch(fx_graph_cache=False):  # (compiled here, not loaded from the cache)
        fm.compiled_token_statistics()(b["trainer_logprobs"], b["rollout_logprobs"], b["response_mask"].bool(), 20.0,
                                       30.0, 64)
    kernels = [c for c in commands if " -O3 " in c]  # (the kernels' compiles; the wrapper's builds at -O1)
    assert kernels and all("-fschedule-insns -fsched-pressure" in c for c in kernels)
