#!/usr/bin/env bash
# bench/device/gpu_tests.sh: the `-m gpu` tests on the GPU machine, in one device call; log under $OUT.
#
# Installs the wheels carried in .whl/ into /tmp/site, then runs `python3 -m pytest -q -m gpu` over a group of
# test files under a time limit. Under $OUT: gpu_tests.log (pytest's whole output, the durations of the slowest
# tests at its end) and device.txt (GPU, driver, versions, commit, the command, the date). A `-m gpu` test fails,
# never skips, on a machine without a GPU (tests/conftest.py). The whole suite does not fit one call: run it as
# GROUP=engine, GROUP=rest and GROUP=startup.
#
# Parameters (environment):
#   OUT          output folder (the device tool sets it)
#   GROUP [engine]  engine: graph runner, overlapped steps and drafts, drafter, device steps, fast path, seeded
#                         sampling (tests/test_graph_runner.py ... test_seeded_sampling.py);
#                   startup: tests/test_gpu_warm_up.py, test_gpu_acceptance_dtypes.py (fresh stacks; minutes);
#                   rest: every other file with GPU tests (the kernels, forward batch, bench);
#                   all: every file with GPU tests
#   TESTS        files or node ids instead of GROUP's
#   K            a pytest -k expression
#   TESTS_S [570]   seconds before pytest is stopped (the device tool's limit is 600 a command)
#   COMMIT       the commit to record (default: `git rev-parse` of the copy, which can lag the tree)
#   DRY_RUN [0]  1: print the pytest command and exit
# Files are found by their `pytest.mark.gpu`; the device's Python lacks openai and cryptography, which some
# CPU-only test modules import: those are never among the files run here.
# Example (device tool, carry .whl):
#   GROUP=engine COMMIT=1531736 bash bench/device/gpu_tests.sh        # the commit written in here
set -u
out=${OUT:?OUT must name the output folder}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
engine="tests/test_graph_runner.py tests/test_overlapped_steps.py tests/test_overlapped_drafts.py
  tests/test_drafter_gpu.py tests/test_device_steps.py tests/test_gpu.py tests/test_seeded_sampling.py"
startup="tests/test_gpu_warm_up.py tests/test_gpu_acceptance_dtypes.py"
with_gpu=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
case ${GROUP:-engine} in
  engine) files=$engine ;;
  startup) files=$startup ;;
  rest) files=$(for f in $with_gpu; do case " $(echo $engine $startup) " in *" $f "*) ;; *) echo "$f" ;; esac; done) ;;
  all) files=$with_gpu ;;
  *) echo "GROUP: engine, startup, rest or all"; exit 2 ;;
esac
cmd=(python3 -m pytest -q -m gpu -p no:cacheprovider --durations 15 ${TESTS:-$files})
[ -n "${K:-}" ] && cmd+=(-k "$K")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo; exit 0
fi
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$root; else export PYTHONPATH=$root; fi
export PYTHONUNBUFFERED=1
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  command -v nvidia-smi > /dev/null && echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader | head -1)"
  if [ -n "${COMMIT:-}" ]; then echo "commit: $COMMIT"
  else echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) (the copy's .git; may lag the tree)"; fi
  echo "versions: $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1)"
  echo "command: $(printf '%q ' "${cmd[@]}")"
} > "$out/device.txt"
cat "$out/device.txt"
start=$(date +%s)
timeout --signal=INT --kill-after=15 "${TESTS_S:-570}" "${cmd[@]}" > "$out/gpu_tests.log" 2>&1
rc=$?
echo "pytest exit $rc after $(( $(date +%s) - start )) s (124: stopped by TESTS_S)"
grep -E "^(FAILED|ERROR)" "$out/gpu_tests.log" | cut -c1-200 | head -30
tail -3 "$out/gpu_tests.log"
exit $rc
