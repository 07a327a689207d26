"""The benchmark script runs (a smoke run on tiny shapes; its figures are not asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import load_module

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


def test_benchmark_sync_section_runs_quick():
    """The 2-process gloo sync section (it crashed when the packed sync moved to opbc_metrics.sync, and the
    benchmark still exited 0)."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--quick", "--only", "sync"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "crashed" not in out.stdout
    assert "## sync" in out.stdout and "packed (opbc-metrics)" in out.stdout
    assert "per-state (torchmetrics default)" in out.stdout


def test_benchmark_exits_nonzero_when_a_section_crashes(monkeypatch, capsys):
    """A crashing section is reported, the later sections still run, and the process exits non-zero."""
    bench = load_module(os.path.join(ROOT, "benchmarks", "bench.py"), "bench_under_test")
    ran = []

    def crash(*args, **kwargs):
        raise RuntimeError("sync_worker.py exited with status 1")

    monkeypatch.setattr(bench, "bench_sync", crash)
    monkeypatch.setattr(bench, "bench_sketch", lambda *args, **kwargs: ran.append("sketch"))
    monkeypatch.setattr(bench.torch, "set_num_threads", lambda n: None)  # main() sets 1: not for this process
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--only", "sync,sketch"])
    assert exc.value.code == "bench.py: section(s) crashed: sync"  # printed on stderr, exit status 1
    assert ran == ["sketch"]
    captured = capsys.readouterr()
    assert "!! section sync crashed" in captured.out and "RuntimeError: sync_worker.py exited" in captured.err
    with pytest.raises(SystemExit) as exc:
        bench.main(["--only", "syncc"])
    assert exc.value.code == 2 and "unknown section(s) ['syncc']" in capsys.readouterr().err


def test_run_script_raises_on_a_failing_script():
    bench = load_module(os.path.join(ROOT, "benchmarks", "bench.py"), "bench_under_test")
    with pytest.raises(RuntimeError, match=r"no_such_script\.py exited with status"):
        bench.run_script("no_such_script.py", timeout=60)


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
