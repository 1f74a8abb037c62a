#!/usr/bin/env bash
# Same-call A/B: 5b2e9da (old, no freeze) against this tree (freeze), gateway path, none and mtp@3.39, c1 and c16.
set -u
out=$1; mkdir -p "$out"
source bench/gpu_setup.sh "$out"
run() {  # $1 tag, $2 tree
  (cd "$2" && PYTHONPATH=/tmp/site:$PWD timeout 170 python3 -m specdec bench --preset baseline --device cuda \
    --model /tmp/specdec-q35-4b-L32 --make-tiny qwen3.5-4b --layers 32 --paths gateway --drafters none mtp@3.39 \
    --concurrency 1 16 --prompt-tokens 128 --temperatures 0 --max-tokens 1024 --repeats 3 --time-budget 160 \
    --trace-steps "$out/steps_$1" --tag "$1" --no-plot --out "$out/bench" > "$out/bench_$1.log" 2>&1)
  echo "$1 exit $?"; grep -A6 "^specdec bench (baseline)" "$out/bench_$1.log" | cut -c1-150 | tail -5
}
run old .ab/old; run new .; run old2 .ab/old
for d in "$out"/steps_*; do echo "== $d"; python3 -m specdec trace-report "$d"/gateway-mtp-at-3.39-*.jsonl 2>&1 | grep -A8 garbage; done
cd "$out" && tar czf steps.tgz steps_* && rm -rf steps_* && tar czf bench.tgz bench bench_*.log && rm -rf bench bench_*.log
