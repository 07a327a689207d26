"""On a GPU: are the compiled per-round sums right there, and what does each way of taking them cost?

Compiled for CUDA with torch < 2.13, ``_round_sums`` gave wrong sums (inductor's Triton ``searchsorted`` ignored a
view's storage offset, pytorch/pytorch#182343; fixed in ``_round_sums``). This script checks the compiled kernel
with rounds against the eager kernel on the same device and inputs (the cases of ``tests/test_kernel_rounds.py``'s
dynamic-shape test, late rounds included, and multi-round benchmark shapes; ``--no-check`` skips it), then times
the kernel calls (medians, synchronized, wall-clock): mismatch-only and with 16 rounds, eager and compiled, and
compiled + eager rounds (the interim CUDA workaround). ``--profile`` adds the eager kernel's top ops at 256 x 8192.

Run: ``python3 benchmarks/cuda_rounds.py`` (``--device cpu`` runs it here, as a smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from opbc_metrics.functional import mismatch as fm

CLAMP, VETO, BINS, ROUNDS = 20.0, 30.0, 8192, 16


def multi_round_inputs(b: int, t: int, device: torch.device, seed: int = 0, late: bool = False) -> tuple:
    """Float32 logprobs with ~t/256 rounds per row of random lengths (or, ``late``, all in the last 200 tokens)."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(b, t, generator=g) * 3.0
    rollout = (trainer + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    switch = torch.rand(b, t, generator=g) < (1 / 64 if not late else 1 / 4)
    mask = switch.cumsum(1) % 2 == 0
    if late:  # the tracked rounds start in a row's last chunks
        mask[:, : max(t - 200, 0)] = False
    else:
        mask &= torch.arange(t) < torch.randint(t // 2, t + 1, (b, 1), generator=g)
    trainer[0, t // 3] = float("nan")  # an invalid token inside a round
    return tuple(x.to(device) for x in (trainer, rollout, mask))


def check(device: torch.device) -> bool:
    run = fm.compiled_token_statistics()
    ok = True
    cases = [(4, 256), (8, 512), (3, 1000), (4, 4200), (2, 8256), (64, 4096), (256, 8192)]
    print("compiled per-round sums against eager, same device (max relative error over the round keys):")
    for (b, t), late in [(c, late) for c in cases for late in (False, True)]:
        args = (*multi_round_inputs(b, t, device, seed=t, late=late), CLAMP, VETO, 64, True, True)
        eager = fm.token_statistics(*args, 6)
        got = run(*args, 6)
        worst, where = 0.0, ""
        for key in (*fm.ROUND_STATS, "max_rounds", "rounds"):
            if key not in eager:
                continue
            e, g = eager[key].double().cpu(), got[key].double().cpu()
            err = ((g - e).abs() / e.abs().clamp_min(1e-6)).max().item()
            if err > worst:
                worst, where = err, key
        fine = worst <= 1e-5
        ok &= fine
        print(f"  {b:>4} x {t:<5} {'late ' if late else '     '} rounds {eager['max_rounds'].item():>5.0f}"
              f"  worst {worst:.2e} ({where or '-'}) {'ok' if fine else 'WRONG'}")
    return ok


def median_ms(fn, device: torch.device, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _calls(run, args: tuple) -> list:
    """The five kernel calls timed: eager / compiled, without / with rounds, and the interim CUDA path."""

    def current() -> None:  # the interim CUDA path: compiled without rounds, the rounds eagerly
        run(*args, True, True, 0)
        fm.token_statistics(*args, False, False, ROUNDS)

    return [lambda: fm.token_statistics(*args, True, True, 0), lambda: fm.token_statistics(*args, True, True, ROUNDS),
            lambda: run(*args, True, True, 0), lambda: run(*args, True, True, ROUNDS), current]


def timings(device: torch.device, shapes: list[tuple[int, int]]) -> None:
    run = fm.compiled_token_statistics()
    print("\nkernel calls, ms (median; multi-round inputs, 16 tracked rounds):")
    cols = ("eager", "eager+R", "compiled", "compiled+R", "comp+eagerR")
    print(f"  {'shape':>12} " + " ".join(f"{c:>11}" for c in cols) + "   with rounds / without: compiled, interim")
    for b, t in shapes:
        ms = [median_ms(f, device) for f in _calls(run, (*multi_round_inputs(b, t, device), CLAMP, VETO, BINS))]
        print(f"  {f'{b} x {t}':>12} " + " ".join(f"{m:>11.3f}" for m in ms)
              + f"   {ms[3] / ms[2]:.2f}x, {ms[4] / ms[2]:.2f}x")


def profile(device: torch.device) -> None:
    args = (*multi_round_inputs(256, 8192, device), CLAMP, VETO, BINS, True, True, ROUNDS)
    fm.token_statistics(*args)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            fm.token_statistics(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print("\neager kernel with rounds at 256 x 8192, 5 calls:")
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="64x4096,256x8192,512x16384")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare the compiled per-round sums with the eager ones first")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    ok = check(device) if args.check else None
    if args.profile:  # first: eager only, quick (the timings compile a graph per shape)
        profile(device)
    timings(device, [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])
    if ok is not None:
        print("\ncompiled per-round sums:", "right" if ok else "WRONG somewhere (see above)")


if __name__ == "__main__":
    main()
