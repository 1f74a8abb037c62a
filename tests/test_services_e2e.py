"""The three services as real processes on 127.0.0.1, driven by real gRPC clients (docs/architecture.md)."""
import threading
import time

import grpc
import pytest
from engine_factory import make_engine

from specdec_tools.local_stack import LocalStack, StackConfig
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 17, 3, 99, 42], [64, 8, 100, 3, 7, 7, 1, 250], [12], [300, 301, 302, 5, 17, 3]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from specdec_tools.tiny import make_tiny
    return str(make_tiny(tmp_path_factory.mktemp("svc"), overrides={"vocab_size": 400}, tokenizer=True,
                         progress=False))


SEEDED = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.3)


@pytest.fixture(scope="module")
def expected(model_dir):
    from specdec.models.loader import load_model
    engine = make_engine(load_model(model_dir), num_blocks=512)
    return engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))


@pytest.fixture(scope="module")
def expected_seeded(model_dir):
    """Seeded sampling, plain decoding in-process: every stack, with or without a drafter, must stream these."""
    from specdec.models.loader import load_model
    engine = make_engine(load_model(model_dir), num_blocks=512)
    return engine.generate(PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=40 + i, **SEEDED)
                                     for i in range(len(PROMPTS))])


def start_stack(model_dir, tmp_path, drafter, transport="auto"):
    stack = LocalStack(StackConfig(model=model_dir, drafter=drafter, num_drafts=3, port=0, transport=transport,
                                   log_dir=str(tmp_path), startup_timeout_s=120))
    stack.start()
    return stack


def generate(stub, ids, max_tokens=MAX_TOKENS, **sampling):
    request = gateway_pb2.GenerateRequest(prompt_token_ids=ids, sampling=gateway_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, **sampling))
    replies = list(stub.Generate(request, timeout=120))
    return [t for r in replies for t in r.token_ids], replies


@pytest.mark.parametrize("drafter,transport", [("mtp", "shm"), ("mtp", "inline"), ("ngram", "inline"),
                                               ("none", "auto")])
def test_gateway_output_equals_plain_decoding(model_dir, expected, expected_seeded, tmp_path, drafter, transport):
    stack = start_stack(model_dir, tmp_path, drafter, transport)
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            info = stub.Info(gateway_pb2.InfoRequest(), timeout=10)
            assert info.drafter_kind == drafter and info.has_tokenizer
            for ids, want in zip(PROMPTS, expected):
                got, replies = generate(stub, ids)
                assert got == want
                usage = replies[-1].usage
                assert replies[-1].finish_reason == "length" and all(r.finish_reason == "" for r in replies[:-1])
                assert usage.completion_tokens == len(got) == MAX_TOKENS
                assert usage.prompt_tokens == len(ids)
                assert usage.accepted_tokens <= usage.draft_tokens
                assert usage.completion_tokens == 1 + usage.verify_steps + usage.accepted_tokens
                if drafter == "mtp":
                    assert usage.draft_tokens > 0
            text = "".join(r.text for r in generate(stub, PROMPTS[1])[1])
            assert text  # tokens came with their text
            for i, (ids, want) in enumerate(zip(PROMPTS, expected_seeded)):  # seeded: same stream, any drafter
                got, replies = generate(stub, ids, seed=40 + i, logprobs=2, **SEEDED)
                assert got == want
                logprobs = [lp for r in replies for lp in r.logprobs]
                assert [lp.token_id for lp in logprobs] == got
                assert all(1 <= len(lp.top_token_ids) <= 2 and lp.logprob <= lp.top_logprobs[0] + 1e-6 for lp in logprobs)
        log = (tmp_path / "verifier.log").read_text()
        if drafter != "none":
            assert f"transport {transport if drafter == 'mtp' else 'none'}" in log.replace("auto", "shm")
    finally:
        stack.stop()


def verifier_stats(stack):
    from specdec.rpc.v1 import verifier_pb2, verifier_pb2_grpc
    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['verifier']}") as channel:
        return verifier_pb2_grpc.VerifierStub(channel).Stats(verifier_pb2.StatsRequest(), timeout=10)


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def long_expected(model_dir):
    from specdec.models.loader import load_model
    engine = make_engine(load_model(model_dir), num_blocks=1024)
    return engine.generate(PROMPTS, SamplingParams(max_tokens=160, ignore_eos=True))


def test_drafter_killed_mid_generation_then_swapped(model_dir, long_expected, tmp_path):
    import subprocess
    import sys
    stack = start_stack(model_dir, tmp_path, "mtp", "shm")
    try:
        results, errors = {}, []
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            def run(i):
                try:
                    results[i] = generate(stub, PROMPTS[i], max_tokens=160)[0]
                except grpc.RpcError as e:
                    errors.append(e)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            wait_for(lambda: verifier_stats(stack).verify_steps >= 8)  # streams are under way, with drafts
            stack.procs["drafter"].kill()
            for t in threads:
                t.join(120)
            assert not errors
            assert [results[i] for i in range(4)] == long_expected  # all complete, output unchanged
            stats = verifier_stats(stack)
            assert not stats.drafter_connected and stats.drafter_fallbacks > 0

            # Another kind on the same address: the verifier re-handshakes, no restart.
            log = open(tmp_path / "drafter2.log", "w")
            stack.procs["drafter"] = subprocess.Popen(
                [sys.executable, "-m", "specdec", "drafter", "--kind", "ngram", "--device", "cpu",
                 "--port", str(stack.ports["drafter"])], stdout=log, stderr=subprocess.STDOUT)
            wait_for(lambda: verifier_stats(stack).drafter_kind == "ngram" and verifier_stats(stack).drafter_connected)
            assert stub.Info(gateway_pb2.InfoRequest(), timeout=10).drafter_kind == "ngram"
            repetitive = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
            _, replies = generate(stub, repetitive, max_tokens=40)
            assert replies[-1].usage.draft_tokens > 0  # it drafts again
    finally:
        stack.stop()


def test_cancelled_client_frees_its_slots(model_dir, tmp_path):
    stack = start_stack(model_dir, tmp_path, "mtp", "inline")
    try:
        total = verifier_stats(stack)
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            call = stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=PROMPTS[1], sampling=gateway_pb2.SamplingParams(
                max_tokens=3000, ignore_eos=True)))
            next(call)
            busy = verifier_stats(stack)
            assert busy.free_gdn_slots == total.total_gdn_slots - 1 and busy.free_kv_blocks < total.total_kv_blocks
            call.cancel()
        wait_for(lambda: verifier_stats(stack).free_gdn_slots == total.total_gdn_slots)
        after = verifier_stats(stack)
        assert after.free_kv_blocks + after.prefix_cache_checkpoints == after.total_kv_blocks and after.running == 0
        assert "aborted; its KV blocks and GDN slot are free" in (tmp_path / "verifier.log").read_text()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def plain_stack(model_dir, tmp_path_factory):
    stack = start_stack(model_dir, tmp_path_factory.mktemp("plain"), "none")
    yield stack
    stack.stop()


def test_reflection_client_without_stubs(plain_stack, expected):
    """A generic client discovers the API through server reflection and calls Generate with no generated code."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    with grpc.insecure_channel(plain_stack.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"specdec.rpc.v1.Gateway", "grpc.health.v1.Health"} <= services
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName("specdec.rpc.v1.Gateway").FindMethodByName("Generate")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = request_cls(prompt_token_ids=PROMPTS[0])
        request.sampling.max_tokens, request.sampling.ignore_eos = MAX_TOKENS, True
        call = channel.unary_stream("/specdec.rpc.v1.Gateway/Generate", request_serializer=request_cls.SerializeToString,
                                    response_deserializer=response_cls.FromString)
        tokens = [t for reply in call(request, timeout=60) for t in reply.token_ids]
    assert tokens == expected[0]


@pytest.mark.parametrize("request_fields,code,message", [
    (dict(prompt_token_ids=[1, 2, 400]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt="x", prompt_token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(prompt_token_ids=[1], sampling=gateway_pb2.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt_token_ids=[1] * 10, sampling=gateway_pb2.SamplingParams(max_tokens=100000)),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "max"),
])
def test_bad_requests_get_clear_status(plain_stack, request_fields, code, message):
    with grpc.insecure_channel(plain_stack.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(gateway_pb2.GenerateRequest(**request_fields), timeout=30))
    assert error.value.code() == code and message in error.value.details()


def test_stop_strings_and_text(plain_stack, model_dir, expected):
    from gateway.tokenizer import TextTokenizer
    tokenizer = TextTokenizer.from_folder(model_dir)
    prompt_text = tokenizer.decode(PROMPTS[1]).rstrip("\ufffd")  # text after the prompt's complete characters
    full = tokenizer.decode(PROMPTS[1] + expected[1])[len(prompt_text):]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    with grpc.insecure_channel(plain_stack.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        replies = list(stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=PROMPTS[1], sampling=gateway_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])), timeout=60))
    text = "".join(r.text for r in replies)
    assert replies[-1].finish_reason == "stop" and text == full[: full.index(stop)]


def test_gateway_process_has_no_torch(plain_stack):
    maps = open(f"/proc/{plain_stack.procs['gateway'].pid}/maps").read()
    assert "libtorch" not in maps
    assert "libtorch" in open(f"/proc/{plain_stack.procs['verifier'].pid}/maps").read()  # the check can fail


def test_model_without_tokenizer_serves_token_ids_and_metrics(tiny_dir, tmp_path):
    import urllib.request

    from specdec_tools.local_stack import free_port
    metrics_port = free_port()
    stack = LocalStack(StackConfig(model=str(tiny_dir), drafter="ngram", port=0, log_dir=str(tmp_path),
                                   verifier_args=("--metrics-port", str(metrics_port)), startup_timeout_s=120))
    stack.start()
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            assert not stub.Info(gateway_pb2.InfoRequest(), timeout=10).has_tokenizer
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(gateway_pb2.GenerateRequest(prompt="def f():"), timeout=30))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no tokenizer" in error.value.details()
            tokens, replies = generate(stub, [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=12)
            assert len(tokens) == 12 and all(r.text == "" for r in replies)
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        for name in ("specdec_mean_acceptance_length", "specdec_acceptance_rate", "specdec_step_seconds_bucket",
                     "specdec_waiting_requests", "specdec_kv_blocks_used", "specdec_gdn_slots_used",
                     "specdec_drafter_fallbacks", "specdec_draft_tokens_total"):
            assert name in body
        assert 'phase="drafter"' in body and 'phase="target"' in body
    finally:
        stack.stop()


def test_hung_drafter_times_out_and_comes_back(model_dir, long_expected, tmp_path):
    """A drafter that stops answering (SIGSTOP) costs one timeout; requests finish unchanged without drafts,
    and once it answers again the verifier reconnects and drafts."""
    import os
    import signal
    stack = LocalStack(StackConfig(model=model_dir, drafter="mtp", port=0, log_dir=str(tmp_path),
                                   verifier_args=("--drafter-timeout", "1"), startup_timeout_s=120))
    stack.start()
    drafter = stack.procs["drafter"]
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            result = {}
            worker = threading.Thread(target=lambda: result.update(tokens=generate(stub, PROMPTS[0], 160)[0]))
            worker.start()
            wait_for(lambda: verifier_stats(stack).verify_steps >= 5)
            os.kill(drafter.pid, signal.SIGSTOP)
            worker.join(120)
            assert result["tokens"] == long_expected[0]
            assert verifier_stats(stack).drafter_fallbacks > 0
            assert "timed out" in (tmp_path / "verifier.log").read_text()
            os.kill(drafter.pid, signal.SIGCONT)
            wait_for(lambda: verifier_stats(stack).drafter_connected)
            assert generate(stub, PROMPTS[1])[1][-1].usage.draft_tokens > 0
    finally:
        os.kill(drafter.pid, signal.SIGCONT)
        stack.stop()
