#!/usr/bin/env bash
# Device call: the drafter round trip against the same MTP drafter in-process (bench/drafter_roundtrip.py), the
# cold start with the widened warm-up (bench/cold_start.py).
# Usage on the device machine: bash bench/gpu_round4.sh "$OUT"  (results in $OUT/round4.tar.gz)
set -u
out=$1
res=/tmp/round4; mkdir -p $res
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$res/device.txt"
model=/tmp/specdec-q35-4b-L32
python3 -c "from specdec.bench.checkpoint import ensure_checkpoint; ensure_checkpoint('$model', 'qwen3.5-4b', 32)"
timeout 120 python3 -P bench/drafter_roundtrip.py --model $model --kind mtp --transport cuda_ipc --batch 1 16 \
  --steps 60 > "$res/roundtrip.json" 2> "$res/roundtrip.log"; echo "roundtrip exit $?"
grep -E '"(1|16)"|median' "$res/roundtrip.json"
timeout 200 python3 -P bench/cold_start.py --model $model --concurrency 64 --out "$res/cold_start.json" \
  > "$res/cold_start.log" 2>&1; echo "cold start exit $?"; grep -E "^(no warm-up|warm-up) " "$res/cold_start.log"
tar czf "$out/round4.tar.gz" -C /tmp round4
