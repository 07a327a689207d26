"""2-process gloo sync benchmark: the collection's packed sync against torchmetrics' per-state sync.

Run: ``python benchmarks/sync_worker.py [repeats]`` (spawns its own 2 ranks on localhost).
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from opbc_metrics import OPBCCollection
from opbc_metrics.collection import SECTIONS
from opbc_metrics.sync import packed_sync, restore_local_states


def _collection() -> OPBCCollection:
    return OPBCCollection(sections=list(SECTIONS))


def _batch(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    trainer = -torch.rand(8, 256, generator=g) * 3
    return {"trainer_logprobs": trainer, "rollout_logprobs": trainer + 0.05 * torch.randn(8, 256, generator=g),
            "response_mask": torch.ones(8, 256, dtype=torch.bool), "group_ids": torch.arange(8) // 4}


class _Counter:
    def __init__(self) -> None:
        self.n = 0
        self.saved = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast")}

    def __enter__(self) -> _Counter:
        for name, fn in self.saved.items():
            setattr(dist, name, self._wrap(fn))
        return self

    def _wrap(self, fn):
        def inner(*args, **kwargs):
            self.n += 1
            return fn(*args, **kwargs)

        return inner

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _per_state_sync(members: list[Metric]) -> None:
    """torchmetrics' default: each metric gathers each of its states (shapes, then data)."""
    for m in members:
        cache = m._copy_state_dict()
        Metric._sync_dist(m, gather_all_tensors, None)
        for attr, val in cache.items():
            setattr(m, attr, val)


def _packed_sync(metrics: OPBCCollection) -> None:
    """The collection's sync in compute(): one packed all_reduce of every member's states, then the local states
    back (as after the members' computes)."""
    synced = packed_sync(metrics.members())
    if not synced:
        raise RuntimeError("packed_sync synced no member: the benchmark would time nothing")
    restore_local_states(synced)


def _worker(rank: int, port: int, repeats: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    metrics = _collection()
    metrics.update(_batch(rank))
    members = metrics.members()
    n_states = sum(len(m._defaults) for m in members)
    state_values = sum(getattr(m, s).numel() for m in members for s in m._defaults)
    rows = {}
    for name, fn in (("packed (opbc-metrics)", lambda: _packed_sync(metrics)),
                     ("per-state (torchmetrics default)", lambda: _per_state_sync(members))):
        with _Counter() as counter:
            fn()
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        rows[name] = (counter.n, statistics.median(times))
    if rank == 0:
        out["rows"] = rows
        out["members"], out["states"], out["values"] = len(members), n_states, state_values
    dist.destroy_process_group()


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(port, repeats, out), nprocs=2, join=True)
    print(f"collection: {out['members']} metrics, {out['states']} states, {out['values']} float64 values")
    print(f"{'sync':<34} {'collectives':>11} {'median ms':>10}")
    base = out["rows"]["per-state (torchmetrics default)"][1]
    for name, (n, t) in out["rows"].items():
        print(f"{name:<34} {n:>11} {t * 1e3:>10.2f}   ({base / t:.1f}x faster than per-state)"
              if "packed" in name else f"{name:<34} {n:>11} {t * 1e3:>10.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
