#!/usr/bin/env bash
# Device call: where a gateway step's time goes between the verifier and the drafter. `specdec bench` over the
# gateway path with --trace-steps (plain and MTP at forced length 3.39, batch 1 and 16), then
# `specdec trace-report` on each stack's trace files.
# Usage on the device machine: bash bench/gpu_trace.sh "$OUT"  (results in $OUT/trace.tar.gz and the log)
set -u
out=$1
res=/tmp/trace_run; mkdir -p $res
source bench/gpu_setup.sh "$res"
timeout 330 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
  --make-tiny qwen3.5-4b --layers 32 --paths gateway --drafters ${DRAFTERS:-none mtp@3.39} --concurrency 1 16 \
  --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget 320 --no-plot --out "$res/bench" \
  --trace-steps "$res/traces" > "$res/bench.log" 2>&1
echo "bench exit $?"; grep -A6 "^specdec bench (baseline)" "$res/bench.log" | cut -c1-200
for stem in $(ls $res/traces | sed "s/-[a-z]*\.jsonl//" | sort -u); do
  echo "== $stem"; python3 -m specdec trace-report "$res/traces/$stem"-*.jsonl | tee "$res/report_$stem.txt"
done
tar czf "$out/trace.tar.gz" -C /tmp trace_run
