"""specdec bench, part by part on the tiny checkpoint: latency figures, the byte model against real tensors,
the in-process path and the identities its results satisfy (with planted defects), the Prometheus scrape,
the profile summary, the presets and the CLI's errors."""
import copy
import math
from dataclasses import replace

import pytest
import torch

from specdec_tools.bench import checks, presets, workloads as wl
from specdec_tools.bench.latency import RequestTrace, percentile, summarize
from specdec_tools.bench.traffic import ModelTraffic, utilisation


def test_latency_figures_from_known_traces():
    a = RequestTrace(sent=0.0, times=[0.5, 0.6, 0.8], counts=[1, 3, 2])   # 6 tokens
    b = RequestTrace(sent=0.0, times=[1.0, 1.5], counts=[1, 1])           # 2 tokens
    s = summarize([a, b])
    assert s["output_tokens"] == 8 and s["seconds"] == 1.5
    assert s["output_tokens_per_s"] == pytest.approx(8 / 1.5, rel=1e-3)
    assert s["ttft_ms_p50"] == pytest.approx(750.0) and s["ttft_ms_p99"] == pytest.approx(995.0)
    assert s["itl_ms_p50"] == pytest.approx(200.0)            # gaps 100, 200, 500 ms
    assert s["itl_ms_mean"] == pytest.approx(800 / 3, rel=1e-4)
    assert s["tpot_ms_mean"] == pytest.approx((300 / 5 + 500 / 1) / 2)
    assert s["deliveries"] == 5


def test_percentile_is_numpy_linear():
    import numpy as np
    values = [3.0, 1.0, 7.5, 2.25, 9.0, 4.0]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


@pytest.mark.parametrize("tied", [True, False])
def test_byte_model_matches_the_loaded_tensors(tmp_path, tied):
    from specdec.models.caches import ModelCaches
    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    folder = make_tiny(tmp_path, overrides={"tie_word_embeddings": tied}, progress=False)
    loaded = load_model(folder)
    t = ModelTraffic.from_checkpoint(folder, "bfloat16")
    model = loaded.model
    params = {id(p): p for p in model.parameters()}.values()
    embed = model.embed_tokens.weight
    read = sum(p.numel() for p in params if tied or p is not embed)   # untied: embedding rows are not a GEMM
    assert t.weight_bytes == 2 * read
    assert t.num_params == sum(p.numel() for p in params)
    linears = [m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(t.linear_shapes) == sorted(tuple(s) for s in linears)
    assert t.linear_shapes[-1] == tuple(model.lm_head.weight.shape)
    caches = ModelCaches.allocate(loaded.config, num_blocks=3, block_size=4, num_gdn_slots=2, max_drafts=3,
                                  dtype=torch.bfloat16)
    kv = sum(x.numel() * x.element_size() for x in caches.kv.k + caches.kv.v)
    assert t.kv_bytes_per_token == kv // ((3 + 1) * 4)  # + the scratch block padding tokens write
    assert t.gdn_state_bytes == sum(r[0].numel() * r.element_size() for r in caches.gdn.recurrent)
    assert t.conv_bytes_per_column == sum(c[0, :, 0].numel() * c.element_size() for c in caches.gdn.conv)


def test_step_bytes_and_utilisation():
    t = ModelTraffic(weight_bytes=1000, linear_shapes=((4, 4),), kv_bytes_per_token=10, gdn_state_bytes=100,
                     conv_bytes_per_column=1, conv_kernel=4, num_params=500)
    # per sequence: KV read 50·10 + KV write (1+3)·10 + state (1 read + 1 write)·100 + conv (2·3 + 3)·1
    assert t.step_bytes(batch=2, mean_context=50, drafts=3) == 1000 + 2 * (500 + 40 + 200 + 9)
    u = utilisation(2e9, 0.5, copy_gbs=8.0, chain_gbs=5.0)
    assert (u["achieved_gbs"], u["vs_copy"], u["vs_chain"]) == (4.0, 0.5, 0.8)
    assert utilisation(1.0, None, 1.0, 1.0)["vs_copy"] is None


@pytest.fixture(scope="module")
def inproc_result(tiny_model):
    from specdec_tools.bench.inprocess import InprocBench
    w = wl.Workload("inproc", "mtp", concurrency=3, prompt_tokens=9, max_tokens=7, forced_length=2.5)
    metrics = InprocBench(tiny_model, torch.device("cpu"), repeats=3).run(w, wl.prompts_for(w, 257), guard_s=120)
    bw = utilisation(1e6, metrics["itl_ms_mean"] / 1e3, 10.0, 5.0)
    return {"name": w.name, "workload": w.to_json(), "metrics": metrics, "bandwidth": bw}


def test_inproc_result_satisfies_the_identities(inproc_result):
    """Three timed passes: the one of median tokens/s is reported, its counters its own (not the three's sum)."""
    m = inproc_result["metrics"]
    assert checks.check_result(inproc_result) == []
    assert m["completion_tokens"] == 21 == m["verify_steps"] + m["accepted_tokens"] + m["prefills"]
    assert len(m["passes_tokens_per_s"]) == 3
    assert sorted(m["passes_tokens_per_s"])[1] == pytest.approx(m["output_tokens_per_s"], abs=0.01)
    assert m["draft_tokens"] > 0 and m["step_ms"]["decode_steps"] > 0
    split = m["step_ms"]
    assert split["drafter_compute"] <= split["drafter_round_trip"] + 1e-6


@pytest.mark.parametrize("field, value, words", [
    ("completion_tokens", 20, "completion_tokens"),
    ("accepted_tokens", 10_000, "accepted_tokens"),
    ("prefills", 2, "prefills"),
    ("output_tokens_per_s", 0.0, "not > 0"),
    ("mean_acceptance_length", 9.0, "mean_acceptance_length"),
])
def test_checks_catch_planted_defects(inproc_result, field, value, words):
    bad = copy.deepcopy(inproc_result)
    bad["metrics"][field] = value
    assert any(words in p for p in checks.check_result(bad))


@pytest.mark.parametrize("end", [0.02335, 0.0233449, 0.02335001, 0.00071, 1.5])
def test_rate_of_a_short_run_agrees_with_its_rounded_seconds(inproc_result, end):
    """CI once failed here: a 23 ms CPU run had its seconds rounded to 0.1 ms, which moved tokens / seconds by
    0.2%, beyond the check's relative tolerance. The rate must agree with the seconds the summary reports."""
    traces = [RequestTrace(sent=0.0, times=[end / 3, end], counts=[1, 20])]
    ok = copy.deepcopy(inproc_result)
    ok["metrics"].update(summarize(traces))
    assert not [p for p in checks.check_result(ok) if "output_tokens_per_s" in p]
    bad = copy.deepcopy(ok)
    bad["metrics"]["output_tokens_per_s"] *= 1.003
    assert any("output_tokens_per_s" in p for p in checks.check_result(bad))


def test_an_adaptive_runs_cost_table_may_hold_zero_drafts_and_nobody_left(inproc_result):
    """The k = 0 column of step_costs_ms.drafts is 0 by definition, and a run where no sequence left the drafter
    has left_drafter 0: neither is a problem (a GPU run once listed 52 of them); a zero step cost still is."""
    ok = copy.deepcopy(inproc_result)
    ok["metrics"]["step_costs_ms"] = {"batch_sizes": [1, 2], "ms": [[3.4, 3.8], [4.3, 5.9]],
                                      "drafts": [[0.0, 1.0], [0.0, 0.98]], "plain_ms": [3.4, 4.3]}
    ok["metrics"]["left_drafter"] = 0
    assert checks.check_result(ok) == []
    ok["metrics"]["step_costs_ms"]["ms"][1][0] = 0.0
    assert any("step_costs_ms.ms.1.0" in p for p in checks.check_result(ok))


def test_checks_catch_a_split_that_does_not_add_up(inproc_result):
    bad = copy.deepcopy(inproc_result)
    bad["metrics"]["step_ms"]["host"] += bad["metrics"]["step_ms"]["total"]
    assert any("step split" in p for p in checks.check_result(bad))


def test_phase_means_from_the_verifiers_own_metrics():
    from prometheus_client import generate_latest

    from specdec_tools.bench.gateway_path import parse_metrics, phase_means
    from verifier_service.metrics import VerifierMetrics
    metrics = VerifierMetrics()
    for t in (0.010, 0.030):
        metrics.step_time.labels(phase="target").observe(t)
        metrics.step_time.labels(phase="verify").observe(t / 10)
    before = parse_metrics(generate_latest(metrics.registry).decode())
    for t in (0.020, 0.040, 0.060):
        metrics.step_time.labels(phase="target").observe(t)
        metrics.step_time.labels(phase="verify").observe(t / 10)
    means, steps = phase_means(before, parse_metrics(generate_latest(metrics.registry).decode()))
    assert steps == 3
    assert means["target"] == pytest.approx(0.040) and means["verify"] == pytest.approx(0.004)


def test_launch_gaps_of_known_spans():
    from specdec_tools.bench.profile import launch_gaps
    spans = [(0.0, 10.0), (15.0, 20.0), (18.0, 30.0), (40.0, 50.0)]   # µs; gaps 5 and 10, busy 35 of 50
    g = launch_gaps(spans, steps=2)
    assert g["launch_gap_ms_per_step"] == pytest.approx(15 / 2 / 1e3)
    assert g["gpu_busy_fraction"] == pytest.approx(0.7) and g["kernels_per_step"] == 2.0


def test_profile_summary_on_cpu(tiny_model):
    from specdec_tools.bench.inprocess import InprocBench
    from specdec_tools.bench.profile import profile_workload
    w = wl.Workload("inproc", "mtp", concurrency=2, prompt_tokens=6, max_tokens=8, forced_length=2.5)
    p = profile_workload(InprocBench(tiny_model, torch.device("cpu")), w, wl.prompts_for(w, 257), steps=2)
    assert p["steps"] == 2 and p["top"] and p["ops_per_step"] > 0
    assert sum(t["share"] for t in p["top"]) <= 1.0 + 1e-6 and p["host_syncs_per_step"] is None
    assert p["scalar_reads_per_step"] > 0        # the engine reads values back every step


def test_presets():
    full, baseline, quick = presets.full(), presets.baseline(), presets.quick()
    per_drafter = 4 * 2 * 2   # concurrencies x prompts x temperatures
    # inproc and gateway: 6 drafters (none, ngram, mtp, mtp@1.5 / 2.5 / 3.39); colocated: the 5 that draft; the
    # peer: none
    assert len(full) == (2 * 6 + 5 + 1) * per_drafter and len(set(full)) == len(full)
    as_full = {wl.Workload(w.path, w.drafter, w.concurrency, w.prompt_tokens, 256, w.temperature, w.forced_length)
               for w in baseline}
    assert as_full <= set(full) and len(set(baseline)) == len(baseline)
    assert {w.path for w in quick} == set(wl.PATHS) == {w.path for w in baseline}
    stacks = [w.stack_key for w in full if w.on_stack]
    assert len(set(stacks)) == sum(1 for a, b in zip([None] + stacks, stacks) if a != b)  # one start per stack
    twin = wl.Workload("colocated", "mtp", 1, 8, 8, forced_length=3.39)
    assert twin.stack_key != replace(twin, path="gateway").stack_key and twin.plain_path == "gateway"
    with pytest.raises(ValueError, match="peer"):
        wl.Workload("peer", "mtp", 1, 8, 8)
    with pytest.raises(ValueError, match="colocated"):
        wl.Workload("colocated", "none", 1, 8, 8)
    assert presets.select(full, paths=["peer"], concurrencies=[4], max_tokens=5)[0].max_tokens == 5


def test_prompts_are_shared_across_concurrencies():
    w1, w4 = wl.Workload("inproc", "none", 1, 16, 4), wl.Workload("gateway", "none", 4, 16, 4)
    p1, p4 = wl.prompts_for(w1, 100), wl.prompts_for(w4, 100)
    assert p4[0] == p1[0] and len(p4) == 4 and all(0 < t < 100 for p in p4 for t in p)


@pytest.mark.parametrize("argv, words", [
    (["--layers", "2"], "--layers only applies"),
    (["--paths", "peer", "--drafters", "ngram"], "leave no workload"),
    (["--paths", "peer", "--drafters", "ngram"], "whose workloads are (path/drafter/c<concurrency>/p<prompt tokens>/"
                                                 "o<output>/T<temperature>): inproc/none/c1/p"),
    (["--workload-timeout", "0"], "--workload-timeout must be > 0"),
    (["--repeats", "0"], "--repeats must be > 0"),
])
def test_cli_errors_name_the_option(tmp_path, capsys, argv, words):
    from specdec_tools.cli import main
    assert main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    assert words in capsys.readouterr().err


def test_weight_chain_on_cpu():
    from specdec_tools.bench.roofline import weight_chain
    shapes = ((48, 32), (32, 48), (100, 32))
    out = weight_chain(shapes, torch.float32, torch.device("cpu"), tokens=(1, 4), reps=2)
    assert out["weight_bytes"] == 4 * sum(math.prod(s) for s in shapes)
    assert out["ms_1_token"] > 0 and set(out["by_tokens"]) == {"1", "4"} and not out["cuda_graph"]


def test_step_split_parts_add_up_without_a_drafter():
    """With no drafter the engine's drafter phase still takes host time (its bookkeeping over the batch): the
    parts must still add up to the step (it was dropped once, and the H100 run's self-check caught 0.5 ms)."""
    from specdec_tools.bench.step_clock import step_split
    steps = [(1.0 + i, 0.012, {"target": 0.009, "verify": 0.0004, "drafter": 0.0005}, False) for i in range(5)]
    split = step_split(steps, {i: 0.0092 for i in range(5)}, {}, False, 0.0)
    parts = split["target_forward"] + split["sampling"] + split["host"]
    assert abs(parts - split["total"]) < 1e-3 and split["drafter_round_trip"] is None


def test_step_split_of_overlapped_steps_is_the_hosts_phases():
    """An overlapped step's forward runs on the GPU behind the host (its GPU span is longer than the step's wall
    time, as in the H100 run whose self-check caught a split of 5.78 ms against a 5.08 ms step): the parts are
    the host's phases, and they add up."""
    from specdec_tools.bench.step_clock import step_split
    steps = [(1.0 + i, 0.005, {"target": 0.0006, "verify": 0.0025, "drafter": 0.0004}, True) for i in range(5)]
    split = step_split(steps, {i: 0.0042 for i in range(5)}, {i: 0.0009 for i in range(5)}, True, 0.0)
    parts = split["target_forward"] + split["sampling"] + split["drafter_round_trip"] + split["host"]
    assert abs(parts - split["total"]) < 1e-3 and split["target_forward"] == pytest.approx(0.6)
    assert split["drafter_compute"] == pytest.approx(0.9)


def test_colocated_rows_compare_with_the_gateways_plain_row():
    """x plain of a colocated row is over the gateway's drafter-less row (the colocated path has none)."""
    from specdec_tools.bench.report import table_rows

    def result(path, drafter, forced, tps):
        w = wl.Workload(path, drafter, 1, 16, 8, forced_length=forced)
        return {"workload": w.to_json(), "bandwidth": {"vs_copy": None, "vs_chain": None},
                "metrics": {"output_tokens_per_s": tps, "truncated": False, "ttft_ms_p50": 1.0, "itl_ms_p50": 1.0,
                            "itl_ms_p99": 1.0}}
    rows = table_rows([result("gateway", "none", None, 100.0), result("gateway", "mtp", 3.39, 180.0),
                       result("colocated", "mtp", 3.39, 200.0)])
    assert [r[7] for r in rows] == ["1.00", "1.80", "2.00"]


def test_the_service_split_compares_each_gateway_row_with_its_colocated_twin():
    """The split line: gateway against the colocated row of the same drafter, concurrency, prompt and temperature
    (not another concurrency's, not the drafter-less row), with each path's range of timed passes."""
    from specdec_tools.bench.report import split_lines

    def result(path, drafter, concurrency, tps, passes=None):
        w = wl.Workload(path, drafter, concurrency, 16, 8, forced_length=None if drafter == "none" else 3.39)
        return {"workload": w.to_json(), "metrics": {"output_tokens_per_s": tps, "passes_tokens_per_s": passes}}
    lines = split_lines([result("gateway", "none", 16, 100.0), result("gateway", "mtp", 1, 50.0),
                         result("gateway", "mtp", 16, 194.0, [190.0, 194.0, 199.5]),
                         result("colocated", "mtp", 16, 200.0, [196.0, 200.0, 203.0]),
                         result("colocated", "mtp", 1, 49.0)])
    assert lines == [("service split, mtp@3.39 c1 T=0: gateway 50.0 against colocated 49.0 tok/s, +2.0% "
                      "(passes 50-50 against 49-49)"),
                     ("service split, mtp@3.39 c16 T=0: gateway 194.0 against colocated 200.0 tok/s, -3.0% "
                      "(passes 190-200 against 196-203)")]


def test_timed_passes_share_one_workload_guard(monkeypatch):
    """--repeats N: all N passes fit in one --workload-timeout (what the time budget reserves per workload), the
    first always runs, and the passes are not cut when they fit."""
    import time

    from specdec_tools.bench.gateway_path import GatewayBench
    w = wl.Workload(path="gateway", drafter="none", concurrency=1, prompt_tokens=8, max_tokens=4)
    bench = GatewayBench("unused", "cpu", "float32", repeats=5)
    guards = []

    def measure(w, prompts, guard_s):
        guards.append(guard_s)
        time.sleep(0.05)
        return {"output_tokens_per_s": 1.0}
    monkeypatch.setattr(bench, "_measure", measure)
    try:
        assert len(bench._timed_passes(w, [], 0.12)) == 2          # a third 0.05 s pass would end past 0.12 s
        assert guards[0] == pytest.approx(0.12, abs=0.01) and guards[1] < 0.08
        guards.clear()
        assert len(bench._timed_passes(w, [], 0.01)) == 1          # the first runs whatever is left
        guards.clear()
        assert len(bench._timed_passes(w, [], 5.0)) == 5
    finally:
        bench.close()


def test_bench_grammar_flag(tmp_path, capsys, inproc_result):
    """--grammar: parsed and checked, gateway path and real drafts only; constrained requests may end early."""
    from specdec_tools.cli import main
    from specdec_tools.commands.bench_cmd import parse_grammar
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    assert parse_grammar("json_object") == ("json_object", "")
    assert parse_grammar(f"json_schema@{schema}") == ("json_schema", '{"type": "object"}')
    assert parse_grammar("regex:[0-9]{1,3}") == ("regex", "[0-9]{1,3}")
    with pytest.raises(ValueError, match="grammar kind"):
        parse_grammar("yaml:x")
    for argv, words in ([["--grammar", "json_object"], "gateway path only"],
                        [["--grammar", "json_object", "--paths", "gateway"], "real drafts"]):
        assert main(["bench", "--quick", "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
        assert words in capsys.readouterr().err
    short = copy.deepcopy(inproc_result)
    short["metrics"]["completion_tokens"] = short["metrics"]["output_tokens"] = 13
    short["metrics"]["output_tokens_per_s"] = 13 / short["metrics"]["seconds"]
    assert any("completion_tokens 13 != concurrency" in p for p in checks.check_result(short))
    assert not any("!= concurrency x max_tokens" in p for p in checks.check_result(short, constrained=True))


def test_log_tails_show_the_traceback_before_an_abort(tmp_path):
    """A service that raised while starting and then aborted at exit: the tail shows why, not the C++ frames."""
    import tempfile

    from specdec_tools.bench.gateway_path import GatewayBench
    bench = object.__new__(GatewayBench)
    bench.logs = tempfile.TemporaryDirectory(dir=tmp_path)
    frames = [f"frame #{i}: <unknown function> + 0x{i:x} (0x7f in libc.so.6)" for i in range(27)]
    (tmp_path / bench.logs.name / "verifier.log").write_text("\n".join(
        ["starting", "Traceback (most recent call last):", "ValueError: the real reason",
         "terminate called without an active exception", "Exception raised from ..."] + frames))
    tail = bench.log_tails()
    assert "ValueError: the real reason" in tail and "frame #" not in tail
