#!/usr/bin/env bash
# Same-call A/B on the device: this tree (new) against .ab/old (main before the change), gateway / colocated.
set -u
out=$1; mkdir -p "$out"
source bench/gpu_setup.sh "$out"
python3 -c 'import json; from specdec.tiny_presets import PRESETS; v = PRESETS["qwen3.5-4b"]["vocab_size"]; json.dump({"format": "specdec-draft-vocab/1", "vocab_size": v, "token_ids": list(range(0, v, v // 32768))[:32768], "tokens_counted": 0, "coverage": 0.0}, open("/tmp/dv32k.json", "w"))'
bench() {  # $1 tag, $2 seconds, $3 drafters, $4 concurrency, $5 tree
  (cd "$5" && PYTHONPATH=${EXTRA_PATH:-}/tmp/site:$PWD timeout "$2" python3 -m specdec bench --preset baseline --device cuda \
    --model /tmp/specdec-q35-4b-L32 --make-tiny qwen3.5-4b --layers 32 --paths gateway colocated --drafters $3 \
    --concurrency $4 --prompt-tokens 128 --temperatures 0 --max-tokens "${MAX_TOKENS:-256}" --repeats "${REPEATS:-3}" \
    --draft-vocab /tmp/dv32k.json --time-budget $(( $2 - 10 )) --trace-steps "$out/steps_$1" --tag "$1" --no-plot \
    --out "$out/bench" > "$out/bench_$1.log" 2>&1)
  echo "$1 exit $?"; grep -A12 "^specdec bench (baseline)" "$out/bench_$1.log" | cut -c1-200
}
for pass in ${PASSES:-new_full old_c16}; do
  case $pass in
    new_full) bench new_full "${FULL_S:-360}" "none mtp@3.39" "1 16" . ;;
    new_c16*) bench $pass "${C16_S:-150}" "mtp@3.39" "16" . ;;
    old_c16*) bench $pass "${C16_S:-150}" "mtp@3.39" "16" .ab/old ;;
    frz_c16*) EXTRA_PATH=$PWD/.ab/gcfreeze: bench $pass "${C16_S:-150}" "mtp@3.39" "16" . ;;
  esac
done
for d in "$out"/steps_*; do echo "== $d"; python3 -m specdec trace-report "$d"/gateway-mtp-at-3.39+dv-*.jsonl 2>&1 | sed -n 2,30p; python3 -m specdec trace-report "$d"/colocated-mtp-at-3.39+dv-*.jsonl 2>&1 | grep -A6 "garbage"; done
cd "$out" && tar czf steps.tgz steps_* && rm -rf steps_*
