"""Run a function on N gloo processes on localhost, bounded in time.

Usage: ``results = run_distributed(fn, world_size=2, args=(...))`` where ``fn(rank, world_size, *args)``
is a module-level function (it is pickled into spawned processes). Returns each rank's return value,
in rank order. A rank that raises fails the test with its traceback; ranks that do not finish within
``timeout`` seconds are killed and the test fails: a hung collective never hangs CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest

COLLECTIVES = ("all_reduce", "all_gather", "broadcast", "all_gather_object")


@contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Count the ``torch.distributed`` collectives issued inside the block: ``with count_collectives() as c:
    ...; c["n"]``. Patches the module functions for the block (call them as ``dist.all_reduce``)."""
    import torch.distributed as dist

    calls = {"n": 0}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counting(fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out: Any, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("WANDB_MODE", "offline")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        out.put((rank, "ok", result))
    except BaseException:  # report everything, including SystemExit from a dying rank
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    expect_errors: bool = False,
) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return their results.

    With ``expect_errors=True`` a rank's failure is returned as ``("error", traceback)`` instead of
    failing the test (for fault-injection tests); a timeout always fails.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                pytest.fail(f"distributed test timed out after {timeout}s; ranks {missing} did not finish")
            try:
                rank, status, value = out.get(timeout=min(remaining, 1.0))
                results[rank] = (status, value)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    if expect_errors:
                        for r in dead:
                            results[r] = ("error", f"rank {r} exited with code {procs[r].exitcode}")
                    else:
                        pytest.fail(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    ordered = []
    for r in range(world_size):
        status, value = results[r]
        if status == "error" and not expect_errors:
            pytest.fail(f"rank {r} raised:\n{value}")
        ordered.append(value if status == "ok" else ("error", value))
    return ordered
