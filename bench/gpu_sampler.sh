#!/usr/bin/env bash
# Device call for the one-launch speculative sampler (issue 11, item 7): its GPU tests and the seeded engine test
# through it, the sampling section of bench/kernels.py (b1/8/32/64, k = 3, 4B vocabulary), and the MTP draft
# loop's profile (full and 32k-id vocabulary). Usage on the device machine: bash bench/gpu_sampler.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu ${TESTS:-tests/test_kernel_speculative.py tests/test_kernel_sampling.py \
  tests/test_seeded_sampling.py} -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
echo "gpu tests exit $?"; grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | cut -c1-200 | tail -12
timeout 200 python3 bench/kernels.py --only-sampling --out "$out" > "$out/kernels.log" 2>&1
echo "kernels exit $?"; grep -E "^(section|sampling|device)" "$out/kernels.log" | cut -c1-150
if [ "${PROFILE:-1}" = 1 ]; then
  PYTHONPATH=$PYTHONPATH:$PWD/bench timeout 150 python3 -P bench/profile_draft_loop.py \
    > "$out/profile_draft_loop.log" 2>&1
  echo "profile exit $?"; grep -E "^==" "$out/profile_draft_loop.log"
fi
