#!/usr/bin/env bash
# bench/device/ab.sh: a same-call A/B of two commits: one `specdec bench` command (bench/device/table.sh, same
# parameters) run on an old commit and on this tree, passes in the order PASSES gives, in one device call, so
# that both sides see the same machine: figures move between calls, which run on other machines (bench/README.md,
# "Method").
#
# Two steps:
#   bash bench/device/ab.sh prepare COMMIT   here, in the repository: `git archive` of COMMIT into .ab/old
#                                            (without tests/, docs/, bench/results/ and the demo weights),
#                                            and /.ab/ added to .git/info/exclude so that it travels only when carried
#   bash bench/device/ab.sh                  there (device tool, carry .whl and .ab): the passes
# Each pass runs table.sh from its tree (old: .ab/old, new: this tree) with TAG=<pass> and its share of the
# time left (TOTAL_S), then ab.sh compares. Under $OUT, flat (within the device tool's 8 files):
#   ab.txt            tok/s and TTFT p50 of every workload per pass, new / old, then each pass's table
#   bench_<pass>.json each pass's record        ab.tgz   the passes' logs, tables, device.txt, step splits
#
# Parameters (environment): those of table.sh (PATHS, DRAFTERS, CONC, MAX_TOKENS, REPEATS, DV, TRACE, EXTRA, ...;
# its defaults), and
#   PASSES [old new]  the passes in order: up to 5 distinct names that start with old or new ("old new new2 old2")
#   OLD, NEW          the commits, for the record (ab.txt)      AB_DIR [.ab]  where prepare writes old/
#   TOTAL_S [560]     seconds for all passes; each gets (TOTAL_S - elapsed) / passes left, less 25 s of margin.
#                     A pass's budget must hold the bench's estimate of a stack's start (90 s before its first
#                     start, then that start's time) plus --workload-timeout, or the bench skips the workload:
#                     with --workload-timeout 60, give TOTAL_S at least 175 s a pass
#   DRY_RUN [0]       1: print each pass's tree and command and exit
# Example: a second call with PASSES="new old" gives the other order (a machine that drifts within a call
# favours one):
#   OLD=f8f19b4 NEW=1531736 CONC=16 MAX_TOKENS=256 REPEATS=5 DV=0 bash bench/device/ab.sh
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
ab_dir=${AB_DIR:-.ab}
if [ "${1:-}" = prepare ]; then
  commit=${2:?usage: bash bench/device/ab.sh prepare COMMIT}
  rm -rf "$ab_dir/old" && mkdir -p "$ab_dir/old" || exit 1
  git archive "$commit" -- . ':(exclude)tests' ':(exclude)docs' ':(exclude)bench/results' \
    ':(exclude)specdec/demo_model/*.safetensors' | tar -x -C "$ab_dir/old" || exit 1
  git rev-parse "$commit" > "$ab_dir/old/.commit"
  if [ "$ab_dir" = .ab ] && ! grep -qx '/.ab/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null; then
    echo /.ab/ >> "$(git rev-parse --git-dir)/info/exclude"
  fi
  echo "$ab_dir/old: $(cat "$ab_dir/old/.commit"), $(du -sh "$ab_dir/old" | cut -f1); carry .ab (and .whl) in the run"
  exit 0
fi
out=${OUT:?OUT must name the output folder}
passes=(${PASSES:-old new})
[ ${#passes[@]} -le 5 ] || { echo "at most 5 passes"; exit 2; }
[ "$(printf '%s\n' "${passes[@]}" | sort -u | wc -l)" = ${#passes[@]} ] || { echo "pass names must differ"; exit 2; }
case $ab_dir in /*) old_tree=$ab_dir/old ;; *) old_tree=$here/$ab_dir/old ;; esac
if [ "${DRY_RUN:-0}" != 1 ] && [ ! -d "$old_tree" ]; then
  echo "no $ab_dir/old: run 'bash bench/device/ab.sh prepare COMMIT' here and carry .ab"; exit 2
fi
work=/tmp/specdec-ab; rm -rf "$work"; mkdir -p "$work" "$out"
start=$(date +%s); total=${TOTAL_S:-560}; setup=${SETUP:-1}; n=${#passes[@]}; elapsed=0
for pass in "${passes[@]}"; do
  case $pass in old*) tree=$old_tree ;; new*) tree=$here ;; *) echo "pass $pass: neither old nor new"; exit 2 ;; esac
  [ "${DRY_RUN:-0}" = 1 ] || elapsed=$(( $(date +%s) - start ))
  left=$(( (total - elapsed) / n )); n=$((n - 1))
  budget=$(( left - 25 ))
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "$pass in $tree: $(cd "$here" && DRY_RUN=1 OUT="$work/$pass" TAG=$pass BUDGET=$budget bash bench/device/table.sh)"
    elapsed=$((elapsed + left)); continue
  fi
  [ "$budget" -ge 60 ] || { echo "pass $pass: only $left s left, not run"; continue; }
  case $pass in old*) commit=$(cat "$tree/.commit" 2>/dev/null || echo "${OLD:-}") ;; *) commit=${NEW:-} ;; esac
  echo "== pass $pass ($tree), budget $budget s"
  mkdir -p "$work/$pass"
  (cd "$tree" && OUT="$work/$pass" TAG=$pass BUDGET=$budget HARD_LIMIT=$((budget + 15)) SETUP=$setup \
    COMMIT=$commit bash "$here/bench/device/table.sh" > "$work/$pass/table_sh.log" 2>&1)
  grep -E "^specdec bench exit" "$work/$pass/table_sh.log"
  setup=0
  cp "$work/$pass"/bench_*_"$pass".json "$out/bench_$pass.json" 2>/dev/null || tail -20 "$work/$pass/table_sh.log"
done
[ "${DRY_RUN:-0}" = 1 ] && exit 0
python3 - "$out" "${OLD:-old}" "${NEW:-new}" "${passes[@]}" > "$out/ab.txt" <<'EOF'
import json, statistics, sys
from pathlib import Path
out, old, new, passes = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
runs = {p: json.loads((out / f"bench_{p}.json").read_text()) for p in passes if (out / f"bench_{p}.json").exists()}
print(f"A/B in one call: old {old}, new {new}; passes in order: {' '.join(passes)}")
print("tok/s (TTFT p50 ms) per pass; new / old = mean tok/s of the new passes over the old ones")
names = sorted({r["name"] for rec in runs.values() for r in rec["results"]})
for name in names:
    cells, side = [], {"old": [], "new": []}
    for p, rec in runs.items():
        r = next((r for r in rec["results"] if r["name"] == name), None)
        if r and r["metrics"]["output_tokens_per_s"]:
            m = r["metrics"]
            cells.append(f"{p} {m['output_tokens_per_s']:.1f} ({m['ttft_ms_p50']:.1f})")
            side["old" if p.startswith("old") else "new"].append(m["output_tokens_per_s"])
    ratio = (f"{statistics.fmean(side['new']) / statistics.fmean(side['old']):.3f}"
             if side["old"] and side["new"] else "-")
    print(f"{name}: {'; '.join(cells)}; new / old {ratio}")
EOF
for pass in "${passes[@]}"; do
  echo; echo "== $pass"; cat "$work/$pass"/bench_*_"$pass".txt 2>/dev/null; cat "$work/$pass/step_split.txt" 2>/dev/null
done >> "$out/ab.txt"
cat "$out/ab.txt"
tar czf "$out/ab.tgz" -C "$work" .
if [ "$(stat -c %s "$out/ab.tgz")" -gt $((15 * 1024 * 1024)) ]; then   # the device tool returns 16 MiB a file
  tar czf "$out/ab.tgz" -C "$work" --exclude steps.tgz . && echo "ab.tgz: the step traces left out (size)"
fi
