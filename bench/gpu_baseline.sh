#!/usr/bin/env bash
# Issue 10's GPU baseline in ONE device call, under 9 minutes on an H100 with today's eager path:
#   bash bench/gpu_baseline.sh          # from the repository root on the GPU machine ($OUT set by the device tool)
# Writes under "$OUT": bench.log and bench_<preset>_<gpu>.{json,png,txt}; prints the table last.
# Wheels carried in .whl/ are installed into /tmp/site first (grpcio, grpcio-health-checking, grpcio-reflection,
# protobuf at our pins; fla-core for the peer's Gated DeltaNet kernels): see bench/README.md.
# Settings (environment, defaults in brackets):
#   LAYERS [32]        decoder layers of the Qwen3.5-4B-shaped checkpoint make-tiny writes (once per machine)
#   CKPT [/tmp/specdec-q35-4b-L$LAYERS]   where it is written; reused when it is already there
#   BUDGET [450]       seconds for the whole bench (checkpoint included); workloads that might not fit are skipped
#   HARD_LIMIT [BUDGET+75]  seconds after which the bench is interrupted (the table of what finished is still printed)
#   PRESET [baseline]  MAKE_TINY [qwen3.5-4b]  DEVICE [cuda]  EXTRA [""] more `specdec bench` options
set -u
out=${OUT:?OUT must name the output folder}
layers=${LAYERS:-32}
budget=${BUDGET:-450}
preset=${PRESET:-baseline}
ckpt=${CKPT:-/tmp/specdec-q35-4b-L$layers}
device=${DEVICE:-cuda}
start=$(date +%s)
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python3 - <<'EOF'
import importlib.metadata as md
names = ("torch", "triton", "transformers", "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
         "fla-core", "einops", "matplotlib", "accelerate")
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        found.append(f"{name} MISSING")
print("versions:", ", ".join(found))
EOF
# SIGINT: the bench stops its stack processes and keeps the JSON of the finished workloads.
timeout --signal=INT --kill-after=20 "${HARD_LIMIT:-$((budget + 75))}" \
  python3 -m specdec bench --preset "$preset" --device "$device" --model "$ckpt" --make-tiny "${MAKE_TINY:-qwen3.5-4b}" \
  --layers "$layers" --time-budget "$budget" --profile --profile-steps 5 --out "$out" ${EXTRA:-} \
  > "$out/bench.log" 2>&1
rc=$?
echo "bench exit $rc after $(( $(date +%s) - start )) s (log: bench.log)"
grep -E "checkpoint written|Gated DeltaNet kernels|skipping|Traceback|Error" "$out/bench.log" | cut -c1-300 | head -20
json=$(ls "$out"/bench_"$preset"_*.json 2>/dev/null | head -1)
if [ -z "$json" ]; then
  echo "no JSON written"; tail -30 "$out/bench.log"; exit 1
fi
table=${json%.json}.txt
if [ ! -s "$table" ]; then   # cut off before the end: render what finished
  python3 -m specdec bench --render "$json" > "$table" 2>> "$out/bench.log"
fi
python3 - "$json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
roof, prof = r.get("roofline") or {}, r.get("profile") or {}
print("checkpoint:", r["model"]["checkpoint"], "| peer:", r.get("peer"))
print("roofline:", json.dumps(roof))
print("profile:", json.dumps({k: v for k, v in prof.items() if k != "top"}))
for t in prof.get("top", [])[:8]:
    print(f"  {t['ms_per_step']:9.3f} ms/step {t['calls_per_step']:8.1f} calls/step  {t['name']}")
EOF
cat "$table"
