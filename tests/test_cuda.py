"""Every section on a CUDA device: the values the CPU gives, and no host-device sync in ``update()``.

CI has no GPU, so these tests skip there; on a CUDA machine ``pytest tests/test_cuda.py`` runs them. On
CUDA, :func:`~opbc_metrics.testing.assert_no_host_sync` also runs the block under CUDA's sync debug mode
(a blocking copy of host data to the device waits for every queued kernel) and names each line that synced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from opbc_metrics import OPBCCollection, OPBCController
from opbc_metrics.batch import BatchView
from opbc_metrics.functional import controller as FC
from opbc_metrics.functional import mismatch as fm
from opbc_metrics.testing import assert_no_host_sync
from tests.data import make_batch, multi_turn_batch
from tests.harness import SECTIONS, assert_close, floats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@contextmanager
def _cuda_syncs_raise() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def to_cuda(value: Any) -> Any:
    """The batch on the GPU: tensors moved, mappings and lists of them walked, other values kept."""
    if isinstance(value, torch.Tensor):
        return value.to(CUDA)
    if isinstance(value, dict):
        return {k: to_cuda(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict | torch.Tensor):
        return [to_cuda(v) for v in value]
    return value


@pytest.mark.parametrize("name", list(SECTIONS))
def test_section_on_cuda_equals_cpu_without_syncs(name):
    section = SECTIONS[name]
    for cpu, gpu in zip(section.runs(), section.runs(), strict=True):
        gpu.to(CUDA)
        for batch in section.batches():
            for x in section.updates(batch):
                cpu.update(x)
            for x in section.updates(to_cuda(batch)):  # (a controller step on the GPU batch: prepare)
                with assert_no_host_sync():
                    gpu.update(x)
        got, want = gpu.compute(), cpu.compute()
        got = floats(got if isinstance(got, dict) else gpu.compute_dict())
        want = floats(want if isinstance(want, dict) else cpu.compute_dict())
        assert_close(got, want, section, where=f"{name} on cuda")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_default_collection_on_cuda_equals_cpu(compiled):
    batches = [multi_turn_batch(batch=6, seq=300, seed=s, dtype=torch.float32) for s in range(3)]
    cpu, gpu = OPBCCollection(), OPBCCollection(compiled=compiled).to(CUDA)
    for b in batches:
        cpu.update(b)
        gpu.update(to_cuda(b))
    # After the first calls (compilation), no update syncs. Compiled code runs under no dispatch mode, so there
    # only CUDA's own sync check watches.
    again = to_cuda(batches[0])
    with assert_no_host_sync() if not compiled else _cuda_syncs_raise():
        gpu.update(again)
    cpu.update(batches[0])
    states = {(id(m), name): getattr(m, name) for m in gpu.members() for name in m._defaults}
    got, want = floats(gpu.compute()), floats(cpu.compute())
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    gpu.reset()  # one multi-tensor copy of the defaults on the GPU
    for m in gpu.members():
        for name, default in m._defaults.items():
            state = getattr(m, name)
            assert state.device.type == "cuda" and state is not states[id(m), name] and torch.equal(state, default)


@pytest.mark.parametrize("chunk_tokens", [None, 256], ids=["one_chunk", "fused_chunks"])
def test_controller_step_on_cuda_equals_cpu(monkeypatch, chunk_tokens):
    batch = make_batch(batch=12, seq=64, seed=3)
    batch["group_ids"] = torch.arange(12) // 4
    if chunk_tokens:  # three chunks of 4 rows on both devices: the fused pass (FC.fused_pass) on each
        monkeypatch.setattr(FC, "CHUNK_TOKENS", chunk_tokens)
        for device in ("cpu", CUDA):
            view = BatchView({k: v.to(device) for k, v in batch.items()})
            assert len(FC.row_chunks(view)) == 3 and FC.fused_pass_applies(view, FC.row_chunks(view))
    cpu, controller = OPBCController(), OPBCController().to(CUDA)  # with the budget metrics
    want = cpu.step(batch)
    cpu.step(batch)
    on_gpu = to_cuda(batch)
    controller.step(on_gpu)
    with assert_no_host_sync():
        got = controller.step(on_gpu)
    for mine, cpus in zip(got.decisions, want.decisions, strict=True):  # same decisions; numbers up to rounding
        assert (mine.action, mine.reasons) == (cpus.action, cpus.reasons)
        a, b = mine.report.to_dict(), cpus.report.to_dict()
        assert {k: v for k, v in a.items() if not isinstance(v, float)} == {
            k: v for k, v in b.items() if not isinstance(v, float)}
        assert {k: v for k, v in a.items() if isinstance(v, float)} == pytest.approx(
            {k: v for k, v in b.items() if isinstance(v, float)}, rel=1e-6, abs=1e-9)
    budget, want_budget = floats(controller.budget.compute()), floats(cpu.budget.compute())
    assert budget.keys() == want_budget.keys() and budget == pytest.approx(want_budget, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("b,t", [(4, 256), (3, 1000), (4, 4200), (2, 8256)])
def test_compiled_round_sums_on_cuda_equal_eager(b, t):
    """The compiled kernel's per-round sums on the GPU against the eager kernel's there, rounds late in the rows too
    (inductor's Triton searchsorted once ignored a view's offset: every round sum was wrong on torch 2.11)."""
    x = to_cuda(multi_turn_batch(batch=b, seq=t, seed=t, p_switch=0.45, dtype=torch.float32))
    for late in (False, True):
        if late:  # every round in the rows' last tokens
            x["response_mask"][:, : t - (t % 64 or 64) - 3] = 0
        args = (x["trainer_logprobs"], x["rollout_logprobs"], x["response_mask"].bool(), 20.0, 30.0, 64, True, True, 6)
        got, want = fm.compiled_token_statistics()(*args), fm.token_statistics(*args)
        assert want["max_rounds"] > 6, "the batch must fill the tracked rounds"
        for key in (*fm.ROUND_STATS, "max_rounds", "rounds"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{key} at {b} x {t}, {late=}")
