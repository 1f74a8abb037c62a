#!/usr/bin/env bash
# Device call: the sampler GPU tests, then bench/kernels.py step + draft-loop sections at b1 / b16 (4B shape,
# 32 layers): the draft loop's graph replay against the plain decode step's GPU time in one run.
# Usage on the device machine: OUT=dir bash bench/gpu_step_draft.sh
set -u
source bench/gpu_setup.sh "$OUT"
timeout 150 python3 -m pytest -q -m gpu tests/test_kernel_speculative.py tests/test_seeded_sampling.py \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -5
timeout 330 python3 bench/kernels.py --skip-kernels --batches 1 16 --layers 32 --out "$OUT" \
  > "$OUT/kernels_step.log" 2>&1
echo "kernels exit $?"; grep -E "^(section|step|draft|device)" "$OUT/kernels_step.log" | cut -c1-190
