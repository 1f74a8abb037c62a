"""Property-based bad input against the gateway's Generate (issue 13, bad input): every malformed request gets
INVALID_ARGUMENT (RESOURCE_EXHAUSTED for sizes) with a message naming the field, and the services keep serving
correct output meanwhile and afterwards, with nothing leaked. Requests travel as raw bytes, so fields no
well-behaved client could send (invalid UTF-8 in string fields) are covered too."""
import math
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_stack import assert_no_leak, generate, references, start_stack, tiny_with_tokenizer

from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(600)
VOCAB, CONTEXT = 400, 256
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
PROMPT = [5, 17, 3, 99, 42]
EXAMPLES = {"run": 0}

valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16)
not_finite = st.sampled_from([math.nan, math.inf, -math.inf])
negative = st.floats(max_value=-2**-10, width=32)  # bounds exact in float32
above_one = st.floats(min_value=1 + 2**-10, width=32, allow_infinity=False)
invalid_utf8 = st.binary(min_size=1, max_size=24).filter(lambda b: not _is_utf8(b))


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_the_token_ids_check_names_the_first_bad_id():
    """The validator's fast path (all ints, in range) must not let a bool, a float or an id out of range through,
    and its slow path names the first bad one."""
    from gateway.validation import InvalidRequest, _token_ids
    assert _token_ids("ids", (3, 0, VOCAB - 1), VOCAB) == [3, 0, VOCAB - 1]
    for ids, bad in (([3, True], "ids[1] = True"), ([3, 2.0, 1], "ids[1] = 2.0"), ([3, 1, -1], "ids[2] = -1"),
                     ([VOCAB, 1], f"ids[0] = {VOCAB}")):
        with pytest.raises(InvalidRequest, match=bad.replace("[", r"\[").replace("]", r"\]")):
            _token_ids("ids", ids, VOCAB)


def _request(ids=PROMPT, **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt_token_ids=ids,
                                       sampling=gateway_pb2.SamplingParams(**({"max_tokens": 4} | sampling)))


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (number < 16, payload < 128 bytes)."""
    assert number < 16 and len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def case(message, code, field):
    raw = message if isinstance(message, bytes) else message.SerializeToString()
    return raw, code, field


def sampling_case(name: str, values, code=INVALID):
    return values.map(lambda v: case(_request(**{name: v}), code, name))


def with_bad_id(ids: list[int], bad: int, where: int):
    ids = list(ids)
    ids.insert(where % (len(ids) + 1), bad)
    return case(_request(ids), INVALID, "prompt_token_ids")


BAD_REQUESTS = st.one_of(
    st.just(case(gateway_pb2.GenerateRequest(), INVALID, "prompt")),                       # empty prompt
    valid_ids.map(lambda ids: case(gateway_pb2.GenerateRequest(prompt="x", prompt_token_ids=ids), INVALID, "prompt")),
    st.builds(with_bad_id, valid_ids, st.one_of(st.integers(-2**31, -1), st.integers(VOCAB, 2**31 - 1)),
              st.integers(0, 16)),                                                           # ids out of vocabulary
    st.integers(CONTEXT, CONTEXT + 64).map(lambda n: case(_request([1] * n, max_tokens=1), EXHAUSTED, "prompt")),
    st.just(case(_request(max_tokens=0), INVALID, "max_tokens")),
    st.integers(CONTEXT, 2**32 - 1).map(lambda n: case(_request(max_tokens=n), EXHAUSTED, "max_tokens")),
    sampling_case("temperature", st.one_of(negative, not_finite)),
    sampling_case("top_p", st.one_of(st.just(0.0), negative, above_one, not_finite)),
    sampling_case("top_k", st.integers(-2**31, -1)),
    sampling_case("min_p", st.one_of(negative, above_one, not_finite)),
    sampling_case("repetition_penalty", st.one_of(st.just(0.0), negative, not_finite)),
    sampling_case("presence_penalty", st.one_of(st.floats(min_value=2 + 2**-8, width=32), st.floats(max_value=-2 - 2**-8,
                                                                                                 width=32), not_finite)),
    sampling_case("frequency_penalty", st.one_of(st.floats(min_value=2 + 2**-8, width=32), not_finite)),
    sampling_case("logprobs", st.integers(21, 2**32 - 1)),
    sampling_case("seed", st.integers(2**63, 2**64 - 1)),
    sampling_case("stop_token_ids", st.lists(st.integers(VOCAB, 2**31 - 1), min_size=1, max_size=3)),
    sampling_case("stop", st.just([""])),
    sampling_case("stop", st.lists(st.just("ab"), min_size=17, max_size=24)),
    sampling_case("stop", st.text(min_size=257, max_size=300).map(lambda s: [s])),
    invalid_utf8.map(lambda b: case(_request().SerializeToString() + _field(4, _field(6, b)), INVALID,
                                    "sampling.stop[0]")),
    invalid_utf8.map(lambda b: case(gateway_pb2.GenerateRequest(sampling=gateway_pb2.SamplingParams(max_tokens=4))
                                    .SerializeToString() + _field(2, b), INVALID, "prompt")),
    invalid_utf8.map(lambda b: case(_request().SerializeToString() + _field(1, b), INVALID, "request_id")),
    st.text(min_size=129, max_size=400).map(lambda s: case(gateway_pb2.GenerateRequest(
        request_id=s, prompt_token_ids=PROMPT), INVALID, "request_id")),
    st.just(case(gateway_pb2.GenerateRequest(request_id="a\nb", prompt_token_ids=PROMPT), INVALID, "request_id")),
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    stack = start_stack(model_dir, tmp_path_factory.mktemp("logs"), "ngram", ("--max-context", str(CONTEXT)))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def raw_generate(channel):
    return channel.unary_stream("/specdec.rpc.v1.Gateway/Generate", request_serializer=lambda b: b,
                                response_deserializer=gateway_pb2.GenerateResponse.FromString)


@pytest.fixture(scope="module")
def expected(model_dir):
    return references(model_dir, [PROMPT], 100)[0]


def test_bad_requests_are_refused_naming_the_field(stack, channel, raw_generate, expected):
    stub = gateway_pb2_grpc.GatewayStub(channel)
    background = {}
    worker = threading.Thread(target=lambda: background.update(out=generate(stub, PROMPT, 100)[0]))
    worker.start()  # a correct request runs while the bad ones arrive

    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(BAD_REQUESTS)
    def refused(bad):
        raw, code, field = bad
        EXAMPLES["run"] += 1
        with pytest.raises(grpc.RpcError) as error:
            list(raw_generate(raw, timeout=30))
        assert error.value.code() == code, (error.value.code(), error.value.details())
        assert field in error.value.details(), error.value.details()
    refused()
    worker.join(120)
    print(f"hypothesis: {EXAMPLES['run']} bad requests refused")
    assert EXAMPLES["run"] >= 300
    assert background["out"] == expected
    assert generate(stub, PROMPT, 100)[0] == expected
    assert_no_leak(stack)


def test_request_over_the_size_limit(raw_generate, channel, expected):
    big = gateway_pb2.GenerateRequest(prompt="x" * (5 << 20)).SerializeToString()
    with pytest.raises(grpc.RpcError) as error:
        list(raw_generate(big, timeout=30))
    assert error.value.code() == EXHAUSTED and "larger than max" in error.value.details()
    assert generate(gateway_pb2_grpc.GatewayStub(channel), PROMPT, 100)[0] == expected


def test_stop_strings_without_a_tokenizer_are_refused(tiny_dir, tmp_path):
    stack = start_stack(str(tiny_dir), tmp_path, "none")
    try:
        with grpc.insecure_channel(stack.address) as channel:
            request = _request()
            request.sampling.stop.append("x")
            with pytest.raises(grpc.RpcError) as error:
                list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=30))
        assert error.value.code() == INVALID and "stop" in error.value.details()
    finally:
        stack.stop()
