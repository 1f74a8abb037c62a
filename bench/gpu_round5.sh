#!/usr/bin/env bash
# Device call after the GDN kernel's block change: its GPU tests and the fast-path equality tests, then the
# in-process and transformers rows of the bench matrix (batch 1 / 16 / 64, plain and MTP).
# Usage on the device machine: bash bench/gpu_round5.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout 150 python3 -m pytest -q -m gpu tests/test_kernel_gdn.py tests/test_gpu.py -k "gdn or fast_path or graphs" \
  -p no:cacheprovider > "$out/gpu_tests.log" 2>&1; echo "gpu tests exit $?"; tail -2 "$out/gpu_tests.log"
timeout 400 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
  --make-tiny qwen3.5-4b --layers 32 --paths inproc peer --drafters none mtp@3.39 --concurrency 1 16 64 \
  --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget 390 --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench exit $?"; grep -A12 "^specdec bench (baseline)" "$out/bench.log" | cut -c1-200
