set -u
out=$1
source bench/gpu_setup.sh "$out"
mkdir -p "$out/tests" "$out/ttft"
timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_runner.py tests/test_mtp_draft_loop.py tests/test_fused_linear.py tests/test_device_steps.py tests/test_drafter_gpu.py tests/test_gpu.py tests/test_overlapped_drafts.py tests/test_overlapped_steps.py > "$out/tests/gpu_tests.log" 2>&1; echo "gpu tests exit $?"
grep -E "passed|failed|FAILED|Error" "$out/tests/gpu_tests.log" | cut -c1-250 | tail -12
PYTHONPATH=$PYTHONPATH:$PWD/bench timeout 150 python3 -P bench/ttft_probe.py --out "$out/ttft" > "$out/ttft/ttft_probe.log" 2>&1; echo "probe exit $?"
grep -E "^==|^    \[" "$out/ttft/ttft_probe.log" | cut -c1-600
