set -u
out=$1
NO_TESTS=1 RUNS="O:overlap" DRAFTERS="none" CONC="1 64" RUN_S=230 bash bench/gpu_chained.sh "$out" | grep -v "^NVIDIA"
