"""`timing_s/agent_loop/slowest/*` and `lr_scheduler/*`: references, properties, DDP, contracts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import opbc_metrics
import opbc_metrics.functional
from opbc_metrics import AgentLoopSlowest, LRSchedulerState, OPBCCollection
from opbc_metrics.testing import assert_no_host_sync
from tests.ddp import run_distributed

FIELDS = ("agent_generate_s", "agent_tool_calls_s", "prompt_lengths", "response_lengths")


def slowest_reference(samples: list[tuple[float, float, int, int]]) -> list[float]:
    """Plain Python: the first sample with the largest generation + tool time; zeros when empty."""
    best = None
    for s in samples:
        if best is None or s[0] + s[1] > best[0] + best[1]:
            best = s
    return [float(v) for v in best] if best else [0.0, 0.0, 0.0, 0.0]


def _batch(samples):
    return {name: torch.tensor([s[i] for s in samples], dtype=torch.float64) for i, name in enumerate(FIELDS)}


sample = st.tuples(st.floats(0, 100, width=32), st.floats(0, 100, width=32), st.integers(0, 4096),
                   st.integers(0, 4096))


@given(st.lists(sample, min_size=0, max_size=30), st.integers(1, 4))
def test_slowest_matches_reference_in_chunks_and_merged(samples, n_chunks):
    whole, chunked, merged = AgentLoopSlowest(), AgentLoopSlowest(), AgentLoopSlowest()
    if samples:
        whole.update(_batch(samples))
    parts = [samples[i::n_chunks] for i in range(n_chunks)]
    ordered = [samples[len(samples) * i // n_chunks: len(samples) * (i + 1) // n_chunks] for i in range(n_chunks)]
    for part in ordered:
        if part:
            chunked.update(_batch(part))
    for part in parts:  # states built apart, then merged (the single-controller pattern)
        if part:
            worker = AgentLoopSlowest()
            worker.update(_batch(part))
            merged.merge_state(worker)
    want = slowest_reference(samples)
    for metric in (whole, chunked, merged):
        got = [v.item() for v in metric.compute_dict().values()] if samples else want
        totals = [s[0] + s[1] for s in samples]
        if totals and totals.count(max(totals)) > 1:  # ties: any slowest sample is a right answer
            assert got[0] + got[1] == pytest.approx(max(totals))
        else:
            assert got == pytest.approx(want)


def test_slowest_forward_returns_the_batch_and_keeps_the_window():
    metric = AgentLoopSlowest()
    metric.update(_batch([(5.0, 1.0, 10, 20)]))
    out = metric(_batch([(1.0, 1.0, 11, 21), (2.0, 0.5, 12, 22)]))
    assert [v.item() for v in out.values()] == [2.0, 0.5, 12.0, 22.0]
    assert [v.item() for v in metric.compute().values()] == [5.0, 1.0, 10.0, 20.0]


def test_slowest_update_has_no_host_sync_and_optional_fields():
    metric = AgentLoopSlowest()
    with assert_no_host_sync():
        metric.update(agent_generate_s=torch.tensor([1.0, 3.0]))
        metric.update(agent_generate_s=torch.zeros(0))
    assert [v.item() for v in metric.compute().values()] == [3.0, 0.0, 0.0, 0.0]


def test_slowest_bad_input_names_the_field():
    with pytest.raises(ValueError, match="agent_tool_calls_s"):
        AgentLoopSlowest().update(agent_generate_s=[1.0, 2.0], agent_tool_calls_s=[1.0])
    metric = AgentLoopSlowest()
    metric.update(agent_generate_s=torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="agent_generate_s"):
        metric.compute()
    with pytest.raises(ValueError, match="agent_generate_s"):
        AgentLoopSlowest().update(response_lengths=[3])


def test_lr_scheduler_state_reference_and_contracts():
    metric = LRSchedulerState(names=("last_lr", "step"))
    observed = [{"last_lr": 1e-6, "step": 1}, {"last_lr": [2e-6, 4e-6]}, {"step": torch.tensor(3.0)}]
    for obs in observed:
        metric.update(lr_scheduler=obs)
    out = metric.compute()
    assert out["lr_scheduler/last_lr"].item() == pytest.approx((1e-6 + 2e-6 + 4e-6) / 3)
    assert out["lr_scheduler/step"].item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="lr_scheduler"):
        metric.update(lr_scheduler={"momentum": 0.9})
    with pytest.raises(ValueError, match="lr_scheduler"):
        metric.update(lr_scheduler=0.1)
    with pytest.raises(ValueError, match="names"):
        LRSchedulerState(names=("a/b",))
    with assert_no_host_sync():
        metric.update(lr_scheduler={"last_lr": torch.tensor(1e-6)})


SHARDS = [
    [[(1.0, 2.0, 5, 6), (0.5, 0.0, 1, 1)], [(3.0, 0.0, 7, 8)]],  # rank 0: two updates
    [[(2.0, 2.5, 9, 10), (0.1, 0.1, 2, 2)]],  # rank 1 holds the slowest sample
]


def _slowest_worker(rank, world_size):
    metrics = OPBCCollection([AgentLoopSlowest(), LRSchedulerState()])
    for samples in SHARDS[rank]:
        metrics.update(dict(_batch(samples), lr_scheduler={"last_lr": 1e-6 * (rank + 1)}))
    return {k: v.item() for k, v in metrics.compute().items()}


def test_slowest_and_lr_sync_exactly_over_two_ranks():
    results = run_distributed(_slowest_worker, world_size=2)
    want = slowest_reference([s for shard in SHARDS for batch in shard for s in batch])
    lrs = [1e-6 * (r + 1) for r, shard in enumerate(SHARDS) for _ in shard]
    for out in results:
        assert [out[f"timing_s/agent_loop/slowest/{k}"] for k in
                ("generate_sequences", "tool_calls", "prompt_length", "response_length")] == want
        assert out["lr_scheduler/last_lr"] == pytest.approx(sum(lrs) / len(lrs))


@pytest.mark.parametrize("scale", [1e150, 1e200, 1e300])
def test_critic_statistics_of_huge_finite_values_are_finite(scale):
    base = np.array([1.0, -2.0, 3.0, 0.5, 1.5])
    adv = torch.tensor(base * scale)[None, :]
    metric = opbc_metrics.AdvantageStats()
    metric.update(advantages=adv[:, :2], response_mask=torch.ones(1, 2))
    metric.update(advantages=adv[:, 2:], response_mask=torch.ones(1, 3))
    out = metric.compute()
    assert out["critic/advantages/mean"].item() == pytest.approx(base.mean() * scale, rel=1e-12)
    assert out["critic/advantages/std"].item() == pytest.approx(base.std() * scale, rel=1e-12)  # population, as verl
    rewards = opbc_metrics.RewardStats()
    rewards.update(rewards=torch.tensor(base * scale))
    assert rewards.compute()["critic/rewards/mean"].item() == pytest.approx(base.mean() * scale, rel=1e-12)
    returns = torch.tensor(base * scale)[None, :]
    values = torch.tensor((base + np.array([0.1, -0.1, 0.0, 0.2, -0.2])) * scale)[None, :]
    ev = opbc_metrics.functional.explained_variance(values, returns)
    d = base - (base + np.array([0.1, -0.1, 0.0, 0.2, -0.2]))
    assert ev.item() == pytest.approx(1 - d.var() / base.var(), rel=1e-9)
