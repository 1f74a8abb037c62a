set -u
out=$1
source bench/gpu_setup.sh "$out"
mkdir -p "$out/diag" "$out/kernels" "$out/step"
timeout 170 python3 .ab/engine_diag.py > "$out/diag/engine_diag.log" 2>&1; echo "engine diag exit $?"
grep -v "Warn\|capturing\|warn" "$out/diag/engine_diag.log" | tail -30
timeout 150 python3 bench/kernels.py --batches 1 8 32 64 --skip-step --skip-draft --skip-sampling --out "$out/kernels" > "$out/kernels/kernels.log" 2>&1; echo "kernels exit $?"
grep -c ERROR "$out/kernels/kernels.log"
timeout 330 python3 bench/kernels.py --batches 1 8 32 64 --layers 32 --skip-kernels --skip-sampling --out "$out/step" > "$out/step/kernels.log" 2>&1; echo "step exit $?"
tail -25 "$out/step/kernels.log" | cut -c1-160
