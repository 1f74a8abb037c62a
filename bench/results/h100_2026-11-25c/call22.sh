set -u
out=$1
NO_TESTS=1 RUNS="O:overlap" PATHS="inproc peer" DRAFTERS="none" CONC="1 16 64" MAX_TOKENS=64 RUN_S=400 BENCH_ARGS="--workload-timeout 120" bash bench/gpu_chained.sh "$out" | grep -v "^NVIDIA"
