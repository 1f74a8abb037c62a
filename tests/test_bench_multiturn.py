"""`specdec bench --preset multiturn` (issue 39's prefix-cache workload): conversations through the gateway, each
turn's prompt the conversation so far. No services run here: a fake Gateway stub answers the streams, with a
fake prefix cache behind its usage's cached_tokens."""
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import grpc
import pytest

from specdec_tools.bench import checks, presets, report
from specdec_tools.bench.gateway_clients import send_conversations
from specdec_tools.bench import workloads as wl
from specdec_tools.bench.latency import RequestTrace, TurnRecord, turn_figures

from test_bench_long import fake_stacks

pytestmark = pytest.mark.timeout(120)
BLOCK = 16


def small(**kw) -> wl.Workload:
    """A conversation workload small enough for a fake stack: 3 conversations of 4 turns."""
    shape = dict(path="gateway", drafter="none", concurrency=3, prompt_tokens=40, max_tokens=5, turns=4,
                 turn_tokens=7)
    return wl.Workload(**{**shape, **kw})


class FakeGateway:
    """Stands in for gateway_pb2_grpc.GatewayStub: answers each Generate with max_tokens ids (a function of the
    request id, in chunks of 2, a few ms apart) and a usage whose cached_tokens is the longest whole-block prefix
    the prompt shares with a sequence (prompt + output) an earlier request finished with, one token short of the
    prompt at most (a toy prefix cache that outlives the pass, as the verifier's does)."""

    def __init__(self, with_cached_tokens: bool = True, chunk_s: float = 0.001):
        self.requests = []                # (request, output ids, cached tokens) in the order they were sent
        self.finished: list[list[int]] = []
        self.lock = threading.Lock()
        self.with_cached_tokens = with_cached_tokens
        self.chunk_s = chunk_s            # between two deliveries

    def __call__(self, channel):          # GatewayStub(channel)
        return self

    def cached(self, prompt: list[int]) -> int:
        best = 0
        for seq in self.finished:
            n = 0
            for a, b in zip(prompt, seq):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best // BLOCK * BLOCK, max(0, len(prompt) - 1) // BLOCK * BLOCK)

    def Generate(self, request, timeout=None):
        prompt = list(request.prompt_token_ids)
        n = request.sampling.max_tokens
        base = sum(map(ord, request.request_id))
        output = [(base * 31 + 7 * i) % 997 + 1 for i in range(n)]
        with self.lock:
            cached = self.cached(prompt)
            self.requests.append((request, output, cached))
        usage = dict(prompt_tokens=len(prompt), completion_tokens=n, draft_tokens=0, accepted_tokens=0,
                     verify_steps=n - 1)
        if self.with_cached_tokens:
            usage["cached_tokens"] = cached

        def replies():
            time.sleep(0.004 if cached else 0.02)      # a cold prompt takes longer to its first token
            for i in range(0, n, 2):
                last = i + 2 >= n
                if last:
                    with self.lock:
                        self.finished.append(prompt + output)
                elif i:
                    time.sleep(self.chunk_s)
                yield SimpleNamespace(token_ids=output[i:i + 2], finish_reason="length" if last else "",
                                      usage=SimpleNamespace(**usage) if last else None)
        return FakeCall(replies())


class Cancelled(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "cancelled by the client"


class FakeCall:
    """A streaming call: iterates the replies until cancel(), then raises CANCELLED (as a grpc call does)."""

    def __init__(self, replies):
        self.replies, self.cancelled = replies, False

    def __iter__(self):
        return self

    def __next__(self):
        reply = next(self.replies)
        if self.cancelled:            # (what arrives after a cancel is dropped)
            raise Cancelled()
        return reply

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def fake_gateway(monkeypatch):
    from specdec_tools.bench import gateway_clients, gateway_path
    fake = FakeGateway()
    monkeypatch.setattr(gateway_clients.gateway_pb2_grpc, "GatewayStub", fake)
    monkeypatch.setattr(gateway_clients, "connect", lambda channel, address: None)   # no server behind the fake stub
    bench = gateway_path.GatewayBench("unused", "cpu", "float32")
    bench.stack = SimpleNamespace(address="127.0.0.1:1", stop=lambda: None)   # never connected: the stub is fake
    def scrape():   # the verifier's counters: engine steps (3 a request), the prefix cache's tokens asked, served
        steps = 3.0 * len(fake.requests)
        return {("specdec_step_seconds_count", 'phase="target"'): steps,
                ("specdec_step_seconds_sum", 'phase="target"'): steps * 1e-3,
                ("specdec_prefix_cache_queries_total", ""): float(sum(len(r.prompt_token_ids)
                                                                      for r, _, _ in fake.requests)),
                ("specdec_prefix_cache_hits_total", ""): float(sum(c for _, _, c in fake.requests))}
    monkeypatch.setattr(bench, "scrape", scrape)
    monkeypatch.setattr(bench, "_memory", lambda: {})
    yield fake, bench
    bench.stack = None
    bench.close()


def test_the_multiturn_preset():
    plan = presets.multiturn()
    assert [w.drafter_label for w in plan] == ["none", "mtp@3.39", "mtp"]
    for w in plan:
        assert (w.path, w.concurrency, w.prompt_tokens, w.max_tokens, w.temperature) == ("gateway", 16, 4096, 128, 0)
        assert (w.turns, w.turn_tokens, w.requests, w.prefix_cache) == (8, 200, 16 * 8, True)
        assert w.name.endswith("/c16/p4096/o128/T0/turns8x200")
        # the stack is sized for the longest prompt: the 8th turn's, after 7 answers of 128 tokens
        assert w.prompt_lengths == [4096 + 8 * 200 + 7 * 128] * 16
        assert w.turn_prompt_tokens(1) == 4296 and w.turn_prompt_tokens(2) == 4296 + 128 + 200
    assert len({w.stack_key for w in plan}) == 3
    w = plan[0]
    assert w.mean_context == pytest.approx(sum(w.turn_prompt_tokens(t) for t in range(1, 9)) / 8 + 64)
    for bad in (dict(path="inproc"), dict(turn_tokens=0), dict(long_prompt=512)):
        with pytest.raises(ValueError, match="conversations"):
            replace(w, **bad)
    with pytest.raises(ValueError, match="nocache"):
        wl.Workload("inproc", "none", 1, 8, 8, prefix_cache=False)


def test_list_prints_the_planned_workloads(capsys):
    from specdec_tools.cli import main
    assert main(["bench", "--preset", "multiturn", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("3 workloads (multiturn,")
    assert out[1:4] == ["  gateway/none/c16/p4096/o128/T0/turns8x200",
                        "  gateway/mtp@3.39/c16/p4096/o128/T0/turns8x200", "  gateway/mtp/c16/p4096/o128/T0/turns8x200"]
    assert main(["bench", "--preset", "multiturn", "--list", "--no-prefix-caching", "--turns", "3",
                 "--turn-tokens", "16", "--system-tokens", "64", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:5] == ["  gateway/none/c16/p64/o8/T0/turns3x16", "  gateway/none+nocache/c16/p64/o8/T0/turns3x16",
                        "  gateway/mtp@3.39/c16/p64/o8/T0/turns3x16",
                        "  gateway/mtp@3.39+nocache/c16/p64/o8/T0/turns3x16"]
    assert main(["bench", "--preset", "multiturn", "--list", "--no-prefix-caching", "--drafters",
                 "mtp@3.39+nocache"]) == 0
    assert capsys.readouterr().out.splitlines()[1:2] == ["  gateway/mtp@3.39+nocache/c16/p4096/o128/T0/turns8x200"]
    assert main(["bench", "--preset", "multiturn", "--list", "--own-system-prompts", "--drafters", "none"]) == 0
    assert capsys.readouterr().out.splitlines()[1:2] == ["  gateway/none/c16/p4096/o128/T0/turns8x200/own-system"]


@pytest.mark.parametrize("argv, words", [
    (["--preset", "long", "--turns", "3"], "--turns shape conversation workloads"),
    (["--preset", "long", "--own-system-prompts"], "--own-system-prompts shape conversation workloads"),
    (["--preset", "multiturn", "--turn-tokens", "0"], "--turn-tokens must be > 0"),
    (["--quick", "--paths", "inproc", "--no-prefix-caching"], "--no-prefix-caching"),
])
def test_cli_errors(capsys, argv, words):
    from specdec_tools.cli import main
    assert main(["bench", "--list", *argv]) == 2
    assert words in capsys.readouterr().err


def test_conversations_share_the_system_prompt_and_no_user_turn():
    w = small()
    convs = wl.conversations_for(w, 1000)
    assert len(set(convs.system)) == 1 and len(convs.system) == 3 and len(convs.system[0]) == 40
    assert len(convs.user) == 3 and all(len(c) == 4 for c in convs.user)
    turns = [t for c in convs.user for t in c]
    assert all(len(t) == 7 for t in turns) and len(set(turns)) == len(turns)
    assert all(0 < i < 1000 for t in turns + [convs.system[0]] for i in t)
    assert convs.prompt(1, 0, []) == list(convs.system[1]) + list(convs.user[1][0])
    assert convs == wl.conversations_for(w, 1000)                                    # the same on every path
    assert wl.conversations_for(replace(w, concurrency=5), 1000).user[:3] == convs.user
    assert wl.salted(convs, 0) == convs
    warm = wl.salted(convs, -1)      # the warm-up's: same ids, other sequences, from the first block on
    assert sorted(warm.system[0]) == sorted(convs.system[0]) and warm.system[0][:BLOCK] != convs.system[0][:BLOCK]
    assert len(set(warm.system)) == 1
    prompts = wl.prompts_for(wl.Workload("gateway", "none", 2, 32, 4), 1000)
    assert wl.salted(prompts, 0) == prompts and all(a[0] != b[0] for a, b in zip(wl.salted(prompts, 1), prompts))


def test_own_system_prompts_give_each_conversation_its_own():
    """--own-system-prompts: every conversation starts from a system prompt of its own (so its turn 1 finds
    nothing in the cache); conversation 0's is the shared one, user turns are unchanged, and the workload's name,
    JSON and prompt column say so."""
    shared, own = small(), small(shared_system=False)
    a, b = wl.conversations_for(shared, 1000), wl.conversations_for(own, 1000)
    assert len(set(b.system)) == 3 and all(len(p) == 40 for p in b.system)
    assert all(x[:BLOCK] != y[:BLOCK] for i, x in enumerate(b.system) for y in b.system[:i])
    assert b.system[0] == a.system[0] and b.user == a.user
    assert b.prompt(2, 0, []) == list(b.system[2]) + list(b.user[2][0])
    assert wl.conversations_for(replace(own, concurrency=5), 1000).system[:3] == b.system
    warm = wl.salted(b, -1)
    assert all(sorted(w) == sorted(s) and w != s for w, s in zip(warm.system, b.system))
    assert own.name.endswith("/turns4x7/own-system") and own.to_json()["shared_system"] is False
    from specdec_tools.bench.report import _prompt
    assert _prompt(own.to_json()) == "own 40+4x7" and _prompt(shared.to_json()) == "40+4x7"
    with pytest.raises(ValueError, match="own"):
        wl.Workload("gateway", "none", 2, 8, 8, shared_system=False)
    plan = presets.select(presets.multiturn(), own_system_prompts=True)
    assert plan and all(not w.shared_system for w in plan)


def test_each_turn_sends_the_conversation_so_far(fake_gateway):
    """Turn t's prompt is turn t-1's prompt, then the exact tokens turn t-1 gave back, then turn t's user tokens;
    each conversation's turns go one after the other, the conversations side by side."""
    fake, bench = fake_gateway
    w = small()
    convs = wl.conversations_for(w, 1000)
    records, truncated = send_conversations(bench.stack.address, w, convs, 60.0)
    assert not truncated and len(records) == w.requests == len(fake.requests) == 12
    sent = {r.request_id: (list(r.prompt_token_ids), out, r.sampling.seed) for r, out, _ in fake.requests}
    assert len({seed for _, _, seed in sent.values()}) == 12
    for c in range(3):
        prompt, output, _ = sent[f"bench-c{c}-t1"]
        assert prompt == list(convs.system[c]) + list(convs.user[c][0])
        for t in range(2, 5):
            nxt, nxt_output, _ = sent[f"bench-c{c}-t{t}"]
            assert nxt == prompt + output + list(convs.user[c][t - 1])
            assert len(nxt) == w.turn_prompt_tokens(t)
            prompt, output = nxt, nxt_output
        mine = sorted((r for r in records if r.conversation == c), key=lambda r: r.turn)
        assert [r.turn for r in mine] == [1, 2, 3, 4]
        assert all(b.trace.sent >= a.trace.times[-1] for a, b in zip(mine, mine[1:]))   # one after the other
        assert [r.prompt_tokens for r in mine] == [w.turn_prompt_tokens(t) for t in range(1, 5)]
    first = [r for r in records if r.turn == 1]
    assert max(r.trace.sent for r in first) < min(r.trace.times[0] for r in first)      # side by side
    assert all(r.finish_reason == "length" and r.usage.completion_tokens == 5 for r in records)


def test_the_guard_cuts_the_conversations(fake_gateway):
    """At the workload's guard the turns in flight are cancelled and no further turn is sent."""
    fake, bench = fake_gateway
    fake.chunk_s = 0.1                    # 3 deliveries a turn: about 0.22 s each
    w = small()
    start = time.perf_counter()
    records, truncated = send_conversations(bench.stack.address, w, wl.conversations_for(w, 1000), 0.3)
    assert truncated and time.perf_counter() - start < 5.0
    assert 3 <= len(records) < w.requests and len(fake.requests) == len(records)
    assert max(r.trace.sent for r in records) < start + 0.3
    cut = [r for r in records if r.usage is None]
    assert cut and all(r.finish_reason == "cancelled" for r in cut)
    time.sleep(0.3)
    assert len(fake.requests) == len(records)          # nothing sent once the pass was over


def record(turn: int, ttft_ms: float, prompt: int, cached, conversation: int = 0) -> TurnRecord:
    usage = SimpleNamespace(prompt_tokens=prompt, **({} if cached is None else {"cached_tokens": cached}))
    return TurnRecord(conversation, turn, prompt, RequestTrace(sent=1.0, times=[1.0 + ttft_ms / 1e3], counts=[1]),
                      "length", usage)


def test_ttft_split_ratio_and_hit_rate_of_known_turns():
    first = [record(1, ms, 1000, cached) for ms, cached in ((100, 0), (200, 0), (300, 496), (400, 0))]
    later = [record(2, 10, 1500, 1488), record(2, 20, 1500, 1488), record(3, 30, 2000, 1984),
             record(3, 40, 2000, 0), record(3, 50, 2000, 1984), record(4, 60, 2500, 2496)]
    f = turn_figures(first + later)
    assert f["turn_1"]["ttft_ms_p50"] == pytest.approx(250.0) and f["turn_1"]["ttft_ms_p90"] == pytest.approx(370.0)
    assert f["later"]["ttft_ms_p50"] == pytest.approx(35.0) and f["later"]["ttft_ms_p90"] == pytest.approx(55.0)
    assert f["ttft_p50_ratio"] == pytest.approx(35 / 250, abs=1e-4)
    assert (f["turn_1"]["prompt_tokens"], f["turn_1"]["cached_tokens"]) == (4000, 496)
    assert f["turn_1"]["hit_rate"] == pytest.approx(496 / 4000, abs=1e-4)
    assert (f["later"]["prompt_tokens"], f["later"]["cached_tokens"]) == (11500, 9440)
    assert f["later"]["hit_rate"] == pytest.approx(9440 / 11500, abs=1e-4)
    assert f["all"]["hit_rate"] == pytest.approx((496 + 9440) / 15500, abs=1e-4)
    assert f["all"]["requests"] == 10 and f["all"]["ttft_ms_p50"] == pytest.approx(55.0)
    assert [(b["turn"], b["requests"], b["cached_tokens"]) for b in f["by_turn"]] == [
        (1, 4, 496), (2, 2, 2976), (3, 3, 3968), (4, 1, 2496)]
    assert f["by_turn"][2]["ttft_ms_p50"] == pytest.approx(40.0)
    only_first = turn_figures(first)
    assert only_first["later"] is None and only_first["ttft_p50_ratio"] is None
    unknown = turn_figures([record(1, 100, 1000, None), record(2, 10, 1500, None)])   # a gateway without the field
    assert unknown["later"]["cached_tokens"] is None and unknown["all"]["hit_rate"] is None
    assert unknown["ttft_p50_ratio"] == pytest.approx(0.1)


def test_a_real_usage_message_gives_its_cached_tokens():
    from specdec.rpc.v1 import gateway_pb2
    if "cached_tokens" not in gateway_pb2.Usage.DESCRIPTOR.fields_by_name:
        pytest.skip("gateway.proto's Usage has no cached_tokens yet")
    r = record(1, 100, 1000, None)
    r.usage = gateway_pb2.Usage(prompt_tokens=1000, cached_tokens=992)
    assert turn_figures([r])["turn_1"]["hit_rate"] == pytest.approx(0.992)


def test_a_pass_through_a_fake_gateway(fake_gateway):
    """bench.run: a warm-up pass then a timed one, each on its own tokens (so the timed pass's first turns find
    nothing of the warm-up in the cache while its later turns find their conversation), the figures and the
    checks on them, and the report's conversation table."""
    fake, bench = fake_gateway
    w = small()
    convs = wl.conversations_for(w, 1000)
    m = bench.run(w, convs, 60.0)
    assert len(fake.requests) == 2 * w.requests
    warm, timed = fake.requests[:w.requests], fake.requests[w.requests:]
    timed_prompts = {r.request_id: list(r.prompt_token_ids) for r, _, _ in timed}
    assert timed_prompts["bench-c0-t1"] == list(convs.system[0]) + list(convs.user[0][0])   # the workload's own
    assert all(list(r.prompt_token_ids)[:BLOCK] != list(convs.system[0])[:BLOCK] for r, _, _ in warm)
    f = m["multiturn"]
    assert m["completion_tokens"] == m["output_tokens"] == w.requests * w.max_tokens and m["prefills"] == 12
    assert f["turn_1"]["cached_tokens"] == 0 and f["turn_1"]["requests"] == 3 and f["later"]["requests"] == 9
    later_prompts = sum(w.turn_prompt_tokens(t) for t in range(2, 5)) * 3
    assert f["later"]["prompt_tokens"] == later_prompts
    assert f["later"]["cached_tokens"] == sum(c for r, _, c in timed if not r.request_id.endswith("-t1"))
    assert m["prefix_cache_hit_tokens"] == f["all"]["cached_tokens"]             # the verifier's counters agree
    assert m["prefix_cache_queried_tokens"] == f["all"]["prompt_tokens"]
    assert f["later"]["hit_rate"] == pytest.approx(f["later"]["cached_tokens"] / later_prompts, abs=1e-4)
    assert f["later"]["hit_rate"] > 0.8 and f["ttft_p50_ratio"] < 0.5
    result = {"name": w.name, "workload": w.to_json(), "metrics": m,
              "bandwidth": {"bytes_per_step": 1, "achieved_gbs": None, "vs_copy": None, "vs_chain": None}}
    assert checks.check_result(result) == []
    record_ = {"preset": "multiturn", "device": {"name": "fake"}, "results": [result],
               "model": {"name": "m", "layers": 1, "weight_gb": 1.0, "dtype": "float32"}}
    text = report.render_table(record_, markdown=True)
    head = "| " + " | ".join(report.MULTITURN_COLUMNS) + " |"
    row = text.splitlines()[text.splitlines().index(head) + 2].split(" | ")
    assert row[:8] == ["| gateway", "none", "3", "4", "40", "7", "5", "0"]
    assert row[13] == f"{f['ttft_p50_ratio']:.3f}" and row[14] == "0.0%"
    assert row[15] == f"{100 * f['later']['hit_rate']:.1f}%"
    assert "| gateway | none | 3 | 40+4x7 | 5 |" in text


def test_checks_catch_planted_defects(fake_gateway):
    import copy
    fake, bench = fake_gateway
    w = small()
    m = bench.run(w, wl.conversations_for(w, 1000), 60.0)
    ok = {"name": w.name, "workload": w.to_json(), "metrics": m,
          "bandwidth": {"bytes_per_step": 1, "achieved_gbs": None, "vs_copy": None, "vs_chain": None}}
    assert checks.check_result(ok) == []
    for path, value, words in ((("multiturn", "later", "hit_rate"), 0.5, "hit_rate"),
                               (("multiturn", "turn_1", "prompt_tokens"), 1, "prompt tokens sent"),
                               (("multiturn", "ttft_p50_ratio"), 9.0, "ttft_p50_ratio"),
                               (("prefills",), 3, "prefills 3 != requests 12"),
                               (("completion_tokens",), 15, "completion_tokens 15 != requests x max_tokens 60")):
        bad = copy.deepcopy(ok)
        target = bad["metrics"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        assert any(words in p for p in checks.check_result(bad)), (path, checks.check_result(bad))


def test_single_request_passes_send_other_prompts_each(fake_gateway):
    """With a prefix cache, a timed pass must not find the warm-up's prompts cached: the warm-up and every later
    pass send the workload's prompts rotated; the first timed pass sends them as they are (the other paths')."""
    fake, bench = fake_gateway
    bench.repeats = 2
    w = wl.Workload("gateway", "none", 2, 48, 4)
    prompts = wl.prompts_for(w, 1000)
    m = bench.run(w, prompts, 60.0)
    sent = [list(r.prompt_token_ids) for r, _, _ in fake.requests]
    assert len(sent) == 6 and sorted(sent[2:4]) == sorted(prompts)
    assert [c for _, _, c in fake.requests] == [0] * 6          # no pass found an earlier one's prompts
    assert not ({tuple(p[:BLOCK]) for p in sent[:2]} | {tuple(p[:BLOCK]) for p in sent[4:]}) \
        & {tuple(p[:BLOCK]) for p in prompts}
    assert "multiturn" not in m and m["completion_tokens"] == 8


def test_workloads_of_one_stack_send_other_prompts(fake_gateway):
    """The long preset's alone run of a 16k prompt and its interference run send prompts of one generator (and c1's
    prompt is c16's first): on one stack, no workload may find another's prompts cached."""
    fake, bench = fake_gateway
    crowd, alone = wl.Workload("gateway", "none", 2, 48, 4), wl.Workload("gateway", "none", 1, 48, 4)
    bench.run(crowd, wl.prompts_for(crowd, 1000), 60.0)
    before = len(fake.requests)
    bench.run(alone, wl.prompts_for(alone, 1000), 60.0)
    firsts = [{tuple(r.prompt_token_ids[:BLOCK]) for r, _, _ in fake.requests[a:b]}
              for a, b in ((0, before), (before, len(fake.requests)))]
    assert wl.prompts_for(alone, 1000)[0] == wl.prompts_for(crowd, 1000)[0]
    assert not firsts[0] & firsts[1] and [c for _, _, c in fake.requests] == [0] * len(fake.requests)


def test_no_prefix_caching_reaches_the_verifier(monkeypatch):
    from specdec.demo import demo_model_dir
    from specdec_tools.bench import gateway_path
    started = fake_stacks(monkeypatch)
    w = presets.multiturn()[1]
    for cache in (True, False):
        v = replace(w, prefix_cache=cache)
        bench = gateway_path.GatewayBench(str(demo_model_dir()), "cpu", "float32")
        bench.ensure(v, [v])
        args = list(started[-1].verifier_args)
        assert ("--no-prefix-caching" in args) != cache
        assert args[args.index("--draft-policy") + 1] == "fixed"   # (a GPU verifier's default is adaptive)
        assert int(args[args.index("--max-context") + 1]) >= 4096 + 8 * 200 + 7 * 128 + 128
        bench.stack = None
        bench.logs.cleanup()
    assert replace(w, prefix_cache=False).stack_key != w.stack_key
    assert replace(w, prefix_cache=False).drafter_label == "mtp@3.39+nocache"


def test_a_usage_without_cached_tokens_leaves_the_hit_rate_open(fake_gateway):
    """Against a gateway whose Usage has no cached_tokens yet, the pass still runs and checks out, its hit rates
    are None (the table prints -), and the TTFT split is there."""
    fake, bench = fake_gateway
    fake.with_cached_tokens = False
    w = small(turns=2)
    m = bench.run(w, wl.conversations_for(w, 1000), 60.0)
    f = m["multiturn"]
    assert f["all"]["cached_tokens"] is None and f["later"]["hit_rate"] is None
    assert f["ttft_p50_ratio"] is not None and f["later"]["requests"] == 3
    result = {"name": w.name, "workload": w.to_json(), "metrics": m,
              "bandwidth": {"bytes_per_step": 1, "achieved_gbs": None, "vs_copy": None, "vs_chain": None}}
    assert checks.check_result(result) == []
    row, = report.multiturn_rows([result])
    assert row[14:17] == ["-", "-", "-"] and row[4] == "40"


@pytest.mark.parametrize("shared", [True, False])
def test_a_pass_with_own_system_prompts(fake_gateway, shared):
    """Each conversation's turn 1 sends its own system prompt: with conversation 1's already in the cache, only
    conversation 1 finds it (with one shared prompt, all do); the conversation table says `own`."""
    fake, bench = fake_gateway
    w = small(shared_system=shared)
    convs = wl.conversations_for(w, 1000)
    fake.finished.append(list(convs.system[1]) + [0] * 4)        # conversation 1's system prompt, served before
    m = bench.run(w, convs, 60.0)
    timed = {r.request_id: (list(r.prompt_token_ids), cached) for r, _, cached in fake.requests[w.requests:]}
    assert [timed[f"bench-c{c}-t1"][0] for c in range(3)] == [list(convs.system[c]) + list(convs.user[c][0])
                                                             for c in range(3)]
    hits = [timed[f"bench-c{c}-t1"][1] > 0 for c in range(3)]
    assert hits == ([True] * 3 if shared else [False, True, False])
    result = {"name": w.name, "workload": w.to_json(), "metrics": m,
              "bandwidth": {"bytes_per_step": 1, "achieved_gbs": None, "vs_copy": None, "vs_chain": None}}
    assert [p for p in checks.check_result(result) if "step_ms.host" not in p] == []   # (the fake's host time: ~0)
    row, = report.multiturn_rows([result])
    assert row[4] == ("40" if shared else "own 40")
