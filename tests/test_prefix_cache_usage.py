"""The prefix cache's figures on their way out (issue 39, item 3): a request's cached prompt tokens in the
verifier's usage, through the gateway to gRPC usage, OpenAI's `usage.prompt_tokens_details.cached_tokens` (chat
and completions, streamed and not) and the gateway's `specdec_prompt_tokens_cached`; the verifier's
`specdec_prefix_cache_queries` / `_hits` counters and Stats from the scheduler's cumulative token counts. A fake
engine and a fake verifier (real sockets) stand in for the model: the cache itself is not under test here."""
import asyncio
import time
import urllib.request
from types import SimpleNamespace

import grpc
import openai
import pytest
from fake_verifier import FakeVerifier, Loop, serve
from prometheus_client.parser import text_string_to_metric_families
from reliability_stack import http_status

from gateway.chat_template import ChatTemplate
from gateway.http_api.config import HttpConfig
from gateway.server import GatewayConfig, start
from gateway.tokenizer import TextTokenizer
from specdec.demo import demo_model_dir
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2
from verifier_service.acceptance_stats import AcceptanceStats
from verifier_service.requests import RequestOutput
from verifier_service.metrics import VerifierMetrics
from verifier_service.servicer import VerifierServicer, usage_of

pytestmark = pytest.mark.timeout(120)
CACHED = 48                                    # prompt tokens the fake verifier reports as served from the cache


class CachingVerifier(FakeVerifier):
    """The fake verifier, its one-token answer's usage saying CACHED prompt tokens came from the prefix cache."""

    async def Generate(self, request, context):
        self.requests.append(request)
        yield verifier_pb2.TokenResponse(token_ids=[65], finish_reason="length", usage=gateway_pb2.Usage(
            prompt_tokens=len(request.prompt_token_ids), completion_tokens=1, cached_tokens=CACHED))


def fake_engine(queried: int, hit: int) -> SimpleNamespace:
    """What VerifierMetrics.observe and VerifierServicer.Stats read of a SpecEngine, with these prefix counts."""
    pool = SimpleNamespace(size=8, num_free=8, num_registered=0)
    return SimpleNamespace(
        stats=AcceptanceStats(), policy=SimpleNamespace(chosen=[], num_left=0), last_step_seconds={}, fallback_steps=0,
        drafter=None, executor=SimpleNamespace(blocks=SimpleNamespace(kv_blocks=pool, gdn_slots=pool, checkpoints=[])),
        scheduler=SimpleNamespace(waiting=[], running=[], num_preemptions=0,
                                  prefix_stats=SimpleNamespace(queried_tokens=queried, hit_tokens=hit)))


def test_the_verifiers_usage_carries_the_cached_tokens():
    output = RequestOutput("r", [1], "length", AcceptanceStats(), num_prompt=100, cached_tokens=64)
    assert usage_of(output, 1).cached_tokens == 64
    assert usage_of(RequestOutput("r", [1], None, AcceptanceStats(), num_prompt=100), 1).cached_tokens == 0


def test_the_verifiers_counters_move_by_the_schedulers_deltas():
    metrics = VerifierMetrics()
    value = metrics.registry.get_sample_value
    for queried, hit in ((0, 0), (100, 64), (100, 64), (250, 64), (300, 112)):
        metrics.observe(fake_engine(queried, hit), [], 0.0)
        assert (value("specdec_prefix_cache_queries_total"), value("specdec_prefix_cache_hits_total")) \
            == (queried, hit)


def test_the_verifiers_stats_report_the_prefix_cache_counts():
    loop = SimpleNamespace(engine=fake_engine(300, 112), in_flight=0, error=None)
    stats = asyncio.run(VerifierServicer(loop, gateway_pb2.InfoResponse()).Stats(verifier_pb2.StatsRequest(), None))
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (300, 112)


@pytest.fixture(scope="module")
def gateway():
    """(gRPC address, HTTP base URL, metrics port, the CachingVerifier) of a gateway in front of a CachingVerifier."""
    loop = Loop()
    verifier = CachingVerifier()
    server, port = loop.run(serve(verifier))
    tokenizer = TextTokenizer.from_folder(demo_model_dir())
    template = ChatTemplate.from_folder(demo_model_dir(), tokenizer.special_tokens_map)
    config = GatewayConfig(str(demo_model_dir()), f"127.0.0.1:{port}", port=0, http=HttpConfig(0), metrics_port=0)
    running = loop.run(start(config, tokenizer, template))
    url = f"http://127.0.0.1:{running.http.port}"
    deadline = time.monotonic() + 30
    while http_status(url + "/health") != 200:
        assert time.monotonic() < deadline, "the gateway did not turn SERVING"
        time.sleep(0.05)
    yield f"127.0.0.1:{running.grpc_server.port}", url + "/v1", running.metrics_port, verifier
    loop.run(running.stop())
    loop.run(server.stop(0))
    loop.close()


def cached_counter(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "specdec_prompt_tokens_cached_total")


def test_cached_tokens_reach_both_apis_and_the_gateways_counter(gateway):
    address, base_url, metrics_port, _ = gateway
    before = cached_counter(metrics_port)
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30)
    chat = dict(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    usages = [client.completions.create(model="fake", prompt="import os", max_tokens=4).usage,
              client.chat.completions.create(**chat).usage]
    for stream in (client.completions.create(model="fake", prompt="import os", max_tokens=4, stream=True,
                                             stream_options={"include_usage": True}),
                   client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})):
        chunks = list(stream)
        assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices
        usages.append(chunks[-1].usage)
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [CACHED] * 4
    with grpc.insecure_channel(address) as channel:
        replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            prompt="import os", sampling=gateway_pb2.SamplingParams(max_tokens=4)), timeout=30))
    assert replies[-1].usage.cached_tokens == CACHED
    assert cached_counter(metrics_port) - before == 5 * CACHED


def test_a_cache_salt_reaches_the_verifier_from_both_apis(gateway):
    """vLLM's `cache_salt` (HTTP body, chat and completions) and SamplingParams.cache_salt (gRPC) reach the
    verifier's request; a request without one sends none; a bad one is refused naming the field."""
    address, base_url, _, verifier = gateway
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=30)
    sent = len(verifier.requests)
    client.completions.create(model="fake", prompt="import os", max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   extra_body={"cache_salt": "tenant-b"})
    client.completions.create(model="fake", prompt="import os", max_tokens=2)
    with grpc.insecure_channel(address) as channel:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            prompt="import os", sampling=gateway_pb2.SamplingParams(max_tokens=2, cache_salt="tenant-c")), timeout=30))
    got = [r.sampling.cache_salt if r.sampling.HasField("cache_salt") else None for r in verifier.requests[sent:]]
    assert got == ["tenant-a", "tenant-b", None, "tenant-c"]
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model="fake", prompt="import os", max_tokens=2, extra_body={"cache_salt": ""})
