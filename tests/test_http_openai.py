"""The OpenAI-compatible HTTP API (issue 14) against a real stack on the demo model (three processes, CPU), driven
by the official `openai` client: completions and chat, streamed and not, logprobs, stop strings, seeds, one
error per status code, and client disconnects that free the verifier's slots. The same requests over gRPC give
the same tokens: both APIs run one code path."""
import json
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from reliability_stack import assert_no_leak, spawn_gateway, stop, verifier_stats, wait_for

from gateway.tokenizer import TextTokenizer
from specdec.demo import demo_model_dir
from specdec_tools.local_stack import LocalStack, StackConfig, free_port
from specdec.rpc.v1 import gateway_pb2

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parent.parent
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list of numbers."}]
API_KEY = "http-" + "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # two requests at a time in the verifier: a third one gets RESOURCE_EXHAUSTED (429) at once
    stack = LocalStack(StackConfig(model=str(demo_model_dir()), drafter="mtp", num_drafts=3, port=0, http_port=0,
                                   verifier_args=("--max-running", "2", "--max-queued", "0"),
                                   log_dir=str(tmp_path_factory.mktemp("http")), startup_timeout_s=180))
    stack.start()
    yield stack
    stack.stop()


def grpc_generate(stub, **request):
    sampling = request.pop("sampling")
    replies = list(stub.Generate(gateway_pb2.GenerateRequest(sampling=gateway_pb2.SamplingParams(**sampling),
                                                             **request), timeout=120))
    return "".join(r.text for r in replies), replies[-1]


def test_the_http_module_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import gateway.server, gateway.http_api.server\n"
            "assert sys.modules['torch'] is None and sys.modules['transformers'] is None")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_models_and_health(stack, client):
    assert [m.id for m in client.models.list()] == ["demo_model"]
    assert http(stack.http_url.removesuffix("/v1") + "/health") == (200, {"status": "serving"})


def test_completion_streamed_and_not_equals_grpc(client, stub):
    full = client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=16, temperature=0,
                                            stream=True))
    text, last = grpc_generate(stub, prompt=PROMPT, sampling=dict(max_tokens=16))
    assert full.choices[0].text == "".join(c.choices[0].text for c in chunks) == text and text
    assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    usage = full.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (last.usage.prompt_tokens, 16)
    assert usage.total_tokens == usage.prompt_tokens + 16
    spec = usage.model_extra["spec_decode"]
    assert spec["draft_tokens"] > 0 and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["verify_steps"])
    ids = TextTokenizer.from_folder(demo_model_dir()).encode(PROMPT)   # token ids as the prompt: the same
    assert client.completions.create(model="demo_model", prompt=ids, max_tokens=16, temperature=0).choices[0].text \
        == text


def test_chat_streamed_and_not_equals_grpc_messages(client, stub):
    full = client.chat.completions.create(model="demo_model", messages=CHAT, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model="demo_model", messages=CHAT, max_completion_tokens=20,
                                                 temperature=0, stream=True))
    text, last = grpc_generate(stub, messages=[gateway_pb2.ChatMessage(**m) for m in CHAT],
                               sampling=dict(max_tokens=20))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert full.choices[0].message.content == streamed == text and text
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == last.usage.prompt_tokens > 10   # the template's text, not just the words


def test_chat_without_max_tokens_stops_at_the_end_of_the_context(client):
    """No max_tokens: the gateway's --max-tokens-default (1024), or all the context leaves (4096 here) when that is
    less, as here; never a context_length_exceeded for a default (tests/test_gateway_limits.py has the rest)."""
    answer = client.chat.completions.create(model="demo_model", messages=[{"role": "user", "content": " x" * 4050}],
                                            temperature=0, extra_body={"ignore_eos": True})
    usage = answer.usage
    assert answer.choices[0].finish_reason == "length" and 4000 < usage.prompt_tokens < 4096
    assert usage.prompt_tokens + usage.completion_tokens == 4096


def test_logprobs(client):
    completion = client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=12, temperature=0,
                                           logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and len(top) <= 3
        assert logprob == pytest.approx(max(top.values()))        # greedy: the chosen token is the most likely
    chat = client.chat.completions.create(model="demo_model", messages=CHAT, max_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 10
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        alternatives = [a.logprob for a in t.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.bytes == list(t.token.encode())
    streamed = list(client.chat.completions.create(model="demo_model", messages=CHAT, max_tokens=10, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    assert [t.token for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content] == [t.token for t in content]


def test_stop_strings(client):
    text = client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[:text.index(stop)]
    for stream in (False, True):
        answer = client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=24, temperature=0,
                                           stop=[stop, "never-there"], stream=stream)
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_and_matches_grpc(client, stub):
    def sample(seed, stream=False):
        answer = client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=24, temperature=1.0,
                                           top_p=0.95, seed=seed, stream=stream, extra_body={"top_k": 50})
        return "".join(c.choices[0].text for c in (answer if stream else [answer]))
    first = sample(7)
    assert sample(7) == sample(7, stream=True) == first
    assert grpc_generate(stub, prompt=PROMPT, sampling=dict(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50,
                                                            seed=7))[0] == first
    assert len({sample(seed) for seed in (1, 2, 3)} | {first}) > 1    # the seed matters


def test_speculation_false_verifies_no_drafts_while_the_batch_beside_it_speculates(client, stub):
    """`speculation: false` (HTTP extra field, gRPC SamplingParams field) turns drafts off for that request only: its
    usage counts no drafts, the request running beside it at the same time drafts, and both texts are the same
    as with speculation (lossless)."""
    from concurrent.futures import ThreadPoolExecutor

    def http(speculation):
        extra = {} if speculation is None else {"speculation": speculation}
        answer = client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=40, temperature=0,
                                           extra_body={"ignore_eos": True, **extra})
        return answer.choices[0].text, answer.usage.model_extra["spec_decode"]["draft_tokens"]

    def rpc(speculation):
        sampling = dict(max_tokens=40, ignore_eos=True) | ({} if speculation is None else {"speculation": speculation})
        text, last = grpc_generate(stub, prompt=PROMPT, sampling=sampling)
        return text, last.usage.draft_tokens

    reference, drafted = http(None)
    assert drafted > 0
    for off, on in ((http, rpc), (rpc, http)):     # each API's request opted out while the other's speculates
        with ThreadPoolExecutor(2) as pool:
            quiet, busy = pool.submit(off, False), pool.submit(on, None)
            (quiet_text, quiet_drafts), (busy_text, busy_drafts) = quiet.result(), busy.result()
        assert quiet_drafts == 0 and busy_drafts > 0, (off.__name__, quiet_drafts, busy_drafts)
        assert quiet_text == busy_text == reference


def test_stream_options_include_usage(client):
    chunks = list(client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_400_names_the_field(client):
    cases = [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(n=2), "n"),
             (dict(extra_body={"temperature": "hot"}), "temperature"), (dict(logprobs=21), "logprobs"),
             (dict(extra_body={"echo": True}), "echo"), (dict(stop=[""]), "stop"),
             (dict(extra_body={"speculation": "no"}), "speculation")]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=4, **kwargs)
        assert error.value.status_code == 400 and error.value.body["param"] == field, (kwargs, error.value.body)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="demo_model", messages=[{"role": "robot", "content": "x"}], max_tokens=4)
    assert error.value.body["param"] == "messages" and "roles system, user, assistant and tool" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=5000)
    assert error.value.body["code"] == "context_length_exceeded"


def test_404_unknown_model_and_path(stack, client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert error.value.body["param"] == "model" and "demo_model" in error.value.message
    status, body = http(stack.http_url + "/embeddings", {"input": "x"})
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_413_request_body_over_the_limit(client):
    with pytest.raises(openai.APIStatusError) as error:
        client.completions.create(model="demo_model", prompt="x" * (4 << 20), max_tokens=4)
    assert error.value.status_code == 413 and "--max-request-bytes" in error.value.message


def test_429_when_the_verifier_is_full_and_disconnects_free_the_slots(stack, client):
    """With two requests in the verifier a third is refused at once; a client that goes away (streaming or not)
    has its request cancelled: the verifier's KV blocks and GDN slots are free again."""
    long = dict(model="demo_model", prompt=PROMPT, max_tokens=3000, temperature=0, extra_body={"ignore_eos": True})
    streams = [client.completions.create(stream=True, **long) for _ in range(2)]
    for stream in streams:
        next(iter(stream))                                  # both run
    with pytest.raises(openai.RateLimitError) as error:
        client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=4)
    assert error.value.status_code == 429 and "--max-queued" in error.value.message
    for stream in streams:
        stream.close()                                      # the clients go away mid-stream
    wait_for(lambda: verifier_stats(stack).in_flight == 0, 20, "the streamed requests cancelled")
    assert_no_leak(stack)
    # not streaming: the response is not there yet when the client leaves
    body = json.dumps(long | long.pop("extra_body")).encode()
    port = int(stack.http_url.split(":")[-1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: verifier_stats(stack).running == 1, 20, "the request running")
    wait_for(lambda: verifier_stats(stack).in_flight == 0, 20, "the unanswered request cancelled")
    assert_no_leak(stack)


def test_401_without_the_api_key_and_503_without_a_verifier(stack, tmp_path):
    """A gateway with TLS, client certificates and an API key: HTTPS, refused without a client certificate, 401
    without the key or with a wrong one. A gateway whose verifier is away: 503."""
    certs = make_certs(tmp_path)
    keyed_port, keyed_http = free_port(), free_port()
    dead_port, dead_http = free_port(), free_port()
    keyed = spawn_gateway(f"127.0.0.1:{stack.ports['verifier']}", keyed_port, tmp_path / "keyed.log",
                          "--http-port", str(keyed_http), "--tls-cert", str(certs["server.crt"]),
                          "--tls-key", str(certs["server.key"]), "--tls-client-ca", str(certs["ca"]),
                          env={"SPECDEC_API_KEY": API_KEY})
    dead = spawn_gateway(f"127.0.0.1:{free_port()}", dead_port, tmp_path / "dead.log", "--http-port", str(dead_http))
    try:
        keyed_url, dead_url = f"https://127.0.0.1:{keyed_http}", f"http://127.0.0.1:{dead_http}"
        tls = ssl.create_default_context(cafile=certs["ca"])
        tls.load_cert_chain(certs["client.crt"], certs["client.key"])
        wait_for(lambda: http(keyed_url + "/health", tls=tls)[0] == 200, 60, "keyed gateway serving")
        wait_for(lambda: http(dead_url + "/health")[0] == 503, 60, "gateway without a verifier up")
        no_client_cert = ssl.create_default_context(cafile=certs["ca"])
        assert http(keyed_url + "/health", tls=no_client_cert) == (None, None)     # the handshake fails
        status, body = http(keyed_url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, tls=tls)  # no key
        assert status == 401 and body["error"]["type"] == "authentication_error"
        for key, works in (("wrong-" + API_KEY, False), (API_KEY, True)):
            client = openai.OpenAI(base_url=keyed_url + "/v1", api_key=key, max_retries=0, timeout=60,
                                   http_client=openai.DefaultHttpxClient(verify=tls))
            if works:
                assert client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=4).usage \
                    .completion_tokens == 4
                continue
            with pytest.raises(openai.AuthenticationError) as error:
                client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=4)
            assert error.value.status_code == 401 and "API key" in error.value.message
        dead_client = openai.OpenAI(base_url=dead_url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as error:
            dead_client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=4)
        assert error.value.status_code == 503 and "verifier" in error.value.message
    finally:
        stop(keyed)
        stop(dead)


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in `folder`."""
    from cryptography.hazmat.primitives import serialization
    from test_security import issue, make_ca
    ca = make_ca("specdec HTTP test CA")
    files = {"ca": ca[1].public_bytes(serialization.Encoding.PEM)}
    files["server.key"], files["server.crt"] = issue(ca, "gateway", server=True)
    files["client.key"], files["client.crt"] = issue(ca, "client", server=False)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {name: folder / name for name in files}


def http(url: str, payload: dict | None = None, tls: ssl.SSLContext | None = None) -> tuple[int | None, dict | None]:
    """(status, JSON body) of a GET (or a POST of `payload`); (None, None) when nothing answers."""
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=tls) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return None, None
