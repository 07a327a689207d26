"""opbc-metrics benchmarks: ratios against baselines measured in the same run.

Run: ``.venv/bin/python benchmarks/bench.py`` (``--quick`` for a smoke run, ``--only update,sync``
to pick sections). Every figure is a median over repeats; what matters are the ratios, which
compare code run on the same machine, in the same process, on the same data, timed in turn within
each repeat. Times are the process's CPU time with one intra-op thread by default (``--threads``,
``--wall``): on a shared 2-core VM, wall-clock medians swing several-fold with the neighbours' load,
while CPU time measures the work itself. ``--device cuda`` times on the GPU (wall-clock, synchronized after
each call) over the larger shapes.

Sections:
  update   the full mismatch collection's update() against the floor (one fused pass that reads the
           two logprob tensors and the mask once and reduces them), eager and compiled, over shapes
  naive    one step of the default collection against the way peers compute every one of its keys: each
           metric its own pass with .item() per value, per-round as verl PR #5229 (naive_baseline.py); also
           the step's parts (update, compute, reading the values, reset), and on CUDA the compiled collection too
  sync     2-process gloo: the collection's packed sync against torchmetrics' per-state sync
  memory   state bytes after 1 and 1000 updates; peak memory of one update against its inputs
  sketch   the top-1% histogram sketch: cost and error against an exact sort
  sections the default collection's update and each default section's alone, against the floor
  precision float32 inputs near on-policy: every mismatch key against the float64 result on the same numbers
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from opbc_metrics import OPBCCollection, host_floats  # noqa: E402
from opbc_metrics.batch import UnreadFieldWarning  # noqa: E402

# Each section's own collection is timed on the whole batch: the other sections' fields are unread by design.
warnings.filterwarnings("ignore", category=UnreadFieldWarning)

# The last: a length that is no multiple of the compiled kernel's 64-token chunks, as most real batches (its
# per-round sums once fell back to a scalar loop there under dynamic shapes, 450x slower).
SHAPES = [(8, 1024), (64, 1024), (64, 4096), (128, 8192), (256, 8192), (128, 8100)]
QUICK_SHAPES = [(8, 256), (32, 1024)]
CUDA_SHAPES = [(64, 4096), (256, 8192), (512, 16384)]
DEVICE = torch.device("cpu")


def make_inputs(b: int, t: int, seed: int = 0, drift: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(b, t, generator=g) * 3.0
    rollout = (trainer + drift * torch.randn(b, t, generator=g)).clamp(max=0.0)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    x = {"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask}
    return {k: v.to(DEVICE) for k, v in x.items()}


CLOCK: Callable[[], float] = time.process_time


def _no_sync() -> None:
    pass


SYNC: Callable[[], None] = _no_sync  # torch.cuda.synchronize on CUDA: a call's time includes its kernels


def timeit(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        SYNC()
        times.append(CLOCK() - t0)
    return statistics.median(times)


def _floor(t: torch.Tensor, r: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return ((t - r) * m).sum()


_floor_compiled = torch.compile(_floor, fullgraph=True, dynamic=False)


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each function, timed in turn within each repeat, so that load
    drifting on a shared machine hits all of them alike (ratios of these medians are what we report)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = CLOCK()
            fn()
            SYNC()
            times[name].append(CLOCK() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_update(shapes: list[tuple[int, int]], repeats: int, compiled: bool) -> None:
    print("\n## update(): the mismatch collection against the floor (median ms; ratio to the compiled floor)")
    print(f"{'shape':>12} {'tokens':>9} {'floor':>8} {'floor eager':>11} {'eager':>8} {'x floor':>8}"
          + (f" {'compiled':>9} {'x floor':>8}" if compiled else ""))
    for b, t in shapes:
        x = make_inputs(b, t)
        tr, ro, m = x["trainer_logprobs"], x["rollout_logprobs"], x["response_mask"]
        eager_metrics = OPBCCollection(sections=["mismatch"]).to(DEVICE)
        fns: dict[str, Callable[[], object]] = {
            "floor": lambda: _floor_compiled(tr, ro, m),  # noqa: B023
            "floor_eager": lambda: _floor(tr, ro, m),  # noqa: B023
            "eager": lambda: eager_metrics.update(x),  # noqa: B023
        }
        if compiled:
            compiled_metrics = OPBCCollection(sections=["mismatch"], compiled=True).to(DEVICE)
            fns["compiled"] = lambda: compiled_metrics.update(x)  # noqa: B023
        med = interleaved(fns, repeats)
        floor = med["floor"]
        line = (f"{b:>5}x{t:<6} {b * t:>9} {floor * 1e3:>8.3f} {med['floor_eager'] * 1e3:>11.3f} "
                f"{med['eager'] * 1e3:>8.2f} {med['eager'] / floor:>8.1f}")
        if compiled:
            line += f" {med['compiled'] * 1e3:>9.2f} {med['compiled'] / floor:>8.1f}"
        print(line, flush=True)
    if compiled:
        # The response cut out of a longer padded batch, as frameworks pass it: strided inputs (the compiled wrapper
        # copies them first; the graph for strided inputs was ~10x slower).
        b, t = shapes[-1]
        wide = make_inputs(b, t + 37)
        cut = {k: v[:, 37:] for k, v in wide.items()}
        dense = {k: v.contiguous() for k, v in cut.items()}
        collections = [OPBCCollection(sections=["mismatch"], compiled=True).to(DEVICE) for _ in range(2)]
        med = interleaved({"dense": lambda: collections[0].update(dense), "cut": lambda: collections[1].update(cut)},
                          repeats)
        print(f"compiled, {b}x{t} as a [:, 37:] slice of {b}x{t + 37}: {med['cut'] * 1e3:.2f} ms, "
              f"{med['cut'] / med['dense']:.2f}x the contiguous inputs' update", flush=True)


def bench_naive(shapes: list[tuple[int, int]], repeats: int, compiled: bool) -> None:
    from naive_baseline import naive_default_keys, step_batch

    modes = ("eager", "compiled") if compiled else ("eager",)
    print("\n## one step of the default collection (update + compute + reading every value with host_floats + reset)"
          " against the naive per-metric .item() baseline for every key it reports (benchmarks/naive_baseline.py), on a"
          " batch every default section reads (median ms); then the step's parts, timed apart"
          + (" (compiled: OPBCCollection(compiled=True), the mode for a GPU)" if compiled else ""))
    print(f"{'shape':>12} {'mode':>9} {'naive':>9} {'collection':>11} {'speed-up':>9} {'keys':>5} {'max rel. diff':>14}"
          f" {'update':>8} {'compute':>8} {'read':>6} {'reset':>6}")
    for b, t in shapes:
        x = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in step_batch(b, t).items()}
        for mode in modes:
            metrics = OPBCCollection(compiled=mode == "compiled").to(DEVICE)

            def ours() -> dict[str, float]:
                metrics.update(x)  # noqa: B023
                out = host_floats(metrics.compute())  # as the loggers read it: one copy, not a sync per key  # noqa: B023
                metrics.reset()  # noqa: B023
                return out

            med = interleaved({"naive": lambda: naive_default_keys(x), "ours": ours}, repeats)  # noqa: B023
            mine, naive = ours(), naive_default_keys(x)
            if set(mine) != set(naive):
                raise AssertionError(f"naive baseline keys differ: {sorted(set(mine) ^ set(naive))}")
            diff = max(abs(mine[k] - naive[k]) / max(abs(naive[k]), 1e-12) for k in mine)
            parts = step_parts(metrics, x, repeats)
            print(f"{b:>5}x{t:<6} {mode:>9} {med['naive'] * 1e3:>9.2f} {med['ours'] * 1e3:>11.2f} "
                  f"{med['naive'] / med['ours']:>9.1f} {len(mine):>5} {diff:>14.1e} "
                  + " ".join(f"{parts[k] * 1e3:>{w}.2f}" for k, w in (("update", 8), ("compute", 8), ("read", 6),
                                                                     ("reset", 6))), flush=True)


def step_parts(metrics: OPBCCollection, x: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each part of a step (update, compute, host_floats of the values, reset), each timed
    alone (synchronized on CUDA after each part)."""
    times: dict[str, list[float]] = {"update": [], "compute": [], "read": [], "reset": []}
    for i in range(repeats + 2):
        t0 = CLOCK()
        metrics.update(x)
        SYNC()
        t1 = CLOCK()
        values = metrics.compute()
        SYNC()
        t2 = CLOCK()
        host_floats(values)
        t3 = CLOCK()
        metrics.reset()
        SYNC()
        t4 = CLOCK()
        if i >= 2:  # warm-up
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[k].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def run_script(name: str, *args: object, timeout: float = 600) -> None:
    """Run ``benchmarks/<name>`` in its own process and print what it printed; raise if it failed."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *map(str, args)],
                         capture_output=True, text=True, timeout=timeout)
    if out.stdout.strip():
        print(out.stdout.strip())
    if out.returncode != 0:
        raise RuntimeError(f"{name} exited with status {out.returncode}:\n{out.stderr[-3000:]}")


def bench_sync(repeats: int) -> None:
    print("\n## sync: 2-process gloo, whole collection (median ms per compute() sync)")
    run_script("sync_worker.py", repeats)


def state_bytes(metrics: OPBCCollection) -> int:
    return sum(v.numel() * v.element_size() for v in metrics.state_dict().values())


def bench_memory(quick: bool) -> None:
    print("\n## memory")
    metrics = OPBCCollection()
    x = make_inputs(4, 64)
    metrics.update(x)
    one = state_bytes(metrics)
    for _ in range(999):
        metrics.update(x)
    print(f"state bytes after 1 update: {one}; after 1000 updates: {state_bytes(metrics)}")
    b, t = (32, 1024) if quick else (256, 8192)
    for sections in (["mismatch"], []):
        run_script("peak_memory.py", b, t, *sections)


def bench_sketch(shapes: list[tuple[int, int]], repeats: int) -> None:
    from opbc_metrics import TopGradientMass

    print("\n## top-1% gradient mass: histogram sketch against an exact sort (heavy-tailed log ratios)")
    print(f"{'shape':>12} {'sketch ms':>10} {'exact ms':>9} {'rel. error':>11} {'bound':>8}")
    for b, t in shapes:
        g = torch.Generator().manual_seed(1)
        trainer = -torch.rand(b, t, generator=g) * 3.0
        u = torch.rand(b, t, generator=g).clamp_min(1e-9)
        rollout = (trainer - torch.randn(b, t, generator=g) / u ** (2 / 3)).clamp(max=0.0)
        x = {"trainer_logprobs": trainer, "rollout_logprobs": rollout}
        sk, ex = TopGradientMass(), TopGradientMass(exact=True)

        def run(m: TopGradientMass) -> float:
            m.reset()
            m.update(x)  # noqa: B023
            return m.compute().item()

        s_ms, e_ms = timeit(lambda: run(sk), repeats), timeit(lambda: run(ex), repeats)  # noqa: B023
        s, e = run(sk), run(ex)
        print(f"{b:>5}x{t:<6} {s_ms * 1e3:>10.2f} {e_ms * 1e3:>9.2f} {abs(s - e) / e:>11.2e} {sk.error_bound:>8.2e}",
              flush=True)


def bench_sections(shapes: list[tuple[int, int]], repeats: int, compiled: bool) -> None:
    from opbc_metrics.collection import DEFAULT_SECTIONS

    print("\n## update() of the default collection and of each default section alone (median ms; x the compiled"
          " floor); 'default/mismatch': the default collection against the mismatch section alone, same mode")
    modes = (False, True) if compiled else (False,)
    for mode in modes:
        print(f"{'eager' if not mode else 'compiled':>8} {'shape':>12} {'floor':>8} {'default':>14} "
              + " ".join(f"{s:>14}" for s in (("mismatch",) if mode and DEVICE.type == "cuda" else DEFAULT_SECTIONS))
              + f" {'default/mismatch':>17}")
        for b, t in shapes:
            x = make_inputs(b, t)
            tr, ro, m = x["trainer_logprobs"], x["rollout_logprobs"], x["response_mask"]
            # On CUDA the compiled mode times the two the target compares (each compiled graph takes a while).
            sections = ("mismatch",) if mode and DEVICE.type == "cuda" else DEFAULT_SECTIONS
            collections = {"default": OPBCCollection(compiled=mode).to(DEVICE),
                           **{s: OPBCCollection(sections=[s], compiled=mode).to(DEVICE) for s in sections}}
            fns: dict[str, Callable[[], object]] = {"floor": lambda: _floor_compiled(tr, ro, m)}  # noqa: B023
            fns.update({name: (lambda c=c: c.update(x)) for name, c in collections.items()})  # noqa: B023
            med = interleaved(fns, repeats)
            cells = " ".join(f"{med[k] * 1e3:>7.2f} {med[k] / med['floor']:>5.1f}x" for k in collections)
            print(f"{'eager' if not mode else 'compiled':>8} {b:>5}x{t:<6} {med['floor'] * 1e3:>8.3f} {cells} "
                  f"{med['default'] / med['mismatch']:>16.2f}x", flush=True)


def bench_precision(shape: tuple[int, int], compiled: bool) -> None:
    print("\n## precision: float32 inputs near on-policy, every mismatch key against the float64 result on the same"
          " numbers (max relative error over keys, |error| <= 1e-12 counted as 0; target 1e-5)")
    b, t = shape
    for drift in (1e-4, 1e-3, 1e-2):
        x = make_inputs(b, t, drift=drift)
        x64 = {k: v.double() if v.is_floating_point() else v for k, v in x.items()}
        want = {k: v.item() for k, v in OPBCCollection(sections=["mismatch"]).to(DEVICE)(x64).items()}
        cells = []
        for mode in ("eager", "compiled") if compiled else ("eager",):
            got = OPBCCollection(sections=["mismatch"], compiled=mode == "compiled").to(DEVICE)(x)
            errors = {k: 0.0 if abs(v.item() - want[k]) <= 1e-12 else abs(v.item() - want[k]) / abs(want[k])
                      for k, v in got.items()}
            worst = max(errors, key=errors.__getitem__)
            cells.append(f"{mode} {errors[worst]:.1e} ({worst})")
        print(f"{b:>5}x{t:<6} drift {drift:.0e}: " + ", ".join(cells), flush=True)


SECTIONS = ("update", "naive", "sync", "memory", "sketch", "sections", "precision")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the sections asked for; a section that crashes is reported and the others still run, then the
    process exits with status 1 naming the crashed sections."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats (smoke run)")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile path")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--wall", action="store_true", help="time wall-clock instead of process CPU time")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (wall-clock, synchronized after each call)")
    args = parser.parse_args(argv)
    global CLOCK, DEVICE, SYNC
    torch.set_num_threads(args.threads)
    DEVICE = torch.device(args.device)
    if args.wall or DEVICE.type == "cuda":
        CLOCK = time.perf_counter
    if DEVICE.type == "cuda":
        SYNC = torch.cuda.synchronize
    shapes = QUICK_SHAPES if args.quick else CUDA_SHAPES if DEVICE.type == "cuda" else SHAPES
    repeats = 3 if args.quick else 15
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    if only - set(SECTIONS):
        parser.error(f"argument --only: unknown section(s) {sorted(only - set(SECTIONS))}; "
                     f"choose from {', '.join(SECTIONS)}")
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"# opbc-metrics benchmark: torch {torch.__version__}, {where}, "
          f"{os.cpu_count()} cpus, {'process CPU time' if CLOCK is time.process_time else 'wall-clock'}, "
          f"{'quick' if args.quick else 'full'}")
    runs: dict[str, Callable[[], None]] = {
        "update": lambda: bench_update(shapes, repeats, compiled=not args.no_compile),
        "naive": lambda: bench_naive(shapes, repeats, compiled=DEVICE.type == "cuda" and not args.no_compile),
        "sync": lambda: bench_sync(5 if args.quick else 30),
        "memory": lambda: bench_memory(args.quick) if DEVICE.type == "cpu" else None,  # host memory
        "sketch": lambda: bench_sketch(shapes, repeats),
        "sections": lambda: bench_sections(shapes, 5 if args.quick else 7, compiled=not args.no_compile),
        "precision": lambda: bench_precision(shapes[-1] if args.quick else (64, 4096), compiled=not args.no_compile),
    }
    failed = []
    for name in SECTIONS:
        if name not in only:
            continue
        try:
            runs[name]()
        except Exception:
            sys.stdout.flush()
            traceback.print_exc()
            print(f"!! section {name} crashed (traceback on stderr)", flush=True)
            failed.append(name)
        gc.collect()
    if failed:
        sys.exit(f"bench.py: section(s) crashed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
