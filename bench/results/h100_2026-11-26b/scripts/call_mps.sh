#!/usr/bin/env bash
# Same-call A/B at c16: plain, MPS, short GIL switch interval (swi), combinations. GPU tests first if TESTS=1.
set -u
out=$1; mkdir -p "$out"
source bench/gpu_setup.sh "$out"
nproc; lscpu | grep -iE "^(thread|core|socket|model name)" ; nvidia-smi --query-gpu=compute_mode,clocks.sm,clocks.max.sm --format=csv
if [ "${TESTS:-0}" = 1 ]; then
  start=$(date +%s)
  timeout ${TESTS_S:-240} python3 -m pytest -q -m gpu -p no:cacheprovider tests/ > "$out/gpu_tests.log" 2>&1
  echo "gpu tests exit $? after $(( $(date +%s) - start )) s"; tail -3 "$out/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head
fi
python3 -c 'import json; from specdec.tiny_presets import PRESETS; v = PRESETS["qwen3.5-4b"]["vocab_size"]; json.dump({"format": "specdec-draft-vocab/1", "vocab_size": v, "token_ids": list(range(0, v, v // 32768))[:32768], "tokens_counted": 0, "coverage": 0.0}, open("/tmp/dv32k.json", "w"))'
export CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log; mps_pipe=/tmp/mps-pipe; mkdir -p $mps_pipe $CUDA_MPS_LOG_DIRECTORY
mps_on() { CUDA_MPS_PIPE_DIRECTORY=$mps_pipe nvidia-cuda-mps-control -d && export CUDA_MPS_PIPE_DIRECTORY=$mps_pipe; }
mps_off() { echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps_pipe nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY; sleep 1; }
n=0
for pass in ${PASSES:-plain mps}; do
  n=$((n + 1)); tag=${n}_$pass; extra=
  case $pass in *swi*) extra=$PWD/.ab/swi: ;; esac
  case $pass in *mps*) mps_on || { echo "no MPS"; continue; } ;; esac
  PYTHONPATH=$extra/tmp/site:$PWD timeout "${RUN_S:-150}" python3 -m specdec bench --preset baseline --device cuda \
    --model /tmp/specdec-q35-4b-L32 --make-tiny qwen3.5-4b --layers 32 --paths gateway colocated --drafters mtp@3.39 \
    --concurrency 16 --prompt-tokens 128 --temperatures 0 --max-tokens "${MAX_TOKENS:-1024}" --repeats "${REPEATS:-5}" \
    --draft-vocab /tmp/dv32k.json --time-budget $(( ${RUN_S:-150} - 10 )) --trace-steps "$out/steps_$tag" --tag "$tag" \
    --no-plot --out "$out/bench" > "$out/bench_$tag.log" 2>&1
  echo "$tag exit $?"; grep -A8 "^specdec bench (baseline)" "$out/bench_$tag.log" | cut -c1-160
  case $pass in *mps*) mps_off ;; esac
  python3 bench/step_split.py "$out/steps_$tag"
done
cd "$out" && tar czf steps.tgz steps_* && rm -rf steps_* && tar czf bench.tgz bench bench_*.log && rm -rf bench bench_*.log
