#!/usr/bin/env bash
# bench/device/table.sh: one `specdec bench` table in one device call on the GPU machine.
#
# Installs the wheels carried in .whl/ into /tmp/site, writes a 32k-id draft vocabulary file (DV=1), runs
# `specdec bench` under a hard time limit (the bench writes the Qwen3.5-4B-shaped random checkpoint with
# make-tiny first, once per machine) and leaves under $OUT, flat, at most 7 files:
#   bench_<PRESET>_<TAG>.json, .txt, .png   the run (the table is rendered from the JSON when the run was cut off)
#   bench.log                               the bench's log
#   device.txt                              GPU, driver, package versions, commit, the command, the date
#   step_split.txt, steps.tgz               with TRACE=1: bench/step_split.py's per-step split and the trace files
# Run it from the root of the code to measure (ab.sh runs it from an old commit's folder as well); the wheels are
# taken from the .whl/ of the repository that holds this script.
#
# Parameters (environment; the defaults are the command of the H100 table in bench/README.md):
#   OUT          output folder (the device tool sets it)
#   COMMIT       the commit to record in device.txt; default: `git rev-parse` of the copy, marked as such (the
#                device copy's .git can lag its working tree, and the JSON's git_commit field reads that .git)
#   PRESET [baseline]   PATHS [gateway peer]   DRAFTERS [none mtp@3.39]   CONC [1 16 64] PROMPT [128]
#   TEMPS [0]   MAX_TOKENS [256]   REPEATS [2]      the `specdec bench` filters of the same names
#                (MAX_TOKENS=0: the preset's own output lengths, e.g. PRESET=long's 16 and 512)
#   DV [1]       1: every mtp workload also runs with a 32k-id draft vocabulary (the +dv rows)
#   TRACE [0]    1: --trace-steps; step_split.txt (gateway against colocated, per step) and steps.tgz
#   PROFILE [0]  1: --profile (torch.profiler summary of in-process decode steps; needs inproc in PATHS)
#   LAYERS [32]   MAKE_TINY [qwen3.5-4b]   CKPT [/tmp/specdec-q35-4b-L$LAYERS]   DEVICE [cuda]
#   BUDGET [530]       --time-budget: seconds for the bench, checkpoint included (a workload that might not
#                      finish in time is skipped and listed)
#   HARD_LIMIT [BUDGET+25]  seconds after which the bench gets SIGINT (it keeps the finished workloads)
#   TAG [the device: h100, h200]   file-name suffix         EXTRA [""]   more `specdec bench` flags
#   SETUP [1]    0: do not install the wheels again (ab.sh, after its first pass)
#   LEAN [0]     1: keep only the JSON and its table (bench.log's tail and device.txt are printed; the PNG can
#                be drawn from the JSON): the device tool returns at most 8 files a call, 2-3 table runs fit
#                in one call this way
#   DRY_RUN [0]  1: print the `specdec bench` command and exit
# Examples (device tool: carry .whl; the command's time limit 600 s; write the commit into the command here, as a
# $(git ...) in it would run there):
#   COMMIT=1531736 bash bench/device/table.sh                               # the H100 table of bench/README.md
#   PATHS="inproc peer" DRAFTERS=none CONC="1 16 64" MAX_TOKENS=64 REPEATS=1 DV=0 bash bench/device/table.sh
set -u
out=${OUT:?OUT must name the output folder}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)    # the repository holding this script
tree=$PWD                                                    # the code that runs
layers=${LAYERS:-32}
preset=${PRESET:-baseline}
budget=${BUDGET:-530}
ckpt=${CKPT:-/tmp/specdec-q35-4b-L$layers}
dv_file=/tmp/specdec-dv32k.json
cmd=(python3 -m specdec bench --preset "$preset" --device "${DEVICE:-cuda}" --model "$ckpt"
     --make-tiny "${MAKE_TINY:-qwen3.5-4b}" --layers "$layers" --paths ${PATHS:-gateway peer}
     --drafters ${DRAFTERS:-none mtp@3.39} --concurrency ${CONC:-1 16 64} --prompt-tokens ${PROMPT:-128}
     --temperatures ${TEMPS:-0} --repeats "${REPEATS:-2}" --time-budget "$budget")
[ "${MAX_TOKENS:-256}" != 0 ] && cmd+=(--max-tokens "${MAX_TOKENS:-256}")
[ "${DV:-1}" = 1 ] && cmd+=(--draft-vocab "$dv_file")
[ "${TRACE:-0}" = 1 ] && cmd+=(--trace-steps /tmp/specdec-steps)
[ "${PROFILE:-0}" = 1 ] && cmd+=(--profile --profile-steps 5)
[ -n "${TAG:-}" ] && cmd+=(--tag "$TAG")
cmd+=(--out "$out" ${EXTRA:-})
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo; exit 0
fi
start=$(date +%s)
mkdir -p "$out"
if [ "${SETUP:-1}" = 1 ] && compgen -G "$root/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$root"/.whl/*.whl || { echo "wheel install failed"; exit 1; }
fi
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$tree; else export PYTHONPATH=$tree; fi
export PYTHONUNBUFFERED=1
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  command -v nvidia-smi > /dev/null && echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader | head -1)"
  if [ -n "${COMMIT:-}" ]; then echo "commit: $COMMIT"
  else echo "commit: $(git -C "$tree" rev-parse HEAD 2>/dev/null || echo unknown) (the copy's .git; may lag the tree)"; fi
  python3 - <<'EOF'
import importlib.metadata as md
names = ("torch", "triton", "transformers", "grpcio", "protobuf", "fla-core", "matplotlib")
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"
print("versions: " + ", ".join(f"{n} {version(n)}" for n in names))
EOF
  echo "command: $(printf '%q ' "${cmd[@]}")"
} > "$out/device.txt"
cat "$out/device.txt"
if [ "${DV:-1}" = 1 ]; then   # forced acceptance: which ids does not matter, how many does
  python3 - "$ckpt" "${MAKE_TINY:-qwen3.5-4b}" "$dv_file" <<'EOF' || exit 1
import json, sys
from pathlib import Path
ckpt, preset, path = sys.argv[1:]
config = Path(ckpt) / "config.json"
if config.exists():
    c = json.loads(config.read_text())
    vocab = (c.get("text_config") or c)["vocab_size"]
else:
    try:
        from specdec_tools.tiny_presets import PRESETS
    except ImportError:                       # an old commit (ab.sh)
        from specdec.tiny_presets import PRESETS
    vocab = PRESETS[preset]["vocab_size"]
ids = list(range(0, vocab, max(1, vocab // 32768)))[:32768]
json.dump({"format": "specdec-draft-vocab/1", "vocab_size": vocab, "token_ids": ids, "tokens_counted": 0,
           "coverage": 0.0}, open(path, "w"))
EOF
fi
rm -rf /tmp/specdec-steps
# SIGINT: the bench stops its stack processes and keeps the JSON of the finished workloads.
timeout --signal=INT --kill-after=15 "${HARD_LIMIT:-$((budget + 25))}" "${cmd[@]}" > "$out/bench.log" 2>&1
rc=$?
echo "specdec bench exit $rc after $(( $(date +%s) - start )) s"
grep -E "checkpoint written|skipping|Traceback|Error" "$out/bench.log" | cut -c1-300 | head -20
json=$(ls "$out"/bench_"$preset"_*.json 2>/dev/null | head -1)
if [ -z "$json" ]; then
  echo "no JSON written"; tail -30 "$out/bench.log"; exit 1
fi
table=${json%.json}.txt
[ -s "$table" ] || python3 -m specdec bench --render "$json" > "$table" 2>> "$out/bench.log"
if [ "${TRACE:-0}" = 1 ] && [ -d /tmp/specdec-steps ]; then
  PYTHONPATH=$PYTHONPATH:$root python3 -P "$root/bench/step_split.py" /tmp/specdec-steps > "$out/step_split.txt" 2>&1
  tar czf "$out/steps.tgz" -C /tmp specdec-steps
  if [ "$(stat -c %s "$out/steps.tgz")" -gt $((15 * 1024 * 1024)) ]; then
    rm "$out/steps.tgz"; echo "steps.tgz over 15 MiB: not kept (the device tool returns 16 MiB a file)"
  fi
  cat "$out/step_split.txt"
fi
cat "$table"
if [ "${LEAN:-0}" = 1 ]; then   # the JSON and its table only: the device tool returns 8 files a call
  tail -5 "$out/bench.log"
  rm -f "$out/bench.log" "$out/device.txt" "$out"/bench_*.png
fi
exit $rc
