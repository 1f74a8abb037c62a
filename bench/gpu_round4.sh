#!/usr/bin/env bash
# Device call: the drafter round trip against the same MTP drafter in-process (bench/drafter_roundtrip.py), a
# fresh stack's first requests with and without the start-up warm-up (bench/cold_start.py, empty Triton caches),
# then the GDN kernel table against fla-core (bench/kernels.py, kernels only).
# Usage on the device machine: bash bench/gpu_round4.sh "$OUT"  (results in $OUT/round4.tar.gz)
set -u
out=$1
res=/tmp/round4; mkdir -p $res
source bench/gpu_setup.sh "$res"
model=/tmp/specdec-q35-4b-L32
python3 -c "from specdec_tools.bench.checkpoint import ensure_checkpoint; ensure_checkpoint('$model', 'qwen3.5-4b', 32)"
timeout 120 python3 -P bench/drafter_roundtrip.py --model $model --kind mtp --transport cuda_ipc --batch 1 16 \
  --steps 60 > "$res/roundtrip.json" 2> "$res/roundtrip.log"; echo "roundtrip exit $?"
grep -E '"(1|16)"|median' "$res/roundtrip.json"
timeout 200 python3 -P bench/cold_start.py --model $model --concurrency 64 --out "$res/cold_start.json" \
  > "$res/cold_start.log" 2>&1; echo "cold start exit $?"; grep -E "^(no warm-up|warm-up) " "$res/cold_start.log"
timeout 150 python3 bench/kernels.py --skip-step --skip-draft --out "$res" > "$res/kernels.log" 2>&1
echo "kernels exit $?"; grep -E "^gdn-(verify|decode)" "$res/kernels.log" | grep -E "write 1\+k|fla"
tar czf "$out/round4.tar.gz" -C /tmp round4
