#!/usr/bin/env bash
# Diagnostic: do the verifier and drafter processes lose time to the GPU's time-slicing between their CUDA
# contexts? The same bench rows first as usual, then with an NVIDIA MPS control daemon of this user (its own pipe
# and log folders; quit at the end), under which both processes' kernels share the GPU without context switches.
# PATHS (default "inproc gateway"), DRAFTERS (default "none mtp@3.39"), CONC (default "1 16"), MAX_TOKENS
# (default 64), REPEATS (default 1), RUN_S (seconds per run, default 290), DV=1 adds the 32k-id draft vocabulary.
# Usage on the device machine: bash bench/gpu_mps.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
dv=()
if [ "${DV:-0}" = 1 ]; then
  python3 -c 'import json; from specdec_tools.tiny_presets import PRESETS; v = PRESETS["qwen3.5-4b"]["vocab_size"]; json.dump({"format": "specdec-draft-vocab/1", "vocab_size": v, "token_ids": list(range(0, v, v // 32768))[:32768], "tokens_counted": 0, "coverage": 0.0}, open("/tmp/dv32k.json", "w"))'
  dv=(--draft-vocab /tmp/dv32k.json)
fi
bench() {  # $1: tag
  timeout "${RUN_S:-290}" python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths ${PATHS:-inproc gateway} --drafters ${DRAFTERS:-none mtp@3.39} \
    --concurrency ${CONC:-1 16} --prompt-tokens 128 --temperatures 0 --max-tokens "${MAX_TOKENS:-64}" \
    --repeats "${REPEATS:-1}" "${dv[@]}" --time-budget $(( ${RUN_S:-290} - 10 )) --tag "$1" --no-plot \
    --out "$out/bench" > "$out/bench_$1.log" 2>&1
  echo "$1 exit $?"; grep -A12 "^specdec bench (baseline)" "$out/bench_$1.log" | cut -c1-180
}
bench no_mps
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
if nvidia-cuda-mps-control -d; then
  bench mps
  echo quit | nvidia-cuda-mps-control
  cp /tmp/mps-log/control.log "$out/mps_control.log" 2>/dev/null
else
  echo "no MPS daemon could start"
fi
