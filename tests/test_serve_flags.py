"""`specdec serve` starts a protected stack (issue 34, defect 7): the gateway's TLS, API key, metrics and limits
flags reach the gateway it starts, and the verifier's metrics port reaches the verifier."""
import json
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
from reliability_stack import SERVING, Serve, answers_health, generate, health, tiny_with_tokenizer, wait_for
from test_security import API_KEY, certs, credentials  # noqa: F401 (certs: a fixture)

from specdec_tools.local_stack import free_port
from specdec.rpc.v1 import gateway_pb2_grpc

pytestmark = pytest.mark.timeout(300)


def get(url: str, context=None) -> str:
    with urllib.request.urlopen(url, timeout=10, context=context) as reply:
        return reply.read().decode()


def test_serve_passes_security_metrics_and_limits_on(tmp_path, certs):
    model = tiny_with_tokenizer(tmp_path / "model")
    http, metrics, verifier_metrics = free_port(), free_port(), free_port()
    serve = Serve(model, tmp_path, "--drafter", "ngram", "--http-port", str(http),
                  "--tls-cert", str(certs["server.crt"]), "--tls-key", str(certs["server.key"]),
                  "--api-key-file", str(certs["api.key"]), "--metrics-port", str(metrics),
                  "--verifier-metrics-port", str(verifier_metrics), "--max-tokens-limit", "8")
    try:
        tls_health = credentials(certs)   # a TLS gateway counts as up once its port opens: wait for SERVING here
        wait_for(lambda: answers_health(serve.address, tls_health) and health(serve.address, credentials=tls_health)
                 == SERVING, 30, "the TLS gateway serving")
        with grpc.secure_channel(serve.address, credentials(certs)) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                generate(stub, [5, 6, 7], 4, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ids, _ = generate(stub, [5, 6, 7], 4, timeout=60, metadata=(("authorization", f"bearer {API_KEY}"),))
            assert len(ids) == 4
            with pytest.raises(grpc.RpcError) as too_many:
                generate(stub, [5, 6, 7], 9, timeout=30, metadata=(("authorization", f"Bearer {API_KEY}"),))
            assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "8" in too_many.value.details()

        tls = ssl.create_default_context(cafile=str(certs["ca"]))
        request = urllib.request.Request(f"https://127.0.0.1:{http}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "ab", "max_tokens": 2}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as unauthorised:
            urllib.request.urlopen(request, timeout=30, context=tls)
        assert unauthorised.value.code == 401
        request.add_header("Authorization", f"Bearer {API_KEY}")
        assert json.loads(urllib.request.urlopen(request, timeout=60, context=tls).read())["usage"][
            "completion_tokens"] == 2

        wait_for(lambda: "specdec_gateway_requests" in get(f"http://127.0.0.1:{metrics}/metrics"), 30, "gateway metrics")
        assert "specdec_verify_steps" in get(f"http://127.0.0.1:{verifier_metrics}/metrics")
        assert "Traceback" not in serve.text()
    finally:
        serve.stop()


def test_serve_places_the_drafter_and_picks_the_all_reduce(tmp_path):
    """--drafter-device reaches the drafter service as its --device, --all-reduce the ranks' verifier; the
    services' --device takes cuda:N and says what is wrong with anything else."""
    from specdec_tools.cli import build_parser
    from specdec_tools.commands.serve_cmd import stack_config
    model = str(tiny_with_tokenizer(tmp_path / "model"))
    args = build_parser().parse_args(["serve", "--model", model, "--drafter", "ngram", "--drafter-device", "cuda:1",
                                      "-tp", "2", "--all-reduce", "nccl"])
    config = stack_config(args, 0)
    assert config.drafter_args[-2:] == ("--device", "cuda:1")
    verifier = " ".join(config.verifier_args)
    assert "--tensor-parallel-size 2 --all-reduce nccl" in verifier
    assert build_parser().parse_args(["drafter", "--device", "cuda:3"]).device == "cuda:3"
    for wrong in ("gpu", "cuda:x", "cuda:"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["drafter", "--device", wrong])
    args = build_parser().parse_args(["serve", "--model", model, "--drafter", "ngram", "--drafter-device", "cuda:1",
                                      "--in-process-drafter"])
    with pytest.raises(ValueError, match="--drafter-device places the drafter service"):
        stack_config(args, 0)
    assert build_parser().parse_args(["serve", "--drafter-device", "cuda:01"]).drafter_device == "cuda:1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--drafter-device", "gpu1"])
