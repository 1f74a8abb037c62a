set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout 320 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_runner.py tests/test_device_steps.py tests/test_drafter_gpu.py tests/test_gpu.py > "$out/gpu_tests.log" 2>&1; echo "gpu tests exit $?"
grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | cut -c1-300 | tail -12
