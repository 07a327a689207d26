"""The controller and the MoE section against baselines measured in the same run (ratios).

Run: ``.venv/bin/python benchmarks/bench_controller_moe.py`` (``--quick`` for a smoke run). Times are
medians of the process's CPU time with one intra-op thread (as ``bench.py``); the peak memory is measured
as ``peak_memory.py`` measures it, in a fresh process per measurement. ``--device cuda``: the same on the GPU
(wall-clock, synchronized after each call; memory from the CUDA allocator's peak).

Lines:
  moe         RouterSetDisagreement.update(), with and without num_experts, against RouterFlipRate.update()
              on the same (contiguous) expert ids; "moe compiled": the same with compiled=True (CPU, K > 2)
  controller  OPBCController.step() against the default OPBCCollection.update() on the same batch
  memory      peak extra memory of OPBCController.step() in bytes per token (and of the collection's update)
  top mass    the controller's per-group top-1% gradient mass against an exact sort: largest absolute error

``--moe-floor`` (CPU): instead, the K = 8 set disagreement's eager pipeline built up stage by stage (narrow copy,
range reductions, lane transpose, K x K compare), each as a multiple of the flip rate's update, with an A/A pair
of the set disagreement's update (benchmarks/README.md, MoE set disagreement, K = 8).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench  # noqa: E402
from bench import interleaved  # noqa: E402  (same timing method as bench.py)
from peak_memory import fixed_malloc, peak_extra_bytes  # noqa: E402

from opbc_metrics import OPBCCollection, OPBCController, RouterFlipRate, RouterSetDisagreement  # noqa: E402
from opbc_metrics.functional.moe import router_inputs  # noqa: E402


def router_batch(b: int, t: int, layers: int, k: int, experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # contiguous, as torch.topk returns them (a slice of the argsort would make every read strided)
    rollout = torch.argsort(torch.rand(b, t, layers, experts, generator=g), dim=-1)[..., :k].contiguous()
    trainer = rollout.clone()
    swap = torch.rand(b, t, layers, generator=g) < 0.1
    trainer[..., 0] = torch.where(swap, rollout[..., 1], rollout[..., 0])
    trainer[..., 1] = torch.where(swap, rollout[..., 0], rollout[..., 1])
    new = torch.rand(b, t, layers, generator=g) < 0.05
    trainer[..., -1] = torch.where(new, (rollout[..., -1] + 1) % experts, rollout[..., -1])
    mask = torch.ones(b, t, dtype=torch.bool)
    return _on_device({"rollout_experts": rollout, "trainer_experts": trainer, "response_mask": mask})


def _on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(bench.DEVICE) for k, v in batch.items()}


def logprob_batch(b: int, t: int, group_size: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(b, t, generator=g) * 3.0
    rollout = (trainer + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    groups = torch.arange(b) // group_size
    return _on_device({"trainer_logprobs": trainer, "rollout_logprobs": rollout, "response_mask": mask,
                       "group_ids": groups})


class FlipRateWithoutIdCheck(RouterFlipRate):
    """The flip rate's update as it was when the MoE target was set: the strided top-1 compare alone, without the
    per-token check for negative ids (placeholders) that the update now also runs. A baseline, so that the set
    ratios are not met by a slower flip rate."""

    def statistics(self, view: Any) -> dict[str, torch.Tensor]:
        rollout, trainer, mask = router_inputs(view, self.top_k)
        per_layer = ((rollout[..., 0] != trainer[..., 0]) & mask[..., None]).sum(dim=(0, 1)).to(torch.float64)
        bucket = torch.arange(rollout.shape[2], device=rollout.device).clamp(max=self.num_layers)
        layer_flips = torch.zeros(self.num_layers + 1, dtype=torch.float64, device=rollout.device)
        layer_pairs = torch.zeros_like(layer_flips)
        layer_flips.index_add_(0, bucket, per_layer)
        layer_pairs.index_add_(0, bucket, mask.sum().to(torch.float64).expand(rollout.shape[2]))
        none = torch.zeros_like(layer_flips[0])
        return {"layer_flips": layer_flips, "layer_pairs": layer_pairs, "negative_ids": none}


def bench_moe(quick: bool, repeats: int, compiled: bool) -> None:
    # Qwen3-30B-A3B-like (48 MoE layers, top-8 of 128) and Mixtral-like (32 layers, top-2 of 8)
    for shape in [(2, 512, 16, 8, 64)] if quick else [(4, 2048, 48, 8, 128), (4, 2048, 32, 2, 8)]:
        _bench_moe_shape(shape, repeats, compiled)


def _bench_moe_shape(shape: tuple[int, int, int, int, int], repeats: int, compiled: bool) -> None:
    batch = router_batch(*shape)
    flip = RouterFlipRate().to(bench.DEVICE)
    metrics = {"known": RouterSetDisagreement(num_experts=shape[4]),  # E from the config or not
               "unknown": RouterSetDisagreement()}
    # compiled=True changes the comparison only on CPU for K > 2 (elsewhere it is the eager row again)
    compiled = compiled and shape[3] > 2 and bench.DEVICE.type == "cpu"
    if compiled:
        metrics |= {"known compiled": RouterSetDisagreement(num_experts=shape[4], compiled=True),
                    "unknown compiled": RouterSetDisagreement(compiled=True)}
    unchecked = FlipRateWithoutIdCheck().to(bench.DEVICE)
    fns = {"top1": lambda: unchecked.update(batch), "flip": lambda: flip.update(batch)}
    for name, metric in metrics.items():
        metric.to(bench.DEVICE)
        fns[name] = lambda metric=metric: metric.update(batch)
    times = interleaved(fns, repeats)  # its warm-up calls compile
    ids = batch["rollout_experts"].numel()

    def ratios(name: str) -> str:
        return f"{times[name] * 1e3:.1f} ms -> {times[name] / times['flip']:.2f}x / {times[name] / times['top1']:.2f}x"

    print(f"moe: {ids / 1e6:.1f}M expert ids (B, T, L, K = {shape[:4]}, E = {shape[4]}): top-1 flip rate "
          f"{times['flip'] * 1e3:.1f} ms (without its id check {times['top1'] * 1e3:.1f} ms); set disagreement "
          f"with num_experts {ratios('known')}, without {ratios('unknown')} the flip rate / the flip rate without "
          "its id check (target <= 2x)")
    if compiled:
        print(f"moe compiled: with num_experts {ratios('known compiled')}, without {ratios('unknown compiled')} "
              "the flip rate / without its id check (target <= 2x)")


def bench_moe_floor(repeats: int) -> None:
    """The K = 8 pipeline of ``_set_differs_tokens`` (CPU chunks, E = 128) stage by stage: what each costs."""
    shape = (4, 2048, 48, 8, 128)
    batch = router_batch(*shape)
    tokens, layers, k = shape[0] * shape[1], shape[2], shape[3]
    ids = [batch[f].reshape(tokens, layers * k) for f in ("rollout_experts", "trainer_experts")]
    rows = (1 << 18) // (layers * k)  # as _CPU_CHUNK_IDS
    narrow = torch.empty((2, rows, layers, k), dtype=torch.uint8)
    lanes = torch.empty((2, k, rows, layers), dtype=torch.uint8)
    high, low = torch.empty(tokens, dtype=torch.int64), torch.empty(tokens, dtype=torch.int32)
    pairs = torch.empty((k, k, rows * layers), dtype=torch.uint8)
    found = torch.empty((2, k, rows * layers), dtype=torch.uint8)

    def stages(level: int) -> None:
        for start in range(0, tokens, rows):
            m = min(rows, tokens - start)
            for i, x in enumerate(side[start : start + m] for side in ids):
                if level >= 1:
                    torch.amax(x, -1, out=high[start : start + m])
                if level >= 2:
                    torch.amin(x.view(torch.int32), -1, out=low[start : start + m])
                narrow[i, :m].view(m, layers * k).copy_(x)
            if level >= 3:
                lanes[:, :, :m].copy_(narrow[:, :m].permute(0, 3, 1, 2))
            if level >= 4:
                n = m * layers
                r, t = (lanes[i, :, :m].reshape(k, n) for i in (0, 1))
                torch.bitwise_xor(r.unsqueeze(0), t.unsqueeze(1), out=pairs[:, :, :n])
                torch.amin(pairs[:, :, :n], 0, out=found[0, :, :n])
                torch.amin(pairs[:, :, :n], 1, out=found[1, :, :n])

    flip, sets, again = RouterFlipRate(), RouterSetDisagreement(num_experts=128), RouterSetDisagreement(num_experts=128)
    names = ["narrow copy", "+ int64 amax", "+ int32 amin (range)", "+ lane transpose", "+ K x K xor, 2 amin"]
    fns = {"flip": lambda: flip.update(batch), "set": lambda: sets.update(batch), "A/A": lambda: again.update(batch)}
    fns.update({name: (lambda level=level: stages(level)) for level, name in enumerate(names)})
    times = interleaved(fns, repeats)
    print(f"moe floor, B, T, L, K = {shape[:4]}, E = 128, flip rate update {times['flip'] * 1e3:.2f} ms:")
    for name, value in times.items():
        print(f"  {name:22s} {value / times['flip']:.2f}x")


def bench_controller(quick: bool, repeats: int) -> None:
    for b, t in ([(16, 1024)] if quick else [(64, 4096), (64, 32768)]):
        batch = logprob_batch(b, t)
        controller, collection = OPBCController().to(bench.DEVICE), OPBCCollection().to(bench.DEVICE)
        reps = max(3, repeats // (4 if t > 8192 else 1))
        fns = {"collection": lambda c=collection, x=batch: c.update(x), "step": lambda c=controller, x=batch: c.step(x)}
        times = interleaved(fns, reps)
        print(f"controller at {b}x{t}: default collection update {times['collection'] * 1e3:.1f} ms, step "
              f"{times['step'] * 1e3:.1f} ms -> {times['step'] / times['collection']:.2f}x (target <= 3x)")


def _peak_child(what: str, b: int, t: int) -> None:
    """In a fresh process: the peak extra memory of one controller step (or collection update), per token."""
    libc = fixed_malloc()
    batch = logprob_batch(b, t)
    target = OPBCController() if what == "step" else OPBCCollection()
    run = target.step if what == "step" else target.update
    run({k: v[:2] for k, v in batch.items()})  # warm-up
    extra = peak_extra_bytes(lambda: run(batch), libc)
    print(extra / (b * t))


def _cuda_peak(what: str, b: int, t: int) -> float:
    """Peak extra CUDA memory of one controller step (or collection update), bytes per token."""
    batch = logprob_batch(b, t)
    target = (OPBCController() if what == "step" else OPBCCollection()).to(bench.DEVICE)
    run = target.step if what == "step" else target.update
    run(batch)  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run(batch)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / (b * t)


def bench_memory(quick: bool) -> None:
    if bench.DEVICE.type == "cuda":
        b, t = (16, 4096) if quick else (64, 32768)
        step, update = _cuda_peak("step", b, t), _cuda_peak("update", b, t)
        print(f"memory at {b}x{t} (CUDA allocator): controller step peak extra {step:.1f} bytes/token (target <= 24), "
              f"default collection update {update:.1f} bytes/token")
        return
    if not os.path.exists("/proc/self/clear_refs"):
        print("memory: skipped (needs Linux /proc)")
        return
    b, t = (16, 4096) if quick else (64, 32768)
    out = {}
    for what in ("step", "update"):
        res = subprocess.run([sys.executable, __file__, "--peak-child", what, str(b), str(t)], capture_output=True,
                             text=True, check=True)
        out[what] = float(res.stdout.strip().splitlines()[-1])
    print(f"memory at {b}x{t}: controller step peak extra {out['step']:.1f} bytes/token (target <= 24), default "
          f"collection update {out['update']:.1f} bytes/token")


def bench_top_mass(quick: bool) -> None:
    from opbc_metrics.functional import controller as FC
    from opbc_metrics.functional.mismatch import sketch_relative_error_bound

    b, t = (16, 2048) if quick else (64, 8192)
    batch = logprob_batch(b, t)
    tail = 2.0 * torch.rand(b, t, device=bench.DEVICE) ** 8
    batch["rollout_logprobs"] = batch["rollout_logprobs"] - tail  # a heavy tail
    out = OPBCController(track_budget=False).step(batch)
    got = out.values["top_1pct_gradient_mass"][: int(out.index.num_groups)]
    batch = {k: v.cpu() for k, v in batch.items()}
    r = (batch["trainer_logprobs"] - batch["rollout_logprobs"]).double().clamp(-20, 20)
    w = torch.where(batch["response_mask"], r.exp(), torch.zeros_like(r))
    errors, relative = [], []
    for g in range(int(out.index.num_groups)):
        rows = w[batch["group_ids"] == g].flatten()
        n = int(batch["response_mask"][batch["group_ids"] == g].sum())
        k = max(1, int(0.01 * n))
        exact = rows.sort(descending=True).values[:k].sum() / rows.sum()
        errors.append(abs(float(got[g]) - float(exact)))
        relative.append(errors[-1] / float(exact))
    bound = sketch_relative_error_bound(20.0, FC.group_top_mass_bins(out.index.capacity))
    print(f"top mass at {b}x{t}: per-group top-1% mass against an exact sort: largest absolute error "
          f"{max(errors):.2e}, relative {max(relative):.2e} (documented bound {bound:.2e})")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peak-child":
        torch.set_num_threads(1)
        _peak_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats (a smoke run)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (wall-clock, synchronized after each call)")
    parser.add_argument("--moe-floor", action="store_true", help="K = 8 set disagreement by stage (CPU)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled set disagreement rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench.DEVICE = torch.device(args.device)
    if bench.DEVICE.type == "cuda":
        bench.CLOCK, bench.SYNC = time.perf_counter, torch.cuda.synchronize
        print(f"# on {torch.cuda.get_device_name(bench.DEVICE)}, torch {torch.__version__}")
    repeats = 3 if args.quick else args.repeats
    if args.moe_floor:
        bench_moe_floor(repeats)
        return
    bench_moe(args.quick, repeats, not args.no_compile)
    bench_controller(args.quick, repeats)
    bench_memory(args.quick)
    bench_top_mass(args.quick)


if __name__ == "__main__":
    main()
