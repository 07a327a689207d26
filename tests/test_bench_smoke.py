"""The benchmark script runs (a smoke run on tiny shapes; its figures are not asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_script_runs_quick():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--quick", "--no-compile",
         "--only", "update,naive,memory,sketch,sections"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for section in ("## update()", "## one step", "## memory", "## top-1% gradient mass", "## update() of the default"):
        assert section in out.stdout
    assert "after 1 update" in out.stdout


def test_controller_and_moe_benchmark_runs_quick():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_controller_moe.py"), "--quick"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("moe:", "controller at", "memory at", "top mass at"):
        assert line in out.stdout


def test_cuda_rounds_script_runs_on_the_cpu():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "cuda_rounds.py"), "--device", "cpu", "--no-check",
         "--shapes", "8x256"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernel calls" in out.stdout and "8 x 256" in out.stdout
