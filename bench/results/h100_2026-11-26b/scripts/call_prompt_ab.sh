#!/usr/bin/env bash
# GPU tests of the drafter's device path, then a same-call A/B at c16: .ab/old (8be07e6) against this tree.
set -u
out=$1; mkdir -p "$out"
source bench/gpu_setup.sh "$out"
start=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_drafter_gpu.py tests/test_device_steps.py \
  tests/test_overlapped_drafts.py tests/test_mtp_draft_loop.py tests/test_graph_runner.py > "$out/gpu_tests.log" 2>&1
echo "gpu tests exit $? after $(( $(date +%s) - start )) s"; tail -2 "$out/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | head
python3 -c 'import json; from specdec.tiny_presets import PRESETS; v = PRESETS["qwen3.5-4b"]["vocab_size"]; json.dump({"format": "specdec-draft-vocab/1", "vocab_size": v, "token_ids": list(range(0, v, v // 32768))[:32768], "tokens_counted": 0, "coverage": 0.0}, open("/tmp/dv32k.json", "w"))'
run() {  # $1 tag, $2 tree
  (cd "$2" && PYTHONPATH=/tmp/site:$PWD timeout ${RUN_S:-170} python3 -m specdec bench --preset baseline --device cuda \
    --model /tmp/specdec-q35-4b-L32 --make-tiny qwen3.5-4b --layers 32 --paths gateway colocated --drafters mtp@3.39 \
    --concurrency 16 --prompt-tokens 128 --temperatures 0 --max-tokens 1024 --repeats 4 --draft-vocab /tmp/dv32k.json \
    --time-budget $(( ${RUN_S:-170} - 8 )) --trace-steps "$out/steps_$1" --tag "$1" --no-plot --out "$out/bench" \
    > "$out/bench_$1.log" 2>&1)
  echo "$1 exit $?"; grep -A12 "^specdec bench (baseline)" "$out/bench_$1.log" | grep -E "split|skipped" | cut -c1-170
  python3 bench/step_split.py "$out/steps_$1" | grep -E "at batch|split|pass starts"
}
for pass in ${PASSES:-old new}; do
  case $pass in old*) run $pass .ab/old ;; new*) run $pass . ;; esac
done
cd "$out" && tar czf steps.tgz steps_* && rm -rf steps_* && tar czf bench.tgz bench bench_*.log && rm -rf bench bench_*.log
