#!/usr/bin/env bash
# One device call after a fast-path change: the new kernels' GPU tests, `specdec bench` at the 4B shape, the
# per-step profile, then the graph / fast-path / sync GPU tests, each under its own time limit.
# Usage on the device machine: bash bench/gpu_round.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout 90 python3 -m pytest -q -m gpu tests/test_kernel_rotary.py tests/test_kernel_norm.py -p no:cacheprovider \
  > "$out/gpu_kernel_tests.log" 2>&1; echo "kernel tests exit $?"; tail -2 "$out/gpu_kernel_tests.log"
timeout 270 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
  --make-tiny qwen3.5-4b --layers 32 --paths inproc gateway peer --drafters none mtp@3.39 --concurrency 1 16 64 \
  --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget 250 --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench exit $?"; tail -25 "$out/bench.log"
mkdir -p "$out/profile"; (cd bench && PYTHONPATH=/tmp/site:$PWD/..:$PWD timeout 100 python3 -P profile_steps.py --skip-prefill \
  --out "$out/profile" > "$out/profile_steps.log" 2>&1); echo "profile exit $?"
grep -E "ms per step|kernels_per_step|ops_per_step" "$out/profile_steps.log" "$out"/profile/*.json 2>/dev/null | head
timeout "${GPU_TEST_SECONDS:-150}" python3 -m pytest -q -m gpu tests/test_graph_runner.py tests/test_gpu.py \
  -k "fast_path or graphs or synchronises or moe" -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; tail -3 "$out/gpu_tests.log"
