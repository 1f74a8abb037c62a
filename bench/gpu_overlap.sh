#!/usr/bin/env bash
# Device call for overlapped steps (issue 11): the GPU tests of the engine paths, then the in-process matrix
# twice in one call, with overlapped steps (the default) and with --no-overlap: plain decoding and MTP@3.39 at
# concurrency 1 / 16 / 64, prompt 128, MAX_TOKENS new tokens (default 256), each run with its own GEMM chain.
# NO_TESTS=1 skips the tests; PATHS (default "inproc"), DRAFTERS, CONC pick the rows; RUNS (default "O:overlap S:sync").
# Usage on the device machine: bash bench/gpu_overlap.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
if [ "${NO_TESTS:-0}" != 1 ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_overlapped_steps.py tests/test_graph_runner.py tests/test_gpu.py \
    -p no:cacheprovider > "$out/gpu_tests.log" 2>&1; echo "gpu tests exit $?"; tail -3 "$out/gpu_tests.log"
fi
for run in ${RUNS:-O:overlap S:sync}; do
  name=${run%%:*}; mode=${run#*:}; mkdir -p "$out/$name"
  flag=(); [ "$mode" = sync ] && flag=(--no-overlap)
  timeout "${RUN_S:-200}" python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths ${PATHS:-inproc} --drafters ${DRAFTERS:-none mtp@3.39} --concurrency ${CONC:-1 16 64} \
    --prompt-tokens 128 --temperatures 0 --max-tokens "${MAX_TOKENS:-256}" --time-budget $(( ${RUN_S:-200} - 10 )) \
    --repeats "${REPEATS:-1}" "${flag[@]}" --no-plot --out "$out/$name" > "$out/$name/bench.log" 2>&1
  echo "run $name ($mode) exit $?"; grep -A12 "^specdec bench (baseline)" "$out/$name/bench.log" | cut -c1-220
done
