"""The engine loop keeps every request's promise: per-call keying (a duplicate id never touches the first call),
a last message for every request, a bounded queue, and an engine failure that fails requests loudly instead of
hanging them (issue 13, defects 1, 4, 5 and the max_len / generation_config items of 6)."""
import json
import queue
import shutil
import time

import pytest
from engine_factory import make_drafter, make_engine

from specdec.sampling_params import SamplingParams
from verifier_service.engine_loop import EngineLoop, EngineStopped, Failed, FailureKind, QueueFull

pytestmark = pytest.mark.timeout(120)
PROMPT = [5, 17, 3, 99, 42]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


class Client:
    """What a servicer does with a ticket: collect its outputs on a queue."""

    def __init__(self, loop: EngineLoop, rid: str, prompt=PROMPT, params=GREEDY):
        self.outputs: queue.Queue = queue.Queue()
        self.ticket = loop.submit(rid, prompt, params, self.outputs.put)

    def drain(self, timeout=60.0) -> list:
        items = []
        while True:
            item = self.outputs.get(timeout=timeout)
            items.append(item)
            if isinstance(item, Failed) or item.finish_reason:
                return items

    def tokens(self, items) -> list[int]:
        return [t for o in items if not isinstance(o, Failed) for t in o.new_token_ids]


@pytest.fixture
def engine(tiny_model):
    return make_engine(tiny_model, num_blocks=128, max_running=4)


@pytest.fixture
def reference(tiny_model):
    return make_engine(tiny_model).generate([PROMPT], GREEDY)[0]


def started(engine, **kwargs) -> EngineLoop:
    return EngineLoop(engine, **kwargs).start()


def test_duplicate_request_id_is_refused_and_the_first_call_runs_on(engine, reference):
    loop = started(engine)
    try:
        first = Client(loop, "same", params=SamplingParams(max_tokens=40, ignore_eos=True))
        head = first.outputs.get(timeout=60)  # the first call is admitted and streaming
        second = Client(loop, "same")
        refusal = second.drain()
        assert isinstance(refusal[-1], Failed) and refusal[-1].kind is FailureKind.INVALID
        assert "request_id" in refusal[-1].message and "already running" in refusal[-1].message
        loop.cancel(second.ticket)   # the refused call's end-of-call hook: must not reach the first call
        items = [head] + first.drain()
        assert items[-1].finish_reason == "length" and len(first.tokens(items)) == 40
        assert first.tokens(items)[:12] == reference
        assert loop.in_flight == 0
    finally:
        loop.stop()


def test_abort_by_id_ends_the_stream_with_abort_and_usage(engine):
    loop = started(engine)
    try:
        client = Client(loop, "r1", params=SamplingParams(max_tokens=200, ignore_eos=True))
        client.outputs.put(client.outputs.get(timeout=60))
        assert loop.is_running("r1")
        loop.abort("r1")
        items = client.drain()
        last = items[-1]
        assert last.finish_reason == "abort" and last.new_token_ids == [] and last.num_prompt == len(PROMPT)
        assert engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size
        assert engine.executor.blocks.gdn_slots.num_free == engine.executor.blocks.gdn_slots.size and loop.in_flight == 0
    finally:
        loop.stop()


@pytest.mark.parametrize("where", ["step", "on_step"])
def test_engine_failure_fails_requests_with_internal_and_reports(engine, where, caplog):
    fatal = []
    calls = {"n": 0}

    def on_step(*_):
        calls["n"] += 1
        if where == "on_step" and calls["n"] == 3:
            raise RuntimeError("stats hook broke")
    if where == "step":
        real_step = engine.step

        def step():
            calls["n"] += 1
            if calls["n"] == 3:
                raise ValueError("planted bug in step")  # a ValueError: must still be INTERNAL, not INVALID
            return real_step()
        engine.step = step
    loop = started(engine, on_step=on_step, on_fatal=fatal.append)
    try:
        clients = [Client(loop, f"r{i}", params=SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(3)]
        for c in clients:
            last = c.drain()[-1]
            assert isinstance(last, Failed) and last.kind is FailureKind.INTERNAL, last
            assert "internal error" in last.message
        assert len(fatal) == 1 and loop.error is fatal[0]
        with pytest.raises(EngineStopped):
            Client(loop, "late")
        assert "engine loop stopped by an internal error" in caplog.text
    finally:
        loop.stop()


def test_a_reader_that_is_gone_ends_only_its_own_request(engine, reference):
    loop = started(engine)
    try:
        def broken(item):
            raise RuntimeError("event loop closed")
        loop.submit("gone", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True), broken)
        healthy = Client(loop, "ok")
        assert healthy.tokens(healthy.drain()) == reference
        deadline = time.monotonic() + 30
        while loop.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.in_flight == 0 and loop.error is None
        assert engine.executor.blocks.gdn_slots.num_free == engine.executor.blocks.gdn_slots.size
    finally:
        loop.stop()


def test_admission_is_bounded_by_max_running_plus_max_queued(engine):
    loop = EngineLoop(engine, max_queued=2)  # max_running 4: at most 6 requests in the verifier
    clients = [Client(loop, f"r{i}", params=SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(6)]
    with pytest.raises(QueueFull, match="max-queued"):
        Client(loop, "one-too-many")
    loop.start()
    try:
        for c in clients:
            assert c.drain()[-1].finish_reason == "length"
        assert loop.in_flight == 0
        assert Client(loop, "after").drain()[-1].finish_reason == "length"  # room again
    finally:
        loop.stop()


def test_request_at_exactly_the_context_limit_runs_with_drafts(tiny_model):
    """prompt + max_tokens == max_len must pass (the gateway accepts it) even with k drafts per step."""
    k = 3
    engine = make_engine(tiny_model, drafter=make_drafter("ngram", tiny_model, k), k=k, num_blocks=64)
    engine.requests.max_len = 40
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7]
    out = engine.generate([prompt], SamplingParams(max_tokens=engine.max_len - len(prompt), ignore_eos=True))[0]
    assert len(out) == engine.max_len - len(prompt)
    assert engine.stats.drafted > 0
    with pytest.raises(OverflowError):
        engine.add_request("over", prompt, SamplingParams(max_tokens=engine.max_len - len(prompt) + 1))


def test_eos_ids_of_generation_config_stop_generation(tiny_dir, tmp_path):
    from specdec.models.loader import load_model
    plain = load_model(tiny_dir)
    first = make_engine(plain).generate([PROMPT], SamplingParams(max_tokens=8))[0]
    assert len(first) == 8 and first[0] not in plain.config.eos_token_id  # runs to the length limit otherwise
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [first[0]]}))
    loaded = load_model(folder)
    assert first[0] in loaded.config.eos_token_id and set(plain.config.eos_token_id) <= set(loaded.config.eos_token_id)
    engine = make_engine(loaded)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=8))
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert [t for o in outputs for t in o.new_token_ids] == first[:1] and outputs[-1].finish_reason == "stop"
