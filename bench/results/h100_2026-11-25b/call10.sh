set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_device_steps.py tests/test_gpu.py > "$out/gpu_tests.log" 2>&1; echo "gpu tests exit $?"
tail -3 "$out/gpu_tests.log"
PYTHONPATH=$PYTHONPATH:$PWD/bench timeout 300 python3 -P bench/ttft_probe.py --out "$out" > "$out/ttft_probe.log" 2>&1; echo "probe exit $?"
grep -E "^==|^    \[" "$out/ttft_probe.log" | cut -c1-1500
grep -A22 "Self CPU %" "$out/ttft_probe.log" | cut -c1-150 | head -60
