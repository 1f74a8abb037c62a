#!/usr/bin/env bash
# Second device call of a round: all GPU tests of the verifier / drafter fast path, then the full `specdec bench`
# matrix (in-process, gateway, peer). Usage on the device machine: bash bench/gpu_round2.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout 200 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py tests/test_graph_runner.py tests/test_gpu.py \
  tests/test_kernel_rotary.py tests/test_kernel_norm.py -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; tail -4 "$out/gpu_tests.log"
timeout 360 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
  --make-tiny qwen3.5-4b --layers 32 --paths inproc gateway peer --drafters none mtp@3.39 --concurrency 1 16 64 \
  --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget 345 --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench exit $?"; grep -A30 "^specdec bench (baseline)" "$out/bench.log"
