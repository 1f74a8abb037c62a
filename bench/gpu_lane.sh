#!/usr/bin/env bash
# Device call for the local lane (issue 12): the GPU tests, then two bench runs, each with the gateway path
# (drafter service), the colocated path (the same MTP drafter inside the verifier's process) and plain decoding:
# run L with the verifier's steps over the drafter's local lane (the default), run G over the gRPC stream.
# Step traces of both; their reports next to them. Further arguments name the runs (NAME:CHANNEL, default
# L:auto G:grpc); NO_TESTS=1 skips the GPU tests (a second call on the same warm machine); REPEATS=N timed
# passes per workload (the median one reported); MAX_TOKENS=N output tokens per request (default 64).
# Usage on the device machine: bash bench/gpu_lane.sh "$OUT" [NAME:CHANNEL ...]
set -u
out=$1; shift
runs=("$@"); [ ${#runs[@]} -eq 0 ] && runs=(L:auto G:grpc)
source bench/gpu_setup.sh "$out"
if [ "${NO_TESTS:-0}" != 1 ]; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py tests/test_gpu.py -p no:cacheprovider \
    > "$out/gpu_tests.log" 2>&1; echo "gpu tests exit $?"; tail -2 "$out/gpu_tests.log"
fi
for run in "${runs[@]}"; do
  name=${run%%:*}; channel=${run#*:}; mkdir -p "$out/$name"
  timeout 300 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths gateway colocated --drafters none mtp@3.39 --concurrency 1 16 \
    --prompt-tokens 128 --temperatures 0 --max-tokens "${MAX_TOKENS:-64}" --time-budget 290 --repeats "${REPEATS:-1}" --step-channel "$channel" \
    --trace-steps "$out/$name/trace" --out "$out/$name" > "$out/$name/bench.log" 2>&1
  echo "run $name ($channel) exit $?"; grep -A8 "^specdec bench (baseline)" "$out/$name/bench.log" | cut -c1-200
  for f in "$out/$name"/trace/*-verifier.jsonl; do
    stem=${f%-verifier.jsonl}; files=("$f"); [ -f "$stem-drafter.jsonl" ] && files+=("$stem-drafter.jsonl")
    python3 -m specdec trace-report "${files[@]}" > "$stem.report.txt" 2>&1
  done
done
names=("${runs[@]%%:*}")
tar czf "$out/runs.tgz" -C "$out" "${names[@]}" && (cd "$out" && rm -rf "${names[@]}")
