#!/usr/bin/env bash
# Diagnostic: do the verifier and drafter processes lose time to the GPU's time-slicing between their CUDA
# contexts? The gateway rows (none and mtp@3.39, batch 1 and 16) and the in-process MTP rows, first as usual,
# then with an NVIDIA MPS control daemon of this user (its own pipe and log folders; quit at the end), under
# which both processes' kernels share the GPU without context switches.
# Usage on the device machine: bash bench/gpu_mps.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
bench() {  # $1: tag
  timeout 290 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths inproc gateway --drafters none mtp@3.39 --concurrency 1 16 \
    --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget 280 --tag "$1" --no-plot \
    --out "$out/bench" > "$out/bench_$1.log" 2>&1
  echo "$1 exit $?"; grep -A10 "^specdec bench (baseline)" "$out/bench_$1.log" | cut -c1-150
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
