set -u
out=$1
source bench/gpu_setup.sh "$out"
for variant in prefill noprefill prefill2; do
  mkdir -p "$out/$variant"
  extra=""; [ "$variant" = noprefill ] && extra=$PWD/.ab/noprefill
  PYTHONPATH=$PYTHONPATH${extra:+:$extra} timeout 170 python3 -m specdec bench --preset baseline --device cuda --model /tmp/specdec-q35-4b-L32 \
    --make-tiny qwen3.5-4b --layers 32 --paths inproc colocated --drafters mtp@3.39 --concurrency 16 --prompt-tokens 128 \
    --temperatures 0 --max-tokens 256 --time-budget 160 --repeats 3 --no-plot --out "$out/$variant" > "$out/$variant/bench.log" 2>&1
  echo "$variant exit $?"; grep -E "^ *(inproc|colocated) " "$out/$variant/bench.log" | cut -c1-200
done
