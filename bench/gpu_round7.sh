#!/usr/bin/env bash
# Same-call comparison, A then B: the engine that waits for the remote drafter inside the step (A: the files in
# .before/, i.e. verifier_service/engine.py and drafter_client.py of the commit before) against the one that reads
# the answer at the start of the next step (B: this tree). A: the gateway rows, none and mtp@3.39, batch 1 and
# 16; B: the same and the in-process rows (the bench skips a row it may not finish within the pass's budget).
# Before the call: mkdir .before; for f in engine drafter_client; do git show 3b42a2a^:verifier_service/$f.py \
#   > .before/$f.py; done   (.before/ is ignored by git: list it in .git/info/exclude)
# Usage on the device machine: bash bench/gpu_round7.sh "$OUT" (carry .whl and .before)
set -u
out=$1
here=$PWD
rm -rf /tmp/before && mkdir -p /tmp/before && cp -r . /tmp/before/
cp .before/engine.py .before/drafter_client.py /tmp/before/verifier_service/
for pass in A B; do
  case $pass in A) cd /tmp/before; paths=gateway; budget=230 ;; B) cd "$here"; paths="inproc gateway"; budget=320 ;; esac
  source bench/gpu_setup.sh "$out" > /dev/null
  timeout $((budget + 10)) python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths $paths --drafters none mtp@3.39 --concurrency 1 16 \
    --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget $budget --tag "$pass" --no-plot \
    --out "$out/bench" > "$out/bench_$pass.log" 2>&1
  echo "pass $pass exit $?"; grep -A10 "^specdec bench (baseline)" "$out/bench_$pass.log" | cut -c1-150
done
