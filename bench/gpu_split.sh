#!/usr/bin/env bash
# Device call for the split's cost (issue 12): the GPU tests, then one bench run of the gateway path (drafter
# service) against the colocated path (the same MTP drafter inside the verifier's process), both through the
# gateway, with plain decoding beside them; TRACE=1 adds --trace-steps files and their report.
# Usage on the device machine: bash bench/gpu_split.sh "$OUT"
set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout 150 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py tests/test_gpu.py -p no:cacheprovider \
  > "$out/gpu_tests.log" 2>&1; echo "gpu tests exit $?"; tail -2 "$out/gpu_tests.log"
trace=()
[ "${TRACE:-0}" = 1 ] && trace=(--trace-steps "$out/trace")
timeout 420 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
  --make-tiny qwen3.5-4b --layers 32 --paths gateway colocated --drafters none mtp@3.39 --concurrency 1 16 \
  --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget 410 "${trace[@]}" --out "$out/bench" \
  > "$out/bench.log" 2>&1
echo "bench exit $?"; grep -A8 "^specdec bench (baseline)" "$out/bench.log" | cut -c1-200
if [ "${TRACE:-0}" = 1 ]; then
  for f in "$out"/trace/*-verifier.jsonl; do
    stem=${f%-verifier.jsonl}; files=("$f"); [ -f "$stem-drafter.jsonl" ] && files+=("$stem-drafter.jsonl")
    python3 -m specdec trace-report "${files[@]}" > "$stem.report.txt" 2>&1
  done
  tar czf "$out/trace.tgz" -C "$out" trace && rm -rf "$out/trace"
fi
