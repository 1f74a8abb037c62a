#!/usr/bin/env bash
# Device call: where the service split's cost at batch 16 goes (issue 12). First the bare handoff between two
# processes' CUDA contexts (bench/context_handoff.py), without and with an NVIDIA MPS control daemon of this
# user (its own pipe and log folders, quit at the end); then the gateway / colocated rows once per PASSES entry
# ("mps" or "plain", in that order), so that each ratio has a same-call control. HANDOFF=0 skips the handoff.
# DRAFTERS (default "mtp@3.39"), CONC (default "16"), REPEATS (default 3), MAX_TOKENS (default 256),
# RUN_S (seconds per bench pass, default 200), DV=1 adds the 32k-id draft vocabulary (+dv rows).
# Usage on the device machine: PASSES="mps plain" bash bench/gpu_split_cost.sh "$OUT"
set -u
out=$1; mkdir -p "$out"
source bench/gpu_setup.sh "$out"
export CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mps_pipe=/tmp/mps-pipe
mkdir -p $mps_pipe $CUDA_MPS_LOG_DIRECTORY
mps_on() { CUDA_MPS_PIPE_DIRECTORY=$mps_pipe nvidia-cuda-mps-control -d && export CUDA_MPS_PIPE_DIRECTORY=$mps_pipe; }
mps_off() { echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps_pipe nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY; sleep 1; }
nvidia-smi --query-gpu=compute_mode,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu_state.txt"
if [ "${HANDOFF:-1}" = 1 ]; then
  python3 bench/context_handoff.py --v-ms 4 6 --d-ms 1 --iters 300 --out "$out/handoff_plain" 2>&1 | tail -8
  if mps_on; then
    python3 bench/context_handoff.py --v-ms 4 6 --d-ms 1 --iters 300 --out "$out/handoff_mps" 2>&1 | tail -8
    mps_off
  else
    echo "no MPS daemon could start"
  fi
fi
dv=()
if [ "${DV:-0}" = 1 ]; then
  python3 -c 'import json; from specdec_tools.tiny_presets import PRESETS; v = PRESETS["qwen3.5-4b"]["vocab_size"]; json.dump({"format": "specdec-draft-vocab/1", "vocab_size": v, "token_ids": list(range(0, v, v // 32768))[:32768], "tokens_counted": 0, "coverage": 0.0}, open("/tmp/dv32k.json", "w"))'
  dv=(--draft-vocab /tmp/dv32k.json)
fi
n=0
for pass in ${PASSES:-mps plain}; do
  n=$((n + 1)); tag=${n}_$pass
  [ "$pass" = mps ] && { mps_on || { echo "no MPS daemon could start"; continue; }; }
  timeout "${RUN_S:-200}" python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths gateway colocated --drafters ${DRAFTERS:-mtp@3.39} \
    --concurrency ${CONC:-16} --prompt-tokens 128 --temperatures 0 --max-tokens "${MAX_TOKENS:-256}" \
    --repeats "${REPEATS:-3}" "${dv[@]}" --time-budget $(( ${RUN_S:-200} - 10 )) --tag "$tag" --no-plot \
    --out "$out/bench" > "$out/bench_$tag.log" 2>&1
  echo "pass $tag exit $?"; grep -A8 "^specdec bench (baseline)" "$out/bench_$tag.log" | cut -c1-200
  [ "$pass" = mps ] && mps_off
done
cp /tmp/mps-log/control.log "$out/mps_control.log" 2>/dev/null
true
