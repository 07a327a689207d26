#!/usr/bin/env bash
# The CUDA checks and benchmarks, for a machine with a GPU and PyTorch (no install: run from the repo root).
# tests/test_cuda.py (every section's values against the CPU's, no sync in update(), eager and compiled), then
# bench.py and bench_controller_moe.py on the GPU, then cuda_rounds.py (the eager kernel's profile, the per-round
# sums' timings; tests/test_cuda.py already compares them with eager).
# The limits add up to 560 s: one call (600 s at most).
# Each stage is time-bounded; logs go to $OUT (or ./cuda-logs).
set -uo pipefail
out="${OUT:-cuda-logs}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
nvidia-smi -L
$py -c "import torch, torchmetrics; print('torch', torch.__version__, 'torchmetrics', torchmetrics.__version__)"
timeout "${TEST_S:-140}" $py -m pytest -q -p no:cacheprovider --tb=short -rfE tests/test_cuda.py 2>&1 | tee "$out/tests.log" | tail -80
timeout "${BENCH_S:-140}" $py benchmarks/bench.py --device cuda --only "${BENCH_ONLY:-update,sections,precision}" 2>&1 | tee "$out/bench.log"
timeout "${MOE_S:-60}" $py benchmarks/bench_controller_moe.py --device cuda 2>&1 | tee "$out/controller_moe.log"
timeout "${NAIVE_S:-150}" $py benchmarks/bench.py --device cuda --only naive 2>&1 | tee "$out/naive.log"
timeout "${ROUNDS_S:-70}" $py benchmarks/cuda_rounds.py --no-check --profile 2>&1 | tee "$out/rounds.log"
