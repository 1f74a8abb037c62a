#!/usr/bin/env bash
# Device call: a fresh stack's first requests with and without the verifier's start-up warm-up (bench/cold_start.py,
# empty Triton caches), then the GDN kernel table against fla-core (bench/kernels.py, kernels only).
# Usage on the device machine: bash bench/gpu_round3.sh "$OUT"  (results in $OUT/round3.tar.gz)
set -u
out=$1
res=/tmp/round3; mkdir -p $res
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$res/device.txt"
model=/tmp/specdec-q35-4b-L32
python3 -c "from specdec.bench.checkpoint import ensure_checkpoint; ensure_checkpoint('$model', 'qwen3.5-4b', 32)"
timeout 330 python3 -P bench/cold_start.py --model $model --concurrency 64 --out "$res/cold_start.json" \
  > "$res/cold_start.log" 2>&1; echo "cold start exit $?"; grep -E "^(no warm-up|warm-up) " "$res/cold_start.log"
timeout 150 python3 bench/kernels.py --skip-step --skip-draft --out "$res" > "$res/kernels.log" 2>&1
echo "kernels exit $?"; tail -40 "$res/kernels.log"
tar czf "$out/round3.tar.gz" -C /tmp round3
