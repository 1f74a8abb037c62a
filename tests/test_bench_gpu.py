"""`specdec bench --quick` on a GPU (run on the GPU machine: `pytest -m gpu tests/test_bench_gpu.py`; CI skips it):
the CUDA-only parts — CUDA-event step split, the graphed weight chain, the kernel profile, per-process GPU memory."""
import json
import subprocess
import sys

import pytest
import torch

from specdec_tools.bench import checks
from specdec_tools.bench.workloads import PATHS, STACK_PATHS

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need CUDA: run them on the GPU machine (CI deselects -m gpu)")
    out = tmp_path_factory.mktemp("bench_gpu")
    run = subprocess.run([sys.executable, "-m", "specdec", "--log-level", "WARNING", "bench", "--quick", "--device",
                          "cuda", "--profile", "--profile-steps", "3", "--tag", "gpu", "--out", str(out)],
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((out / "bench_quick_gpu.json").read_text())


def test_gpu_run_is_complete_and_consistent(record):
    assert record["device"]["kind"] == "cuda" and record["problems"] == [] and record["skipped"] == []
    assert {r["workload"]["path"] for r in record["results"]} == set(PATHS)
    for r in record["results"]:
        for key, value in checks.numbers({"m": r["metrics"], "b": r["bandwidth"]}):
            assert value > 0 or checks.may_be_zero(key), (r["name"], key, value)


def test_cuda_figures(record):
    chain = record["roofline"]["weight_chain"]
    assert chain["cuda_graph"] and chain["gbs"] > 0 and record["roofline"]["device_copy"]["gbs"] > 100
    p = record["profile"]
    assert p["time_source"] == "GPU kernels" and p["kernels_per_step"] > 0
    assert p["host_syncs_per_step"] > 0 and 0 < p["gpu_busy_fraction"] <= 1
    for r in record["results"]:
        memory = r["metrics"]["memory"]
        if r["workload"]["path"] in STACK_PATHS:   # per process; colocated runs no drafter process
            assert memory["verifier_gpu_mib"] > 0
            if r["workload"]["path"] == "gateway" and r["workload"]["drafter"] != "none":
                assert memory["drafter_gpu_mib"] > 0
        else:
            assert memory["weights_mib"] > 0 and memory["workload_peak_mib"] > 0
