"""The compiled kernel's two per-round paths on CPU, as multiples of the mismatch-only kernel on the same batch.

Run: ``.venv/bin/python benchmarks/round_paths.py`` (``--shapes 64x4096,128x8192``; ``--static`` skips the warm-up
over bench.py's six shapes, after which dynamo's graphs are dynamic-shape ones, as in bench.py and in a training
loop whose batches change shape). For each shape, timed in turn (medians of ``--repeats`` interleaved calls, process
CPU time, one thread): ``compiled_token_statistics()`` without rounds, with 16 rounds summed inside the mismatch
kernel's main loop, and with 16 rounds in a graph of their own after the mismatch-only one (the path
``SEPARATE_ROUNDS_ROW`` picks for longer rows), each printed as a multiple of the first.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench  # noqa: E402
from bench import interleaved  # noqa: E402  (same timing method as bench.py)

from opbc_metrics.functional import mismatch as fm  # noqa: E402

SHAPES = "64x4096,256x4096,512x1024,16x8192,64x8192,128x8192,256x8192,128x8100,8x16384"
ROUNDS, CLAMP, VETO, BINS = 16, 20.0, 30.0, 8192
PATHS = {"inside": 1 << 62, "separate": 0}  # SEPARATE_ROUNDS_ROW for each path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--static", action="store_true", help="no warm-up over bench.py's shapes (static graphs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = fm.compiled_token_statistics()
    default = fm.SEPARATE_ROUNDS_ROW

    def call(x: dict[str, torch.Tensor], rounds: int, path: str) -> object:
        fm.SEPARATE_ROUNDS_ROW = PATHS[path]
        try:
            return run(x["trainer_logprobs"], x["rollout_logprobs"], x["response_mask"], CLAMP, VETO, BINS,
                       True, True, rounds)
        finally:
            fm.SEPARATE_ROUNDS_ROW = default

    if not args.static:
        for b, t in bench.SHAPES:
            x = bench.make_inputs(b, t)
            for path in PATHS:
                call(x, ROUNDS, path)
            call(x, 0, "inside")
    print(f"# compiled kernel, {ROUNDS} rounds, x the mismatch-only kernel ({'static' if args.static else 'dynamic'} "
          f"graphs; SEPARATE_ROUNDS_ROW = {default}: rows longer take the separate path)")
    print(f"{'shape':>12} {'mismatch ms':>12} {'inside':>8} {'separate':>9}")
    for shape in args.shapes.split(","):
        b, t = (int(v) for v in shape.split("x"))
        x = bench.make_inputs(b, t)
        fns = {"none": lambda x=x: call(x, 0, "inside"), **{p: (lambda x=x, p=p: call(x, ROUNDS, p)) for p in PATHS}}
        med = interleaved(fns, args.repeats)
        print(f"{b:>5}x{t:<6} {med['none'] * 1e3:>12.2f} {med['inside'] / med['none']:>7.2f}x "
              f"{med['separate'] / med['none']:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
