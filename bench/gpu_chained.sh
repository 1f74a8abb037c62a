#!/usr/bin/env bash
# Device call for overlapped steps with drafts (issues 11, 12): the GPU tests of the engine paths (TESTS: other
# files), then the same bench matrix in one call per RUNS entry: O with overlapped steps (the default: the MTP
# drafter, in process or as a service through device steps, drafts on the device from the unread verdict) and
# S with --no-overlap, each run with its own GEMM chain. 4B shape, 32 layers,
# prompt 128, T = 0, MAX_TOKENS new tokens (default 256). NO_TESTS=1 skips the tests; PATHS (default "inproc"),
# DRAFTERS (default "none mtp@3.39"), CONC (default "1 16 64"), REPEATS, RUN_S (seconds per run), DV=1 adds the
# 32k-id draft vocabulary (+dv rows); RUNS (default "O:overlap S:sync"); TEMPS (default "0") the temperatures;
# PRESET (default baseline; "full" has T = 0.8 at every concurrency); BENCH_ARGS: more `specdec bench` flags.
# Usage on the device machine: bash bench/gpu_chained.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
if [ "${NO_TESTS:-0}" != 1 ]; then
  timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu ${TESTS:-tests/test_device_steps.py tests/test_overlapped_drafts.py \
    tests/test_overlapped_steps.py tests/test_drafter_gpu.py tests/test_gpu.py} -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | cut -c1-200 | tail -12
fi
dv=()
if [ "${DV:-0}" = 1 ]; then
  python3 - <<'PY'
import json
from specdec_tools.tiny_presets import PRESETS
v = PRESETS["qwen3.5-4b"]["vocab_size"]
ids = list(range(0, v, v // 32768))[:32768]   # forced acceptance: which ids does not matter, how many does
json.dump({"format": "specdec-draft-vocab/1", "vocab_size": v, "token_ids": ids, "tokens_counted": 0,
           "coverage": 0.0}, open("/tmp/dv32k.json", "w"))
PY
  dv=(--draft-vocab /tmp/dv32k.json)
fi
for run in ${RUNS:-O:overlap S:sync}; do
  name=${run%%:*}; mode=${run#*:}; mkdir -p "$out/$name"
  flag=(); [ "$mode" = sync ] && flag=(--no-overlap)
  timeout "${RUN_S:-200}" python3 -m specdec bench --preset ${PRESET:-baseline} --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths ${PATHS:-inproc} --drafters ${DRAFTERS:-none mtp@3.39} \
    --concurrency ${CONC:-1 16 64} --prompt-tokens 128 --temperatures ${TEMPS:-0} --max-tokens "${MAX_TOKENS:-256}" \
    --time-budget $(( ${RUN_S:-200} - 10 )) --repeats "${REPEATS:-1}" "${dv[@]}" "${flag[@]}" --no-plot \
    ${BENCH_ARGS:-} --out "$out/$name" > "$out/$name/bench.log" 2>&1
  echo "run $name ($mode) exit $?"; grep -A16 "^specdec bench (baseline)" "$out/$name/bench.log" | cut -c1-230
done
