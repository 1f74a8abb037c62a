#!/usr/bin/env bash
# Device call after the engine reads a remote drafter's answer one step later (the step's tokens go out while
# the drafter drafts): the drafter / fast-path GPU tests, then the in-process and gateway rows at batch 1 and 16.
# Usage on the device machine: bash bench/gpu_round6.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout 200 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py tests/test_gpu.py -p no:cacheprovider \
  > "$out/gpu_tests.log" 2>&1; echo "gpu tests exit $?"; tail -2 "$out/gpu_tests.log"
timeout 370 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
  --make-tiny qwen3.5-4b --layers 32 --paths inproc gateway --drafters none mtp@3.39 --concurrency 1 16 \
  --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget 360 --out "$out/bench" > "$out/bench.log" 2>&1
echo "bench exit $?"; grep -A10 "^specdec bench (baseline)" "$out/bench.log" | cut -c1-200
