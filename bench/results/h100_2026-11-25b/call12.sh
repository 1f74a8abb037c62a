set -u
out=$1
source bench/gpu_setup.sh "$out"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_drafter_gpu.py tests/test_graph_runner.py > "$out/gpu_tests.log" 2>&1; echo "gpu tests exit $?"
grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | cut -c1-300 | tail -8
NO_TESTS=1 RUNS="O:overlap" DRAFTERS="none mtp@3.39" CONC="1 16 64" DV=1 RUN_S=370 bash bench/gpu_chained.sh "$out" | grep -v "^NVIDIA"
