"""Gateway metrics (issue 14): a gateway with --metrics-port and --http-port in front of a real verifier; after a
few requests over both APIs (finished, refused, cancelled) the Prometheus endpoint shows every histogram and
counter moved by exactly what those requests did."""
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from reliability_stack import http_status, spawn_gateway, stop, wait_for

from specdec.demo import DEMO_DIR
from specdec_tools.local_stack import LocalStack, StackConfig, free_port
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(300)
PROMPT = "import os\n"
PER_FINISHED = ("specdec_e2e_request_latency_seconds", "specdec_request_queue_time_seconds",
                "specdec_request_acceptance_length", "specdec_request_acceptance_rate")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    logs = tmp_path_factory.mktemp("metrics")
    stack = LocalStack(StackConfig(model=str(DEMO_DIR), drafter="mtp", port=0, log_dir=str(logs),
                                   verifier_args=("--max-running", "1"), startup_timeout_s=180))   # one at a time
    stack.start()
    ports = {name: free_port() for name in ("grpc", "http", "metrics")}
    proc = spawn_gateway(f"127.0.0.1:{stack.ports['verifier']}", ports["grpc"], logs / "gateway.log",
                         "--http-port", str(ports["http"]), "--metrics-port", str(ports["metrics"]))
    try:
        wait_for(lambda: http_status(f"http://127.0.0.1:{ports['http']}/health") == 200, 60, "the gateway serving")
        yield ports
    finally:
        stop(proc)
        stack.stop()


def scrape(port: int) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_move_with_the_requests(gateway):
    before = scrape(gateway["metrics"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway['http']}/v1", api_key="none", max_retries=0,
                           timeout=120)
    usages = [client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=16, temperature=0).usage]
    chunks = list(client.chat.completions.create(model="demo_model", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=16, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    with grpc.insecure_channel(f"127.0.0.1:{gateway['grpc']}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        replies = list(stub.Generate(gateway_pb2.GenerateRequest(
            prompt=PROMPT, sampling=gateway_pb2.SamplingParams(max_tokens=16)), timeout=120))
        usages.append(replies[-1].usage)
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=gateway_pb2.SamplingParams(
                top_p=0.0)), timeout=30))
    for bad in (dict(temperature=-1.0), dict(model="nope")):
        with pytest.raises(openai.APIStatusError):
            client.completions.create(**({"model": "demo_model", "prompt": PROMPT, "max_tokens": 4} | bad))
    stream = client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=2000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()                                                   # the client goes away: CANCELLED
    wait_for(lambda: delta(scrape(gateway["metrics"]), before, "specdec_gateway_requests_total",
                           api="http", code="CANCELLED") == 1, 30, "the cancelled request counted")
    after = scrape(gateway["metrics"])

    def moved(name, **labels):
        return delta(after, before, name, **labels)
    assert moved("specdec_gateway_requests_total", api="http", code="OK") == 2
    assert moved("specdec_gateway_requests_total", api="grpc", code="OK") == 1
    assert moved("specdec_gateway_requests_total", api="grpc", code="INVALID_ARGUMENT") == 1
    assert moved("specdec_gateway_requests_total", api="http", code="INVALID_ARGUMENT") == 1
    assert moved("specdec_gateway_requests_total", api="http", code="NOT_FOUND") == 1
    assert moved("specdec_request_success_total", finished_reason="length") == 3
    for name in PER_FINISHED:      # one observation per finished request
        assert moved(name + "_count") == moved(name + "_bucket", le="+Inf") == 3, name
    assert moved("specdec_request_acceptance_length_sum") >= 3 and moved("specdec_e2e_request_latency_seconds_sum") > 0
    assert moved("specdec_time_to_first_token_seconds_count") == 4         # the cancelled one had its first token
    assert moved("specdec_time_to_first_token_seconds_sum") > 0
    assert moved("specdec_inter_token_latency_seconds_count") >= 3 * 2     # several messages per request
    assert moved("specdec_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("specdec_generation_tokens_total") >= 3 * 16               # + what the cancelled one got
    drafted = sum(_spec(u)["draft_tokens"] for u in usages)
    assert moved("specdec_spec_decode_num_draft_tokens_total") == drafted > 0
    assert moved("specdec_spec_decode_num_accepted_tokens_total") == sum(_spec(u)["accepted_tokens"] for u in usages)
    assert moved("specdec_spec_decode_num_drafts_total") == sum(_spec(u)["verify_steps"] for u in usages)


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _spec(usage) -> dict:
    """The speculative figures of an OpenAI usage (model_extra) or a gRPC Usage, alike."""
    if isinstance(usage, gateway_pb2.Usage):
        return {"draft_tokens": usage.draft_tokens, "accepted_tokens": usage.accepted_tokens,
                "verify_steps": usage.verify_steps}
    return json.loads(json.dumps(usage.model_extra["spec_decode"]))


def test_queue_time_is_the_wait_for_the_running_request(gateway):
    """With one request at a time in the verifier, of two sent together the second waits for the whole first:
    its reported queue time is longer than the first's (which was admitted at once)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway['http']}/v1", api_key="none", max_retries=0,
                           timeout=120)

    def queued(_) -> float:
        usage = client.completions.create(model="demo_model", prompt=PROMPT, max_tokens=64, temperature=0,
                                          extra_body={"ignore_eos": True}).usage
        return usage.model_extra["spec_decode"]["queue_seconds"]
    with ThreadPoolExecutor(2) as pool:
        first, second = sorted(pool.map(queued, range(2)))
    assert 0 <= first < second
