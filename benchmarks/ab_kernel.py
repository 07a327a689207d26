"""A/B of the mismatch kernel: a git revision's ``token_statistics`` against another's (or the working tree's).

Run: ``.venv/bin/python benchmarks/ab_kernel.py --old 15d0f27^`` (``--new REV``, default the working tree;
``--modes eager,compiled``; ``--shapes 64x4096,128x8192``; ``--drifts 1e-3,0.05``; ``--reps``).
``git archive REV opbc_metrics`` unpacks each revision's package into a temporary directory; each tree runs
in its own worker process (one intra-op thread, ``TORCHINDUCTOR_COMPILE_THREADS=1``) that imports only that
tree. The parent asks the two workers in turn, alternating which goes first, to time a batch of calls of the
mismatch-only kernel call (``token_statistics(trainer, rollout, mask, clamp, veto, bins, prob=True,
hist=True)``, no per-round sums; ``--rounds 16``: with the default collection's per-round sums; compiled:
``compiled_token_statistics()``); fresh workers per shape, drift and mode, so every shape has its own static
graph (``--dynamic``: each worker first calls bench.py's six shapes, so that, as in bench.py, the compiled
graphs are dynamic-shape ones). ``--call update`` / ``--call step`` time the default collection instead
(``OPBCCollection(compiled=...)``) on ``naive_baseline.step_batch`` (every default section's fields): its
``update()`` (reset every 50 calls), or one whole step (update, compute, ``host_floats`` of the values, reset).
The drift is the std of the inputs' per-token log-ratio:
0.05 (the default) spreads the tokens over the histogram's bins, 1e-3 (bf16 against fp32 engines) puts most
of them in one or two.
Times are each worker's process CPU time per call, so the neighbours' load on a shared machine moves both
sides alike. Printed per shape and mode: the medians, their ratio new/old, and the median and quartiles of
the paired ratios (the spread), and the ratio of the fastest samples.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = "64x4096,128x8192,256x8192"
WARM_UP_SHAPES = ((8, 1024), (64, 1024), (64, 4096), (128, 8192), (256, 8192), (128, 8100))  # bench.py's
CLAMP, VETO, BINS = 20.0, 30.0, 8192
# Calls per timed sample: a sample of about this many CPU seconds.
SAMPLE_SECONDS = 0.05


def collection_call(b: int, t: int, mode: str, call: str) -> tuple[object, tuple[object, ...]]:
    """A no-argument function running the default collection's ``update`` or whole step on a step batch."""
    from naive_baseline import step_batch

    from opbc_metrics import OPBCCollection
    from opbc_metrics.batch import host_floats

    metrics, x = OPBCCollection(compiled=mode == "compiled"), step_batch(b, t)
    calls = [0]

    def update() -> None:
        metrics.update(x)
        calls[0] += 1
        if calls[0] % 50 == 0:  # (bounded states' values; the state size is fixed either way)
            metrics.reset()

    def step() -> None:
        metrics.update(x)
        host_floats(metrics.compute())
        metrics.reset()

    return (update if call == "update" else step), ()


def worker(tree: str) -> None:
    """Serve timing requests on stdin/stdout for the opbc_metrics package under ``tree``."""
    sys.path.insert(0, tree)
    import torch

    import opbc_metrics
    from opbc_metrics.functional import mismatch

    if not os.path.abspath(opbc_metrics.__file__).startswith(os.path.abspath(tree) + os.sep):
        raise RuntimeError(f"imported {opbc_metrics.__file__}, not the tree {tree}")
    sys.path.insert(1, os.path.join(ROOT, "benchmarks"))
    from bench import make_inputs

    torch.set_num_threads(1)
    fn = None
    args: tuple[object, ...] = ()
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "setup":  # setup B T MODE DRIFT ROUNDS DYNAMIC: build the inputs, compile, warm up; reply CPU
            # seconds per call
            b, t, mode, drift, rounds, dynamic = int(rest[0]), int(rest[1]), rest[2], float(rest[3]), int(rest[4]), \
                rest[5] == "1"
            call = rest[6]
            if call != "kernel":
                fn, args = collection_call(b, t, mode, call)
                for _ in range(3):
                    fn()
                t0 = time.process_time()
                fn()
                print(time.process_time() - t0, flush=True)
                continue
            if mode == "compiled":
                fn = mismatch.compiled_token_statistics()
            else:
                fn = mismatch.token_statistics
            if dynamic:  # bench.py's shapes first: from the third on, dynamo compiles dynamic-shape graphs
                for shape in WARM_UP_SHAPES:
                    w = make_inputs(*shape)
                    fn(w["trainer_logprobs"], w["rollout_logprobs"], w["response_mask"], CLAMP, VETO, BINS, True,
                       True, rounds)
            x = make_inputs(b, t, drift=drift)
            args = (x["trainer_logprobs"], x["rollout_logprobs"], x["response_mask"], CLAMP, VETO, BINS, True, True,
                    rounds)
            for _ in range(3):
                fn(*args)
            t0 = time.process_time()
            fn(*args)
            reply = time.process_time() - t0
        elif cmd == "time":  # time N: CPU seconds of N calls
            n = int(rest[0])
            t0 = time.process_time()
            for _ in range(n):
                fn(*args)
            reply = time.process_time() - t0
        else:
            raise ValueError(line)
        print(reply, flush=True)


class Worker:
    def __init__(self, tree: str) -> None:
        env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", tree], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())

    def ask(self, line: str) -> float:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"worker died on {line!r}")
        return float(reply)

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait()


def tree_of(rev: str, tmp: str) -> str:
    if rev == ".":
        return ROOT
    path = tempfile.mkdtemp(dir=tmp)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "opbc_metrics"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", path], input=archive.stdout, check=True)
    return path


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", default="15d0f27^", help="baseline revision")
    parser.add_argument("--new", default=".", help="candidate revision ('.': the working tree)")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--reps", type=int, default=40, help="paired samples per shape and mode")
    parser.add_argument("--drifts", default="0.05",
                        help="std of the inputs' per-token log-ratio (bench.make_inputs), comma-separated")
    parser.add_argument("--rounds", type=int, default=0,
                        help="per-round capacity of the call (16: the default collection's); 0: mismatch only")
    parser.add_argument("--dynamic", action="store_true",
                        help="each worker first calls bench.py's shapes, so that the graphs are dynamic-shape ones")
    parser.add_argument("--call", default="kernel", choices=("kernel", "update", "step"),
                        help="what is timed: the kernel call (default), the default collection's update(), or its step")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    what = f"rounds={args.rounds}" if args.rounds else "mismatch only"
    if args.call != "kernel":
        what = f"the default collection's {args.call}, naive_baseline.step_batch"
    timed = "token_statistics" if args.call == "kernel" else "OPBCCollection"
    print(f"# A/B of {timed} ({what}{', dynamic shapes' if args.dynamic else ''}): new={args.new} /"
          f" old={args.old}; process CPU time per call,"
          f" 1 thread, {args.reps} interleaved paired samples of ~{SAMPLE_SECONDS * 1e3:.0f} ms each")
    print(f"{'mode':>8} {'drift':>6} {'shape':>10} {'old ms':>8} {'new ms':>8} {'new/old':>8}"
          f" {'paired median [q1, q3]':>24} {'min/min':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        trees = tree_of(args.old, tmp), tree_of(args.new, tmp)
        for mode, drift, (b, t) in itertools.product(args.modes.split(","), args.drifts.split(","), shapes):
            # Fresh workers per shape and mode: in one long-lived worker, a shape's time depended on what ran
            # before it (measured: up to 1.5x at 256 x 8192 compiled against a fresh process).
            old, new = Worker(trees[0]), Worker(trees[1])
            try:
                setup = f"setup {b} {t} {mode} {drift} {args.rounds} {int(args.dynamic)} {args.call}"
                per_call = max(old.ask(setup), new.ask(setup))
                n = max(1, round(SAMPLE_SECONDS / max(per_call, 1e-6)))
                times: dict[str, list[float]] = {"old": [], "new": []}
                for rep in range(args.reps):
                    order = (("old", old), ("new", new)) if rep % 2 == 0 else (("new", new), ("old", old))
                    for name, w in order:
                        times[name].append(w.ask(f"time {n}") / n)
            finally:
                old.close()
                new.close()
            ratios = [a / b for a, b in zip(times["new"], times["old"])]
            mo, mn = statistics.median(times["old"]), statistics.median(times["new"])
            q1, med, q3 = quartiles(ratios)
            print(f"{mode:>8} {float(drift):>6.0e} {b:>4}x{t:<5} {mo * 1e3:>8.2f} {mn * 1e3:>8.2f} {mn / mo:>8.3f} "
                  f"{med:>10.3f} [{q1:.3f}, {q3:.3f}] {min(times['new']) / min(times['old']):>8.3f}", flush=True)


if __name__ == "__main__":
    main()
