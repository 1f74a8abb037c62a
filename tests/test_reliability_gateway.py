"""Reliability of the serving path (issue 13, defects 1, 4, 5, 6): duplicate ids, streams beyond the old
thread pool, the bounded queue, stop strings that cut token counts, an engine that dies, a gateway whose
verifier has not answered yet."""
import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2
from reliability_stack import (SERVING, answers_health, assert_no_leak, generate, greedy_request, health,
                               references, spawn_gateway, start_stack, stop, tiny_with_tokenizer, verifier_stats,
                               wait_for)

from gateway.completion import CompletionStream
from gateway.tokenizer import TextTokenizer
from specdec_tools.local_stack import free_port
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.timeout(300)
PROMPT = [64, 8, 100, 3, 7, 7, 1, 250]
MAX_RUNNING, MAX_QUEUED = 4, 40     # 44 streams open at once: more than the 32 threads of the old servers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def expected(model_dir):
    return references(model_dir, [PROMPT], 40)[0]


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    stack = start_stack(model_dir, tmp_path_factory.mktemp("logs"), "ngram",
                        ("--max-running", str(MAX_RUNNING), "--max-queued", str(MAX_QUEUED)))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def test_stop_string_cuts_token_ids_and_usage(model_dir, expected):
    tokenizer = TextTokenizer.from_folder(model_dir)
    texts = [tokenizer.decode(PROMPT + expected[:i]) for i in range(len(expected) + 1)]
    cut = next(i for i in range(8, len(expected)) if len(texts[i]) > len(texts[i - 1]) + 1)  # a token with text
    stop = texts[cut][-2:]
    assert stop not in texts[cut - 1], "pick a stop string completed by token `cut`"
    stream = CompletionStream(tokenizer, PROMPT, (stop,))
    sent, text, stopped = [], "", False
    for i in range(0, len(expected), 4):  # 4 tokens per verifier message, as with k = 3
        tokens, delta, stopped = stream.step(expected[i:i + 4], i + 4 >= len(expected))
        sent += tokens
        text += delta
        if stopped:
            break
    assert stopped and sent == expected[:cut]  # the token completing the stop string is the last one sent
    assert stream.completion_tokens == cut and stop not in text


def test_duplicate_request_id_is_refused_and_the_first_stream_completes(stub, expected):
    first = stub.Generate(greedy_request(PROMPT, 40, request_id="dup"), timeout=120)
    replies = [next(first)]  # the first call is streaming
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(greedy_request(PROMPT, 5, request_id="dup"), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in error.value.details()
    replies += list(first)
    last = replies[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 40 and last.request_id == "dup"
    assert [t for r in replies for t in r.token_ids] == expected
    assert generate(stub, PROMPT, 3, request_id="dup")[1][-1].finish_reason == "length"  # free again


def test_stop_string_end_to_end_counts_tokens_up_to_the_stop(stub, model_dir, expected):
    tokenizer = TextTokenizer.from_folder(model_dir)
    full = tokenizer.decode(PROMPT + expected)[len(tokenizer.decode(PROMPT).rstrip("\ufffd")):]
    stop = next(c for c in full[len(full) // 2:] if c.isascii() and c.isalnum())  # plain text, no U+FFFD
    request = greedy_request(PROMPT, 40)
    request.sampling.stop.append(stop)
    replies = list(stub.Generate(request, timeout=60))
    tokens = [t for r in replies for t in r.token_ids]
    assert replies[-1].finish_reason == "stop" and replies[-1].usage.completion_tokens == len(tokens) < 40
    assert tokens == expected[:len(tokens)]
    tail = lambda ids: tokenizer.decode(PROMPT + ids)[len(tokenizer.decode(PROMPT).rstrip("\ufffd")):]  # noqa: E731
    assert stop in tail(tokens) and stop not in tail(tokens[:-1])


def all_admitted(stack, calls) -> bool:
    """Every call is in the verifier's bound; fails at once when one of them ended (refused, or finished)."""
    ended = [call for call in calls if call.done()]
    assert not ended, (f"{len(ended)} of {len(calls)} streams ended before all were admitted, the first with "
                       f"{ended[0].code().name}: {ended[0].details()}")
    return verifier_stats(stack).in_flight == len(calls)


def test_44_open_streams_health_info_and_the_queue_bound(stack, stub):
    # A stream the gateway ended on a stop string leaves the verifier's bound a few ms after its client has its last
    # message (the cancel travels gateway -> verifier -> engine thread): start from an empty bound, or the 44th
    # stream below can be refused as the 45th.
    wait_for(lambda: verifier_stats(stack).in_flight == 0, 60, "the earlier tests' requests freed")
    calls = [stub.Generate(greedy_request(PROMPT, 3000)) for _ in range(MAX_RUNNING + MAX_QUEUED)]
    try:
        wait_for(lambda: all_admitted(stack, calls), 60, "all streams admitted")
        verifier = f"127.0.0.1:{stack.ports['verifier']}"
        with grpc.insecure_channel(verifier) as channel:
            verifier_stub = verifier_pb2_grpc.VerifierStub(channel)
            for probe in (lambda: health(stack.address), lambda: health(verifier),
                          lambda: stub.Info(gateway_pb2.InfoRequest(), timeout=1.0),
                          lambda: verifier_stub.Info(gateway_pb2.InfoRequest(), timeout=1.0),
                          lambda: verifier_stub.Abort(verifier_pb2.AbortRequest(request_id="none"), timeout=1.0)):
                probe()  # each answers within its 1 s deadline while 44 streams are open
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(greedy_request(PROMPT, 4), timeout=30))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued" in error.value.details()
    finally:
        for call in calls:
            call.cancel()
    wait_for(lambda: verifier_stats(stack).in_flight == 0, 60, "cancelled streams freed")
    assert_no_leak(stack)


def test_gateway_before_its_verifier_answers_says_unavailable(tmp_path, model_dir):
    port = free_port()
    gateway = spawn_gateway(f"127.0.0.1:{free_port()}", port, tmp_path / "gateway.log", "--model", model_dir)
    try:
        address = f"127.0.0.1:{port}"
        wait_for(lambda: answers_health(address), 60, "gateway up")
        assert health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for call in (lambda: list(stub.Generate(greedy_request(PROMPT, 4), timeout=10)),
                         lambda: stub.Info(gateway_pb2.InfoRequest(), timeout=10)):
                with pytest.raises(grpc.RpcError) as error:
                    call()
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "verifier" in error.value.details()
    finally:
        stop(gateway)


def test_dead_engine_fails_requests_with_internal_and_health_goes_not_serving(tiny_dir, tiny_model):
    """The real verifier server and servicer in this process, over an engine whose step breaks."""
    from engine_factory import make_engine

    from verifier_service.builder import VerifierConfig
    from verifier_service.server import start
    engine = make_engine(tiny_model)
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 4:
            raise KeyError("planted engine bug")
        return real_step()
    engine.step = step
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, engine_loop = asyncio.run_coroutine_threadsafe(
        start(engine, VerifierConfig(model_dir=str(tiny_dir)), "127.0.0.1", 0), loop).result(60)
    address = f"127.0.0.1:{server.port}"
    try:
        assert health(address) == SERVING
        with grpc.insecure_channel(address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            request = verifier_pb2.TokenRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                                sampling=gateway_pb2.SamplingParams(max_tokens=50, ignore_eos=True))
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(request, timeout=60))
            assert error.value.code() == grpc.StatusCode.INTERNAL and "KeyError" in error.value.details()
            wait_for(lambda: health(address) == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(request, timeout=60))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not stub.Stats(verifier_pb2.StatsRequest(), timeout=5).engine_alive
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        engine_loop.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_generate_against_a_dead_address_is_one_line(capsys):
    from specdec_tools.cli import main
    assert main(["generate", "--address", f"127.0.0.1:{free_port()}", "hello"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
