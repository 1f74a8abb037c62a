set -u
out=$1
source bench/gpu_setup.sh "$out"
mkdir -p "$out/diag" "$out/kernels"
timeout 150 python3 .ab/prefill_diag.py > "$out/diag/prefill_diag.log" 2>&1; echo "diag exit $?"
grep -v Warn "$out/diag/prefill_diag.log" | tail -30
timeout 400 python3 bench/kernels.py --batches 1 8 32 64 --layers 32 --skip-step --skip-draft --out "$out/kernels" > "$out/kernels/kernels.log" 2>&1; echo "kernels exit $?"
tail -5 "$out/kernels/kernels.log"
