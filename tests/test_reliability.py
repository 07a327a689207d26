"""Reliability: distributed faults, world sizes 3 and 4, checkpoints across processes, merging worker
states into one controller, and long sequences."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

from opbc_metrics import OPBCCollection
from tests.data import concat_batches, make_batch
from tests.ddp import run_distributed
from tests.reference import mismatch_reference
from tests.support import ROOT, assert_values_close, collection_values


def _rank_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank r makes r updates (rank 0 none at all), with shapes that differ by rank."""
    return [make_batch(batch=2 + rank, seq=5 + 3 * i + rank, seed=100 * rank + i, dtype=torch.float64)
            for i in range(rank)]


def _uneven_updates_worker(rank, world_size):
    metrics = OPBCCollection()
    for b in _rank_batches(rank):
        metrics.update(b)
    return {k: v.item() for k, v in metrics.compute().items()}


@pytest.mark.parametrize("world_size", [3, 4])
def test_world_sizes_3_and_4_with_uneven_update_counts(world_size):
    results = run_distributed(_uneven_updates_worker, world_size=world_size, timeout=180)
    expected = collection_values([concat_batches([b for r in range(world_size) for b in _rank_batches(r)])])
    for values in results:
        assert_values_close(values, expected)


def _optional_members_worker(rank, world_size):
    from tests.data import make_router_batch

    metrics = OPBCCollection()
    b = make_batch(batch=4, seq=12, seed=rank, dtype=torch.float64)
    if rank == 1:  # only rank 1 has an MoE batch: every rank must still report the router keys
        router = make_router_batch(batch=4, seq=12, layers=3, seed=5)
        b = dict(b, rollout_experts=router["rollout_experts"], trainer_experts=router["trainer_experts"])
    metrics.update(b)
    return sorted(metrics.compute())


def test_key_set_is_global_when_only_one_rank_sees_optional_inputs():
    keys = run_distributed(_optional_members_worker, world_size=2)
    assert keys[0] == keys[1]
    assert "moe/router/flip_rate" in keys[0]


def _dying_rank_worker(rank, world_size):
    import time

    metrics = OPBCCollection()
    metrics.update(make_batch(seed=rank))
    if rank == 1:
        os._exit(3)  # dies before sync, without a goodbye
    time.sleep(0.5)
    start = time.monotonic()
    try:
        metrics.compute()
    except Exception as err:  # the survivor must fail, clearly and in bounded time
        return type(err).__name__, str(err)[:300], time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_survivors_fail_clearly_when_a_rank_dies_before_sync():
    results = run_distributed(_dying_rank_worker, world_size=2, timeout=120, pg_timeout=20, expect_errors=True)
    name, message, elapsed = results[0]
    assert name == "SyncError", (name, message)
    assert "rank probably died" in message
    assert elapsed < 60
    assert results[1][0] == "error"  # the dead rank


def checkpoint_step(mode: str, state: str, result: str = "") -> None:
    """One process of the checkpoint test (``python -m tests.test_reliability save|load STATE [RESULT]``)."""
    metrics = OPBCCollection()
    if mode == "load":
        metrics.load_state_dict(torch.load(state, weights_only=True))
    for s in range(2) if mode == "save" else range(2, 4):
        metrics.update(make_batch(seed=s, dtype=torch.float64))
    if mode == "save":
        torch.save(metrics.state_dict(), state)
    else:
        torch.save({k: v.item() for k, v in metrics.compute().items()}, result)


def test_checkpoint_restored_in_a_new_process(tmp_path):
    state, result = tmp_path / "state.pt", tmp_path / "result.pt"
    for args in (["save", str(state)], ["load", str(state), str(result)]):
        subprocess.run([sys.executable, "-m", "tests.test_reliability", *args], check=True, timeout=120, cwd=ROOT)
    straight = collection_values([make_batch(seed=s, dtype=torch.float64) for s in range(4)])
    assert_values_close(torch.load(result, weights_only=True), straight, rel=1e-12, abs_=1e-15)


def _worker_state(seed: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    metrics = OPBCCollection()
    for i in range(2):
        metrics.update(make_batch(batch=3 + i, seq=9 + seed, seed=10 * seed + i, dtype=torch.float64))
    return metrics.state_dict()


def test_merging_worker_states_into_one_controller_equals_single_process():
    with mp.get_context("spawn").Pool(3) as pool:
        shipped = pool.map(_worker_state, range(3))
    controller = OPBCCollection()
    for state in shipped:
        controller.merge_state(state)
    single = collection_values([concat_batches([make_batch(batch=3 + i, seq=9 + s, seed=10 * s + i,
                                                           dtype=torch.float64) for s in range(3) for i in range(2)])])
    assert_values_close(controller.compute(), single)


def test_long_sequences_64_by_32k():
    """2M tokens in 64 sequences of 32k: no size error (torch.quantile's 16M limit is never touched),
    state size unchanged, values equal to the NumPy reference."""
    g = torch.Generator().manual_seed(0)
    b, t = 64, 32768
    trainer = -torch.rand(b, t, generator=g) * 3
    rollout = (trainer + 0.1 * torch.randn(b, t, generator=g)).clamp(max=0)
    mask = torch.arange(t)[None] < torch.randint(t // 2, t + 1, (b,), generator=g)[:, None]
    metrics = OPBCCollection()
    size = sum(v.numel() for k, v in metrics.state_dict().items() if not k.endswith("_extra_state"))
    metrics.update(trainer_logprobs=trainer, rollout_logprobs=rollout, response_mask=mask)
    assert sum(v.numel() for k, v in metrics.state_dict().items() if not k.endswith("_extra_state")) == size
    out = metrics.compute()
    ref = mismatch_reference(trainer.double().numpy(), rollout.double().numpy(), mask.numpy())
    for key, want in ref.items():
        rel = 3e-3 if key == "opbc/is/top_1pct_gradient_mass" else 1e-4
        assert math.isclose(out[key].item(), want, rel_tol=rel, abs_tol=1e-6), (key, out[key].item(), want)


def test_section_options_reach_their_section():
    metrics = OPBCCollection(section_options={"moe": {"num_layers": 4}, "per_round": {"capacity": 3}})
    keys = metrics.keys_produced
    assert "moe/router/layer_3/flip_rate" in keys and "moe/router/layer_4/flip_rate" not in keys
    assert "per_round/round_2_token_count" in keys and "per_round/round_3_token_count" not in keys
    with pytest.raises(ValueError, match="section_options"):
        OPBCCollection(sections=["mismatch"], section_options={"moe": {"num_layers": 4}})


if __name__ == "__main__":
    checkpoint_step(*sys.argv[1:])
