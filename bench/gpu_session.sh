#!/usr/bin/env bash
# One GPU-machine session: train the demo model (issue 5) and measure the drafter round trip (issue 4).
# Usage on the device machine: bash bench/gpu_session.sh "$OUT" [train-minutes]
set -u
out=$1; minutes=${2:-4.5}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m specdec_tools.train.train_demo --out /tmp/demo --device cuda --steps 2400 --eval-every 300 \
  --max-minutes "$minutes" > "$out/train.log" 2>&1; echo "train exit $?"; tail -5 "$out/train.log"
(cd /tmp/demo && tar cf "$out/demo_meta.tar" --exclude model.safetensors . && split -b 15M model.safetensors "$out/demo_weights_part_")
python3 -m specdec make-tiny /tmp/m4b --preset qwen3.5-4b --set num_hidden_layers=4 > /dev/null 2>&1
for t in cuda_ipc inline; do
  timeout 150 python3 bench/drafter_roundtrip.py --model /tmp/m4b --transport $t --batch 1 32 --steps 60 \
    > "$out/rt_$t.json" 2> "$out/rt_$t.err"; echo "roundtrip $t exit $?"; cat "$out/rt_$t.json"
done
grep -h -E "mapped|transport|Error|error" "$out"/rt_*.err | grep -v "^INFO" | head -10
