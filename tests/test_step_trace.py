"""--trace-steps: the verifier's and the drafter's marks line up into each step's critical path."""
import gc
import time

import pytest
import torch
from engine_factory import make_engine, random_prompts

from specdec.sampling_params import SamplingParams
from specdec.step_trace import StepTrace, read_marks
from specdec_tools.trace_report import CHAIN, admission_lines, by_engine_step, report, segments

pytestmark = pytest.mark.timeout(120)
K = 3


def _marks(process, events):
    return [{"t": t, "process": process, "event": e, "step": s, "batch": b} for t, e, s, b in events]


def test_marks_are_assigned_to_the_step_that_sent_the_message():
    """Two engine steps; the answer to step 0's message is read at the start of step 1."""
    v = _marks("verifier", [
        (0.0, "step.begin", -1, 0), (1.0, "forward.begin", -1, 1), (2.0, "forward.launched", -1, 0),
        (5.0, "verified", -1, 0), (5.1, "committed", -1, 0), (5.2, "draft.inputs", -1, 0),
        (5.3, "link.message", 7, 0), (5.5, "link.sent", 7, 0), (5.6, "link.taken", 7, 0), (6.0, "step.end", -1, 0),
        (6.2, "outputs.delivered", -1, 0), (6.3, "step.begin", -1, 0), (8.9, "link.answer", 7, 0),
        (9.0, "link.read", 7, 0), (9.4, "forward.begin", -1, 1)])
    d = _marks("drafter", [(5.8, "drafter.received", 7, 0), (8.5, "drafter.proposed", 7, 0),
                           (8.6, "drafter.answered", 7, 0)])
    marks = sorted(v + d, key=lambda m: m["t"])
    steps, batch = by_engine_step(marks)
    assert steps[0]["drafter.received"] == 5.8 and steps[0]["link.read"] == 9.0   # step 0's message
    assert steps[1]["forward.begin"] == 9.4 and batch == {0: 1, 1: 1}
    got = {s.label: round(s.median_ms) for s in segments(steps, [0])}
    assert got["drafter: propose (its GPU work included)"] == 2700
    assert got["engine reads the answer"] == 100 and got["schedule, batch, drafts into it"] == 400
    assert got["engine waits for the answer"] == 2700          # step 1 began at 6.3, read at 9.0
    assert got["step (forward.begin to the next)"] == 8400
    chain = sum(got[label] for label, _, _ in CHAIN)
    assert chain == got["step (forward.begin to the next)"]    # the chain covers the step, nothing twice


def test_the_warm_up_before_serving_is_left_out():
    warm = _marks("verifier", [(0.0, "step.begin", -1, 0), (0.1, "forward.begin", -1, 4), (0.2, "serving", -1, 0)])
    served = _marks("verifier", [(1.0, "step.begin", -1, 0), (1.1, "forward.begin", -1, 1)])
    steps, batch = by_engine_step(warm + served)
    assert batch == {0: 1} and steps[0]["forward.begin"] == 1.1


def test_a_request_waits_for_the_launch_of_the_first_step_that_begins_after_it():
    """Two requests submitted while a step is being launched wait for the next step's launch, not that one's."""
    v = _marks("verifier", [
        (0.5, "request.submitted", -1, 0), (0.9, "serving", -1, 0),             # the warm-up's: left out
        (1.0, "request.submitted", -1, 0), (1.001, "step.begin", -1, 0), (1.004, "forward.launched", -1, 0),
        (2.0, "step.begin", -1, 0), (2.001, "request.submitted", -1, 0), (2.002, "request.submitted", -1, 0),
        (2.005, "forward.launched", -1, 0), (2.010, "step.begin", -1, 0), (2.020, "forward.launched", -1, 0)])
    d = _marks("drafter", [(2.0015, "request.submitted", -1, 0)])               # another process's: ignored
    lines = admission_lines(sorted(v + d, key=lambda m: m["t"]))
    assert lines == ["requests: 3 submitted; to the next step's launch: median 18.00 ms, p90 18.80 ms, max 19.00 ms"]
    assert admission_lines(v[:2]) == []
    skipped = _marks("verifier", [   # a step that launches nothing hands its late request to the next launch
        (1.0, "request.submitted", -1, 0), (1.1, "step.begin", -1, 0), (1.15, "request.submitted", -1, 0),
        (1.2, "step.begin", -1, 0), (1.25, "forward.launched", -1, 0), (1.3, "step.begin", -1, 0),
        (1.35, "forward.launched", -1, 0)])
    assert admission_lines(skipped)[0].endswith("median 175.00 ms, p90 235.00 ms, max 250.00 ms")


def test_off_by_default_writes_nothing(tmp_path):
    trace = StepTrace()
    trace.mark("step.begin")
    trace.close()
    assert not trace.enabled and list(tmp_path.iterdir()) == []


def test_flushes_every_n_marks_and_at_close(tmp_path):
    gc.disable()   # (a collection would add its own marks)
    try:
        trace = StepTrace(tmp_path / "t.jsonl", "verifier", flush_every=3)
        for i in range(4):
            trace.mark("link.sent", i)
        assert len(read_marks([tmp_path / "t.jsonl"])) == 3
        trace.close()
    finally:
        gc.enable()
    marks = read_marks([tmp_path / "t.jsonl"])
    assert [m["step"] for m in marks] == [0, 1, 2, 3] and {m["process"] for m in marks} == {"verifier"}


def test_garbage_collections_are_marked_and_reported_per_process(tmp_path):
    gc.disable()   # (only the collection below: none started by allocations meanwhile)
    try:
        trace = StepTrace(tmp_path / "d.jsonl", "drafter")
        gc.collect()
        trace.close()
    finally:
        gc.enable()
    assert trace._collection not in gc.callbacks          # closed: no callback left behind
    gc.collect()                                          # (not marked)
    marks = read_marks([tmp_path / "d.jsonl"])
    assert [(m["event"], m["batch"]) for m in marks] == [("gc.start", 2), ("gc.stop", 2)]
    assert marks[1]["t"] >= marks[0]["t"]
    assert "drafter gc gen 2: 1 collections" in report(marks)
    warm_up = _marks("verifier", [(marks[1]["t"] + 1.0, "serving", -1, 0)])
    assert "garbage collections" not in report(marks + warm_up)   # collections before serving are start-up's


def test_a_traced_engine_and_drafter_service_give_every_segment(tiny_model, tmp_path):
    """A real engine over the remote link to an ngram drafter service, both traced: every segment of the
    chain is measured once per drafted step, and the chain adds up to the step."""
    from drafter_service.factory import DrafterConfig
    from drafter_service.server import start as start_drafter
    from verifier_service.drafter_client import RemoteDrafter
    from verifier_service.drafter_link import DrafterLinkConfig

    server = start_drafter(DrafterConfig("ngram", K, trace_steps=str(tmp_path / "d.jsonl")), "127.0.0.1", 0)
    trace = StepTrace(tmp_path / "v.jsonl", "verifier")
    cfg = tiny_model.config
    remote = RemoteDrafter(DrafterLinkConfig(f"127.0.0.1:{server.port}", K), cfg.hidden_size, cfg.vocab_size,
                           torch.float32, torch.device("cpu"), 64, {}, cfg.model_type, trace=trace)
    try:
        deadline = time.monotonic() + 30
        while not remote.connected:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine = make_engine(tiny_model, remote, k=K)
        engine.drafting.trace = trace
        prompt = random_prompts([6], cfg.vocab_size)[0] * 3              # repeats: the n-gram drafter drafts
        engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))
    finally:
        remote.close()
        server.stop(0)     # closes the drafter's trace
        trace.close()
    marks = read_marks([tmp_path / "v.jsonl", tmp_path / "d.jsonl"])
    steps, batch = by_engine_step(marks)
    sent = [n for n in steps if "link.sent" in steps[n] and "link.read" in steps[n] and n + 1 in steps]
    assert len(sent) >= 5 and engine.stats.drafted > 0
    got = {s.label: s for s in segments(steps, sent)}
    for label, _, _ in CHAIN:
        assert got[label].count == len(sent), label
    assert sum(got[label].median_ms for label, _, _ in CHAIN) == pytest.approx(
        got["step (forward.begin to the next)"].median_ms, rel=0.5)
    assert "batch 1:" in report(marks, min_steps=5)
