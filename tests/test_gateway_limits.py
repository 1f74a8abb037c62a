"""The gateway's input hardening and limits (issue 34, defects 4, 5, 6, 8), against real gateways (gRPC and HTTP,
in this process, on real sockets) in front of a fake verifier that records what it is asked: lone surrogates are
refused naming the field, a request head has a deadline and connections a cap, the Bearer scheme is read in any
case, and max_tokens has a server default and a limit. The fake verifier makes the forwarded max_tokens exact and
the tests fast; the verifier itself is not under test here."""
import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from fake_verifier import CONTEXT, FakeVerifier, Loop, serve

from gateway.chat_template import ChatTemplate
from gateway.generator import DEFAULT_MAX_TOKENS_DEFAULT, MaxTokens
from gateway.http_api.config import HttpConfig
from gateway.server import GatewayConfig, start
from gateway.tokenizer import TextTokenizer
from specdec_tools.commands import gateway_cmd
from specdec.demo import demo_model_dir
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2

pytestmark = pytest.mark.timeout(120)
LIMIT = 2000                                     # the keyed gateway's --max-tokens-limit
API_KEY = "limits-" + "0123456789abcdef" * 2
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def loop():
    loop = Loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def verifier(loop):
    fake = FakeVerifier()
    server, port = loop.run(serve(fake))
    yield fake, f"127.0.0.1:{port}"
    loop.run(server.stop(0))


@pytest.fixture(scope="module")
def text():
    tokenizer = TextTokenizer.from_folder(demo_model_dir())
    return tokenizer, ChatTemplate.from_folder(demo_model_dir(), tokenizer.special_tokens_map)


@pytest.fixture(scope="module")
def start_gateway(loop, verifier, text):
    """start_gateway(http=HttpConfig(...), **GatewayConfig fields) -> (gRPC address, HTTP base URL), serving."""
    started = []

    def start_gateway(http: HttpConfig, **fields):
        config = GatewayConfig(str(demo_model_dir()), verifier[1], port=0, http=http, **fields)
        running = loop.run(start(config, *text))
        started.append(running)
        address, url = f"127.0.0.1:{running.grpc_server.port}", f"http://127.0.0.1:{running.http.port}"
        deadline = time.monotonic() + 30
        while http_call(url + "/health")[0] != 200:
            assert time.monotonic() < deadline, "the gateway did not turn SERVING"
            time.sleep(0.05)
        return address, url
    yield start_gateway
    for running in started:
        loop.run(running.stop())


@pytest.fixture(scope="module")
def keyed(start_gateway):
    """A gateway with an API key, the default --max-tokens-default and --max-tokens-limit 2000."""
    return start_gateway(HttpConfig(0, api_key=API_KEY), api_key=API_KEY, max_tokens=MaxTokens(limit=LIMIT))


@pytest.fixture(scope="module")
def stub(keyed):
    with grpc.insecure_channel(keyed[0]) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def http_call(url: str, payload: dict | None = None, headers: dict | None = None):
    """(status, Content-Type, parsed JSON or text) of a GET, or of a POST of `payload` (as JSON: json.dumps writes
    a lone surrogate as its escape, \\ud800); (None, None, None) when nothing answers."""
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            status, kind, body = answer.status, answer.headers.get("content-type"), answer.read()
    except urllib.error.HTTPError as e:
        status, kind, body = e.code, e.headers.get("content-type"), e.read()
    except OSError:
        return None, None, None
    return status, kind, json.loads(body) if kind == "application/json" else body.decode(errors="replace")


def grpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


# ---- (4) lone UTF-16 surrogates --------------------------------------------------------------------------------
LONE = "x\ud800y"
SURROGATE_CASES = [
    ("/v1/completions", {"prompt": LONE}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": [LONE]}, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "ok", "stop": ["\udfff"]}, "stop", "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages", "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": [
        {"type": "text", "text": "fine"}, {"type": "text", "text": LONE}]}]}, "messages", "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": LONE, "content": "x"}]}, "messages", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": LONE}]}, "messages",
     "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": LONE}}]}]}, "messages", "messages[0].tool_calls[0].function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"flag": LONE}}, "chat_template_kwargs",
     "chat_template_kwargs.flag"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": LONE}, "stop", "stop[0]"),
]


@pytest.mark.parametrize("path,body,param,where", SURROGATE_CASES, ids=[c[3] + c[0][3:] for c in SURROGATE_CASES])
def test_a_lone_surrogate_is_a_400_naming_the_field(keyed, verifier, path, body, param, where):
    """JSON can escape a lone surrogate (\\ud800), which the tokenizer cannot encode (it raised TypeError: a
    plain-text 500 with a traceback). json.dumps writes it as that escape."""
    sent = len(verifier[0].requests)
    status, kind, answer = http_call(keyed[1] + path, body | {"max_tokens": 4}, AUTH)
    assert (status, kind) == (400, "application/json"), (status, answer)
    error = answer["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{where}: not valid Unicode text") and "surrogate" in error["message"]
    assert len(verifier[0].requests) == sent                         # refused before the verifier saw anything


def test_surrogate_pairs_and_odd_models_are_fine(keyed):
    """A pair of escapes is one character (valid); a lone surrogate where no text is read still gets JSON."""
    status, _, answer = http_call(keyed[1] + "/v1/chat/completions", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "smile \ud83d\ude00"}]}, AUTH)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    status, kind, answer = http_call(keyed[1] + "/v1/completions", {"model": LONE, "prompt": "x"}, AUTH)
    assert (status, kind, answer["error"]["param"]) == (404, "application/json", "model")


@pytest.mark.parametrize("field,raw", [("prompt", b"\x12\x03x\xed\xa0\x80"),                   # U+D800 as UTF-8
                                       ("messages[0].content", b"\x2a\x0b\x0a\x04user\x12\x03\xed\xbf\xbf"),
                                       ("sampling.stop[0]", b"\x12\x01x\x22\x05\x32\x03\xed\xa0\x80")])
def test_grpc_cannot_carry_a_lone_surrogate_and_bad_utf8_is_invalid_argument(keyed, field, raw):
    """protobuf strings are UTF-8: a client cannot send a lone surrogate (its encoding is no UTF-8); the bytes
    one would give are refused as INVALID_ARGUMENT naming the field, never INTERNAL."""
    with pytest.raises(UnicodeEncodeError):
        gateway_pb2.GenerateRequest(prompt=LONE).SerializeToString()
    with grpc.insecure_channel(keyed[0]) as channel:
        generate = channel.unary_stream("/specdec.rpc.v1.Gateway/Generate", request_serializer=lambda b: b,
                                        response_deserializer=gateway_pb2.GenerateResponse.FromString)
        metadata = (("authorization", AUTH["Authorization"]),)
        error = grpc_error(lambda: list(generate(raw, timeout=30, metadata=metadata)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(f"{field}: not valid UTF-8")


# ---- (6) the Bearer scheme in any case -------------------------------------------------------------------------
ACCEPTED = [f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER {API_KEY}", f"bEaReR {API_KEY}", f"Bearer   {API_KEY}"]
REFUSED = [f"Bearer {API_KEY.upper()}", f"Bearer {API_KEY}x", f"Bearer{API_KEY}", f"Basic {API_KEY}", API_KEY,
           "Bearer", f"Bearers {API_KEY}"]                             # (gRPC clients refuse a tab in metadata)


def test_the_bearer_scheme_is_case_insensitive_over_http(keyed):
    for value in ACCEPTED:
        status, _, answer = http_call(keyed[1] + "/v1/models", headers={"Authorization": value})
        assert status == 200 and answer["data"][0]["id"] == "fake", (value, answer)
    for value in REFUSED + [f"Bearer\t{API_KEY}", None]:               # 1*SP: a space, not a tab
        status, _, answer = http_call(keyed[1] + "/v1/models", headers={"Authorization": value} if value else {})
        assert status == 401 and answer["error"]["type"] == "authentication_error", (value, answer)


def test_the_bearer_scheme_is_case_insensitive_over_grpc(stub):
    for value in ACCEPTED:
        assert stub.Info(gateway_pb2.InfoRequest(), timeout=10, metadata=(("authorization", value),)).model == "fake"
    for value in REFUSED:
        error = grpc_error(lambda: stub.Info(gateway_pb2.InfoRequest(), timeout=10,
                                             metadata=(("authorization", value),)))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, value


# ---- (8) max_tokens: the server's default and limit --------------------------------------------------------------
def forwarded(verifier) -> verifier_pb2.TokenRequest:
    return verifier[0].requests[-1]


def test_a_request_without_max_tokens_gets_the_server_default(keyed, stub, verifier):
    """Chat without max_tokens ran to the end of the context (4090 tokens on the demo model); gRPC with it unset
    got 256. Both now get --max-tokens-default (1024), or what the context leaves when that is less."""
    assert DEFAULT_MAX_TOKENS_DEFAULT == gateway_cmd.DEFAULT_MAX_TOKENS_DEFAULT == 1024
    chat = {"messages": [{"role": "user", "content": "Sort a list."}]}
    assert http_call(keyed[1] + "/v1/chat/completions", chat, AUTH)[0] == 200
    assert forwarded(verifier).sampling.max_tokens == 1024
    long = {"messages": [{"role": "user", "content": " x" * 2500}]}
    assert http_call(keyed[1] + "/v1/chat/completions", long, AUTH)[0] == 200
    request = forwarded(verifier)
    assert 2500 < len(request.prompt_token_ids)
    assert request.sampling.max_tokens == CONTEXT - len(request.prompt_token_ids)      # what the context leaves
    assert http_call(keyed[1] + "/v1/completions", {"prompt": "def f():"}, AUTH)[0] == 200
    assert forwarded(verifier).sampling.max_tokens == 16                  # OpenAI's completions default, unchanged
    metadata = (("authorization", AUTH["Authorization"]),)
    list(stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3]), timeout=30, metadata=metadata))
    assert forwarded(verifier).sampling.max_tokens == 1024
    sampling = gateway_pb2.SamplingParams(max_tokens=50)
    list(stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling), timeout=30,
                       metadata=metadata))
    assert forwarded(verifier).sampling.max_tokens == 50                  # what a request asks for, it gets


def test_max_tokens_over_the_limit_is_refused_naming_it(keyed, stub, verifier):
    sent = len(verifier[0].requests)
    cases = [("/v1/completions", {"prompt": "x", "max_tokens": LIMIT + 1}, "max_tokens"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": LIMIT + 1},
              "max_tokens"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "max_completion_tokens": LIMIT + 1}, "max_completion_tokens")]
    for path, body, param in cases:
        status, _, answer = http_call(keyed[1] + path, body, AUTH)
        assert status == 400 and answer["error"]["param"] == param, answer
        assert f"limit of {LIMIT}" in answer["error"]["message"] and answer["error"]["code"] is None
    sampling = gateway_pb2.SamplingParams(max_tokens=LIMIT + 1)
    error = grpc_error(lambda: list(stub.Generate(gateway_pb2.GenerateRequest(prompt_token_ids=[1], sampling=sampling),
                                                  timeout=30, metadata=(("authorization", AUTH["Authorization"]),))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("max_tokens") and str(LIMIT) in error.details()
    assert len(verifier[0].requests) == sent
    assert http_call(keyed[1] + "/v1/completions", {"prompt": "x", "max_tokens": LIMIT}, AUTH)[0] == 200
    assert forwarded(verifier).sampling.max_tokens == LIMIT


def test_the_limit_caps_the_default(start_gateway, verifier):
    _, url = start_gateway(HttpConfig(0), max_tokens=MaxTokens(default=1024, limit=100))
    assert http_call(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})[0] == 200
    assert forwarded(verifier).sampling.max_tokens == 100
    _, url = start_gateway(HttpConfig(0), max_tokens=MaxTokens(default=8))
    assert http_call(url + "/v1/completions", {"prompt": "x"})[0] == 200
    assert forwarded(verifier).sampling.max_tokens == 8                   # below OpenAI's 16 when the server says so


# ---- (5) connection bounds: request head deadline, idle keep-alive, open connections -----------------------------
def closed_after(sock: socket.socket, since: float, trickle: bytes = b"", every: float = 0.2,
                 give_up: float = 15.0) -> float | None:
    """Seconds from `since` (time.monotonic()) until the server closes `sock` (reads, sending `trickle` every
    `every` s meanwhile); None if it did not within `give_up`. Whatever the server sends (a response) is ignored."""
    start = since
    sock.settimeout(every)
    while time.monotonic() - start < give_up:
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except socket.timeout:
            pass
        except ConnectionError:
            return time.monotonic() - start
        if trickle:
            try:
                sock.sendall(trickle)
            except ConnectionError:
                return time.monotonic() - start
    return None


def read_response(sock: socket.socket) -> bytes:
    """One HTTP response with a Content-Length, read off a kept-alive connection."""
    sock.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head


HEALTH = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


def test_a_request_head_must_arrive_within_the_header_timeout(start_gateway):
    """1 s for the headers, counted from the connection's start (or the next request's first byte); a slowloris
    client sending a header line every 0.2 s was never closed. Normal requests go on meanwhile."""
    _, url = start_gateway(HttpConfig(0, header_timeout_s=1.0, keep_alive_timeout_s=30.0))
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow, socket.create_connection(("127.0.0.1", port)) as mute:
        opened = time.monotonic()
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        assert http_call(url + "/health")[0] == 200                       # others are served meanwhile
        elapsed = closed_after(slow, opened, trickle=b"X-Slow: 1\r\n")
        assert elapsed is not None and 0.9 <= elapsed <= 5.0, elapsed    # 1 s after it opened
        elapsed = closed_after(mute, opened)                              # a connection that sends nothing at all
        assert elapsed is not None and 0.9 <= elapsed <= 5.0, elapsed
    with socket.create_connection(("127.0.0.1", port)) as kept:
        kept.sendall(HEALTH)
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)                                                   # idle: kept alive (30 s), not a head yet
        began = time.monotonic()
        kept.sendall(b"GET /health HTTP/1.1\r\n")                         # the next request begins, and stalls
        elapsed = closed_after(kept, began, trickle=b"X-Slow: 1\r\n")
        assert elapsed is not None and 0.9 <= elapsed <= 5.0, elapsed    # 1 s after its first byte
    assert http_call(url + "/health")[0] == 200


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(start_gateway):
    _, url = start_gateway(HttpConfig(0, header_timeout_s=30.0, keep_alive_timeout_s=2.0))
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as kept:
        kept.sendall(HEALTH)
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        elapsed = closed_after(kept, time.monotonic())
    assert elapsed is not None and 1.0 <= elapsed <= 4.5, elapsed        # 2 s, not uvicorn's default 5 s


def test_connections_beyond_the_limit_get_503_and_are_closed(start_gateway):
    """4 connections open (kept alive after a request each): a fifth is answered 503 at once and closed; once one
    of the four goes, new connections are served again."""
    _, url = start_gateway(HttpConfig(0, header_timeout_s=30.0, keep_alive_timeout_s=30.0, max_connections=4))
    port = int(url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(HEALTH)
            assert read_response(sock).startswith(b"HTTP/1.1 200")       # each one counted by the server
        with socket.create_connection(("127.0.0.1", port)) as extra:
            extra.settimeout(10)
            answer = b""
            while chunk := extra.recv(65536):                             # until the server closes it
                answer += chunk
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head
        error = json.loads(body)["error"]
        assert error["type"] == "service_unavailable_error" and "--http-max-connections" in error["message"]
        held.pop().close()
        deadline = time.monotonic() + 10
        while http_call(url + "/health")[0] != 200:                       # the server notices the close
            assert time.monotonic() < deadline, "a freed connection slot was not reused"
            time.sleep(0.05)
    finally:
        for sock in held:
            sock.close()


def test_bad_limit_flags_are_one_line_errors(capsys):
    from specdec_tools.cli import main
    for flags in (["--max-tokens-default", "0"], ["--max-tokens-limit", "-1"], ["--http-header-timeout", "0"],
                  ["--http-max-connections", "0"]):
        assert main(["gateway", "--port", "0", *flags]) == 2
        err = capsys.readouterr().err
        assert flags[0] in err and "Traceback" not in err
