#!/usr/bin/env bash
# One device call that looks for where the step time goes outside the GPU, in-process and through the gateway:
#   A  specdec bench, in-process and gateway, plain and MTP, batch 1 and 16;
#   B  the same with Python's GIL switch interval at 0.5 ms instead of 5 ms in every process (a diagnostic: does a
#      thread wait for the GIL on the step's critical path?);
#   C  py-spy over the gateway-path MTP runs, every process and thread (collapsed stacks, idle samples included).
# Usage on the device machine: bash bench/gpu_diagnose.sh "$OUT"  (results in $OUT/diagnose.tar.gz)
set -u
out=$1
res=/tmp/diagnose; mkdir -p $res
source bench/gpu_setup.sh "$res"
args="--preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 --make-tiny qwen3.5-4b --layers 32
  --prompt-tokens 128 --temperatures 0 --max-tokens 64 --workload-timeout 30"
bench() {  # $1: name; the rest: environment for the command
  local name=$1; shift
  env "$@" timeout 210 python3 -m specdec bench $args --paths inproc gateway --drafters none mtp@3.39 \
    --concurrency 1 16 --time-budget 200 --out "$res/$name" > "$res/$name.log" 2>&1
  echo "$name exit $?"; grep -A10 "^specdec bench (baseline)" "$res/$name.log" | cut -c1-200
}
bench A_default
mkdir -p /tmp/swi && echo 'import sys; sys.setswitchinterval(0.0005)' > /tmp/swi/sitecustomize.py
bench B_switch_0p5ms PYTHONPATH=/tmp/swi:$PYTHONPATH
timeout -s INT 150 /tmp/site/bin/py-spy record --subprocesses --nonblocking --idle --threads --rate 250 \
  --format raw -o "$res/C_pyspy.txt" -- python3 -m specdec bench $args --paths gateway --drafters mtp@3.39 \
  --concurrency 1 16 --time-budget 130 --out "$res/C_pyspy" > "$res/C_pyspy.log" 2>&1
echo "C exit $?"; grep -A4 "^specdec bench (baseline)" "$res/C_pyspy.log" | cut -c1-200; ls -la $res
tar czf "$out/diagnose.tar.gz" -C /tmp diagnose
