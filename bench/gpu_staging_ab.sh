#!/usr/bin/env bash
# Device call: the drafter's hidden rows placed on the device before the step's sync (B) against gathered after
# it (A: the same tree with SpecEngine._stage_hidden returning None), passes B, A, B in one call, each
# `specdec bench` over the gateway path (plain and MTP at forced length 3.39, batch 1 and 16) with --trace-steps
# and `specdec trace-report`; first the GPU tests.
# Usage on the device machine: bash bench/gpu_staging_ab.sh "$OUT"  (results in $OUT/staging_ab.tar.gz)
set -u
out=$1
res=/tmp/staging_ab; mkdir -p $res
source bench/gpu_setup.sh "$res"
timeout 200 python3 -m pytest -q -m gpu tests/test_drafter_gpu.py tests/test_gpu.py -p no:cacheprovider \
  > "$res/gpu_tests.log" 2>&1; echo "gpu tests exit $?"; tail -2 "$res/gpu_tests.log"
pass() {  # $1: name
  timeout 200 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths gateway --drafters none mtp@3.39 --concurrency 1 16 \
    --prompt-tokens 128 --temperatures 0 --max-tokens 64 --time-budget 190 --no-plot --out "$res/$1" \
    --trace-steps "$res/$1/traces" > "$res/$1.log" 2>&1
  echo "$1 exit $?"; grep -A6 "^specdec bench (baseline)" "$res/$1.log" | cut -c1-140 | tail -4
  python3 -m specdec trace-report "$res/$1/traces"/mtp-at-3.39-*.jsonl > "$res/$1/report_mtp.txt"
  grep -E "^batch|drafter inputs|step \(" "$res/$1/report_mtp.txt"
}
cp verifier_service/engine.py /tmp/engine_b.py
pass B1
python3 - <<'PY'
p = "verifier_service/engine.py"
s = open(p).read()
a = "            self._staging.staged = False\n        drafter = self.drafter\n"
assert a in s
open(p, "w").write(s.replace(a, "            self._staging.staged = False\n        return None\n"))
PY
pass A
cp /tmp/engine_b.py verifier_service/engine.py
pass B2
tar czf "$out/staging_ab.tar.gz" -C /tmp staging_ab
