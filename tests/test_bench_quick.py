"""`specdec bench --quick` end to end on the CPU with the demo model (what CI runs): all three paths, the
roofline references, the profile; the JSON's shape, every number positive, and the identities between them."""
import json
import subprocess
import sys

import pytest

from specdec_tools.bench import checks

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run([sys.executable, "-m", "specdec", "--log-level", "WARNING", "bench", "--quick", "--device",
                          "cpu", "--profile", "--profile-steps", "2", "--repeats", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, json.loads((out / "bench_quick_cpu.json").read_text()), run.stdout


def test_every_path_ran_and_nothing_was_cut(quick):
    _, record, _ = quick
    assert record["schema"] == "specdec-bench/1" and record["preset"] == "quick"
    assert record["problems"] == [] and record["skipped"] == []
    assert {r["workload"]["path"] for r in record["results"]} == {"inproc", "gateway", "colocated", "peer"}
    assert len(record["results"]) == record["settings"]["planned"]
    assert not any(r["metrics"]["truncated"] for r in record["results"])
    assert record["device"]["kind"] == "cpu" and record["model"]["name"] == "demo_model"
    assert record["cut_from_full"] and record["command"].startswith("specdec ")


def test_every_number_is_positive(quick):
    _, record, _ = quick
    for r in record["results"]:
        for key, value in checks.numbers({"m": r["metrics"], "b": r["bandwidth"]}):
            assert value > 0 or checks.may_be_zero(key), (r["name"], key, value)
    for key, value in checks.numbers(record["roofline"]):
        assert value > 0, key
    chain, weights = record["roofline"]["weight_chain"]["weight_bytes"], record["model"]["weight_bytes_per_step"]
    assert 0.95 * weights < chain <= weights   # every linear and the lm_head; only norms, conv taps ... left out


def test_token_accounting_is_consistent(quick):
    _, record, _ = quick
    for r in record["results"]:
        w, m = r["workload"], r["metrics"]
        assert m["completion_tokens"] == m["output_tokens"] == w["concurrency"] * w["max_tokens"], r["name"]
        if w["path"] == "peer":
            assert m["engine_steps"] == w["max_tokens"] and m["step_ms"] is None
            continue
        assert m["completion_tokens"] == m["verify_steps"] + m["accepted_tokens"] + m["prefills"], r["name"]
        assert m["prefills"] == w["concurrency"]
        assert m["mean_acceptance_length"] == pytest.approx(
            (m["completion_tokens"] - m["prefills"]) / m["verify_steps"], abs=1e-3)
        if w["drafter"] == "none":
            assert m["draft_tokens"] == 0 and m["mean_acceptance_length"] == 1.0
        else:
            assert 0 < m["draft_tokens"] <= w["k"] * m["verify_steps"]
        split = m["step_ms"]
        assert split["target_forward"] > 0 and split["sampling"] > 0 and split["total"] > split["target_forward"]
        if w["path"] == "inproc":
            parts = split["target_forward"] + split["sampling"] + (split["drafter_round_trip"] or 0) + split["host"]
            assert parts == pytest.approx(split["total"], rel=0.02)


def test_colocated_runs_the_drafter_inside_the_verifier(quick):
    """The colocated row drafts (its verifier holds the drafter) with no drafter process."""
    _, record, _ = quick
    rows = {(r["workload"]["path"], r["workload"]["drafter_label"], r["workload"]["concurrency"]): r
            for r in record["results"]}
    colocated, split = rows[("colocated", "mtp@2.5", 1)], rows[("gateway", "mtp@2.5", 1)]
    assert colocated["metrics"]["draft_tokens"] > 0
    assert "drafter_rss_mib" not in colocated["metrics"]["memory"]     # no drafter process
    passes = colocated["metrics"]["passes_tokens_per_s"]   # --repeats 2: the median pass of two is the upper one
    assert len(passes) == 2 and colocated["metrics"]["output_tokens_per_s"] == pytest.approx(max(passes), abs=0.01)
    assert {"verifier_rss_mib", "drafter_rss_mib"} <= set(split["metrics"]["memory"])


def test_profile_table_and_plot(quick):
    out, record, stdout = quick
    p = record["profile"]
    assert p["steps"] == 2 and p["top"] and p["workload"].startswith("inproc/mtp")
    table = (out / "bench_quick_cpu.txt").read_text()
    assert table.strip() in stdout.strip()
    lines = table.strip().splitlines()
    splits = [line for line in lines if line.startswith("service split, ")]   # gateway rows with a colocated twin
    assert len(lines) == 2 + len(record["results"]) + len(splits) and len(splits) == 1   # heading, columns, rows
    png = (out / "bench_quick_cpu.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_a_planted_inconsistency_in_the_output_is_caught(quick):
    _, record, _ = quick
    gateway = next(r for r in record["results"] if r["workload"]["path"] == "gateway")
    assert checks.check_result(gateway) == []
    gateway["metrics"]["verify_steps"] += 1
    assert any("verify_steps" in p for p in checks.check_result(gateway))
