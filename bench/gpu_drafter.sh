#!/usr/bin/env bash
# Issue 12 in ONE device call (about 9 minutes on an H100): the GPU tests of the drafter and graphs, the
# draft-loop table (bench/kernels.py --skip-kernels: plain decode / verify steps and the MTP draft loop at
# b1/16/64, graph vs eager, full vs 32k-id vocabulary), then `specdec bench` in-process and through the
# gateway with mtp@3.39 with and without the reduced vocabulary. Usage on the GPU machine ($OUT set):
#   bash bench/gpu_drafter.sh          # carries .whl (grpcio 1.85.1, health, reflection, protobuf, fla-core)
set -u
out=${OUT:?OUT must name the output folder}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$(date +%s)
timeout ${TESTS_S:-170} python3 -m pytest -v -m gpu -p no:cacheprovider ${TESTS:-tests/test_drafter_gpu.py \
  tests/test_graph_runner.py tests/test_gpu.py} > "$out/gpu_tests.log" 2>&1
echo "gpu tests exit $? after $(( $(date +%s) - start )) s"
[ -n "${SKIP_STEP:-}" ] || (cd bench && timeout ${STEP_S:-150} python3 kernels.py --skip-kernels --batches 1 16 64 --out "$out" > "$out/kernels.log" 2>&1)
echo "bench/kernels.py exit $? after $(( $(date +%s) - start )) s"
python3 - <<'PY'
import json
from specdec_tools.tiny_presets import PRESETS
v = PRESETS["qwen3.5-4b"]["vocab_size"]
ids = list(range(0, v, v // 32768))[:32768]   # forced acceptance: which ids does not matter, how many does
json.dump({"format": "specdec-draft-vocab/1", "vocab_size": v, "token_ids": ids, "tokens_counted": 0,
           "coverage": 0.0}, open("/tmp/dv32k.json", "w"))
PY
left=$(( ${TOTAL_S:-585} - ($(date +%s) - start) ))
CKPT=/tmp/specdec-q35-4b-L32
timeout --signal=INT --kill-after=15 $(( left - 20 )) python3 -m specdec bench --preset baseline --device cuda \
  --model $CKPT --make-tiny qwen3.5-4b --layers 32 --paths inproc gateway --drafters none mtp@3.39 \
  --concurrency 1 16 --prompt-tokens 128 --temperatures 0 --max-tokens 64 --draft-vocab /tmp/dv32k.json \
  --time-budget $(( left - 45 )) --out "$out" > "$out/bench.log" 2>&1
echo "specdec bench exit $? after $(( $(date +%s) - start )) s"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu_tests.log" | cut -c1-160 | tail -25
[ -s "$out/kernels.log" ] && grep -E "^(step|draft)" "$out/kernels.log" | cut -c1-190
json=$(ls "$out"/bench_baseline_*.json 2>/dev/null | head -1)
[ -n "$json" ] && { t=${json%.json}.txt; [ -s "$t" ] || python3 -m specdec bench --render "$json" > "$t"; cat "$t"; } \
  || tail -30 "$out/bench.log"
