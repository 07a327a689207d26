"""Two gloo ranks with uneven shards: every training metric, synced, equals the single-process value on the
concatenated data (per-rank metrics: the values built from each rank's own share), and a whole
collection syncs in at most three collectives. One spawned run checks everything (the machine is small)."""

from __future__ import annotations

import math

import torch

from tests.data import concat_batches, make_scalars, make_training_batch
from tests.ddp import count_collectives, run_distributed

SOURCES = ("gsm8k", "math")
FLOPS_ARGS = dict(active_params=1e9, num_layers=4, attention_dim=256)


def _shards():
    """rank 0: two training batches of different shapes, all validation data, two scalar steps;
    rank 1: one batch with aborted rows, no validation data, one scalar step."""
    r0 = [make_training_batch(batch=5, seq=10, seed=1), make_training_batch(batch=3, seq=17, seed=2)]
    r1 = [make_training_batch(batch=4, seq=6, seed=3, empty_rows=2)]
    val = [
        {"val_acc": torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]), "val_rewards": torch.tensor([[1.0, -1.0, 2.0],
         [0.5, 0.0, 0.0]]), "data_sources": ["gsm8k", "math"], "val_num_turns": torch.tensor([[1, 2, 3], [4, 5, 6]])},
        {"val_acc": torch.tensor([[1.0, 1.0, 1.0]]), "val_rewards": torch.tensor([[3.0, 1.0, 2.0]]),
         "data_sources": "gsm8k", "val_num_turns": torch.tensor([[2, 2, 9]])},
    ]
    scalars = [[make_scalars(2, 0), make_scalars(1, 1)], [make_scalars(3, 2)]]
    timings = [{"gen": 2.0, "update_actor": 1.0, "old_log_prob": 0.5, "step": 4.0},
               {"gen": 3.0, "update_actor": 0.5, "old_log_prob": 0.7, "step": 4.5}]
    return [r0, r1], [val, []], scalars, timings


def _members(world_size=None):
    from opbc_metrics.functional.perf import TransformerFlops
    from opbc_metrics.training import training_metrics

    return training_metrics(max_response_length=8, max_prompt_length=30, data_sources=SOURCES, n_samples=3,
                            ks=(1, 2, 3), flops=TransformerFlops(**FLOPS_ARGS), peak_flops=1e15,
                            world_size=world_size)


def _feed(metrics, rank, alone=False):
    """Feed this rank's shard; a standalone member only gets the batches that carry its fields."""
    batches, vals, scalars, timings = _shards()
    for b in [*batches[rank], *vals[rank], *scalars[rank], {"timing_s": timings[rank]}]:
        if not alone or all(b.get(f) is not None for f in metrics.required_fields):
            metrics.update(b)


def _worker(rank, world_size):

    from opbc_metrics import OPBCCollection
    from opbc_metrics.training import GlobalSeqlen, PolicyClipFraction, ValidationAccuracy

    collection = OPBCCollection(metrics=_members())
    _feed(collection, rank)
    with count_collectives() as calls:
        out = collection.compute()
    # Standalone members sync through their own compute (the packed path of OPBCMetric._sync_dist).
    alone = {}
    for m in (PolicyClipFraction(), ValidationAccuracy(SOURCES, n_samples=3), GlobalSeqlen()):
        _feed(m, rank, alone=True)
        alone.update({k: v.item() for k, v in m.compute_dict().items()})
    local_tokens = collection["GlobalSeqlen"].workload.sum().item()
    return {k: v.item() for k, v in out.items()}, calls["n"], alone, local_tokens


def _expected():
    """Single process: concatenated data for the additive metrics; per-rank shares rebuilt for the rest."""
    from opbc_metrics import OPBCCollection
    from opbc_metrics.functional.perf import TransformerFlops

    batches, vals, scalars, timings = _shards()
    everything = concat_batches(batches[0] + batches[1])
    single = OPBCCollection(metrics=_members(world_size=2))
    single.update(everything)
    for v in vals[0]:
        single.update(v)
    for s in scalars[0] + scalars[1]:
        single.update(s)
    expected = {k: v.item() for k, v in single.compute().items()}

    # Per-rank figures: workloads, slowest rank, and everything derived from them.
    loads = [sum((b["prompt_lengths"] + b["response_lengths"]).sum().item() for b in batches[r]) for r in range(2)]
    expected["global_seqlen/min"], expected["global_seqlen/max"] = min(loads), max(loads)
    expected["global_seqlen/minmax_diff"] = max(loads) - min(loads)
    rank_ids = torch.cat([torch.full((b["prompt_lengths"].numel(),), r) for r in range(2) for b in batches[r]])
    from opbc_metrics.training import GlobalSeqlen

    gs = GlobalSeqlen(world_size=2)
    gs.update(prompt_lengths=everything["prompt_lengths"], response_lengths=everything["response_lengths"],
              rank_ids=rank_ids)
    expected.update({k: v.item() for k, v in gs.compute().items()})
    seconds = {s: max(t[s] for t in timings) for s in timings[0]}
    for s, v in seconds.items():
        expected[f"timing_s/{s}"] = v
    resp = everything["response_lengths"].sum().item()
    total = resp + everything["prompt_lengths"].sum().item()
    sq = ((everything["prompt_lengths"] + everything["response_lengths"]).double() ** 2).sum().item()
    expected["timing_per_token_ms/gen"] = 1000 * seconds["gen"] / resp
    expected["timing_per_token_ms/update_actor"] = 1000 * seconds["update_actor"] / total
    for s in ("ref", "values", "adv", "update_critic"):
        expected[f"timing_s/{s}"] = expected[f"timing_per_token_ms/{s}"] = 0.0
    for s in ("reward", "update_weights"):
        expected[f"timing_s/{s}"] = 0.0
    expected["perf/total_num_tokens"] = total
    expected["perf/time_per_step"] = seconds["step"]
    expected["perf/throughput"] = total / (seconds["step"] * 2)
    fwd = TransformerFlops(**FLOPS_ARGS).forward_flops(total, sq)
    expected["perf/mfu/actor"] = 3 * fwd / (seconds["update_actor"] * 2 * 1e15)
    expected["perf/mfu/actor_infer"] = fwd / (seconds["old_log_prob"] * 2 * 1e15)
    return expected, loads


def test_training_metrics_sync_exactly_on_two_ranks():
    results = run_distributed(_worker, world_size=2, timeout=240)
    expected, loads = _expected()
    for rank, (values, n_collectives, alone, local_tokens) in enumerate(results):
        assert n_collectives <= 4, f"{n_collectives} collectives (3 reductions + the layout check)"
        assert local_tokens == loads[rank]  # compute() restored the local states
        assert set(values) == set(expected)
        for key, want in expected.items():
            assert math.isclose(values[key], want, rel_tol=1e-9, abs_tol=1e-12), (key, values[key], want)
        for key, want in alone.items():
            assert math.isclose(want, expected[key], rel_tol=1e-9, abs_tol=1e-12), (key, want, expected[key])
    assert results[0][0] == results[1][0]
    # the per-rank figures really differ between ranks (the check above is not vacuous)
    assert loads[0] != loads[1] and expected["timing_s/gen"] == 3.0
