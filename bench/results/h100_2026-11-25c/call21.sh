set -u
out=$1
NO_TESTS=1 RUNS="O:overlap" PATHS="gateway colocated" DRAFTERS="mtp@3.39" CONC="16" REPEATS=3 DV=1 RUN_S=300 bash bench/gpu_chained.sh "$out" | grep -v "^NVIDIA"
