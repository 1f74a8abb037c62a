#!/usr/bin/env bash
# One device call: the GPU tests of the kernels, the batch staging and the graph runner, then the kernel
# benchmarks (bench/kernels.py, bench/kernels_fastkern.py). Usage on the GPU machine (the device tool sets $OUT):
#   bash bench/gpu_check.sh            # carries .whl (grpcio 1.85.1, health, reflection, protobuf, fla-core)
# Writes gpu_tests.log, kernels.json/.log, kernels_fastkern_*.json/.log under $OUT; prints summaries last.
set -u
out=${OUT:?OUT must name the output folder}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$(date +%s)
timeout ${TESTS_S:-240} python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/test_kernel_*.py \
  tests/test_forward_batch.py tests/test_graph_runner.py tests/test_gpu.py} > "$out/gpu_tests.log" 2>&1
echo "gpu tests exit $? after $(( $(date +%s) - start )) s"
timeout ${KERNELS_S:-150} python3 bench/kernels.py --out "$out" > "$out/kernels.log" 2>&1
echo "bench/kernels.py exit $? after $(( $(date +%s) - start )) s"
timeout ${FASTKERN_S:-120} python3 bench/kernels_fastkern.py --out-dir "$out" > "$out/kernels_fastkern.log" 2>&1
echo "bench/kernels_fastkern.py exit $? after $(( $(date +%s) - start )) s"
grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | cut -c1-200 | head -30
tail -45 "$out/kernels.log"
tail -30 "$out/kernels_fastkern.log"
