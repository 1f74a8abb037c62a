#!/usr/bin/env bash
# Same-call A/B at c16 (plain and MTP, gateway and colocated, 256 new tokens): .ab/old (f8f19b4: mixed steps
# eager) against this tree (mixed buckets replayed from graphs). PASSES picks the order.
set -u
out=$1; mkdir -p "$out"
source bench/gpu_setup.sh "$out"
python3 -c 'import json; from specdec.tiny_presets import PRESETS; v = PRESETS["qwen3.5-4b"]["vocab_size"]; json.dump({"format": "specdec-draft-vocab/1", "vocab_size": v, "token_ids": list(range(0, v, v // 32768))[:32768], "tokens_counted": 0, "coverage": 0.0}, open("/tmp/dv32k.json", "w"))'
run() {  # $1 tag, $2 tree
  (cd "$2" && PYTHONPATH=/tmp/site:$PWD timeout ${RUN_S:-200} python3 -m specdec bench --preset baseline --device cuda \
    --model /tmp/specdec-q35-4b-L32 --make-tiny qwen3.5-4b --layers 32 --paths gateway colocated \
    --drafters none mtp@3.39 --concurrency ${CONC:-16} --prompt-tokens 128 --temperatures 0 \
    --max-tokens ${MAX_TOKENS:-256} --repeats ${REPEATS:-5} --time-budget $(( ${RUN_S:-200} - 8 )) \
    --trace-steps "$out/steps_$1" --tag "$1" --no-plot --out "$out/bench" > "$out/bench_$1.log" 2>&1)
  echo "$1 exit $?"; grep -A10 "^specdec bench (baseline)" "$out/bench_$1.log" | cut -c1-175
  python3 bench/step_split.py "$out/steps_$1" | grep -E "at batch|split|pass starts"
}
for pass in ${PASSES:-old new}; do
  case $pass in old*) run $pass .ab/old ;; new*) run $pass . ;; esac
done
cd "$out" && tar czf steps.tgz steps_* && rm -rf steps_* && tar czf bench.tgz bench bench_*.log && rm -rf bench bench_*.log
