"""Prometheus metrics of the gateway (served on --metrics-port), named after vLLM's where vLLM has one.

Both APIs (gRPC and HTTP) count here, per request: its outcome (``specdec_gateway_requests_total{api, code}``,
code = the gRPC status name, which every HTTP status maps from), its latencies as the client sees them (time to
the first token, between token-carrying messages (one message may carry several tokens, as a verify step emits
them), end to end), its tokens in and out (and of the prompt, those the verifier's prefix cache served), how
long it queued in the verifier, and its speculation (drafts proposed and accepted, acceptance rate and length per
request).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

# vLLM's buckets for the same histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 11.0, 17.0)


class GatewayMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdec_gateway_requests", "Generate requests by API (grpc | http) and outcome "
                                "(gRPC status code name: OK, INVALID_ARGUMENT, ...)", ["api", "code"], registry=r)
        self.finished = Counter("specdec_request_success", "Requests that ended with a finish reason",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "From the request's arrival at the gateway to "
                              "its first token leaving it", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "Between successive token-carrying messages of "
                             "one request (a message may carry several tokens)", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "From arrival to the last message",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("specdec_request_queue_time_seconds", "Time in the verifier's queue before the "
                               "request's first step", buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("specdec_prompt_tokens_cached", "Prompt tokens of finished requests served "
                                     "from the verifier's prefix cache", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Tokens sent to clients", registry=r)
        self.draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.verify_steps = Counter("specdec_spec_decode_num_drafts", "Verify steps (decode steps)", registry=r)
        self.acceptance_rate = Histogram("specdec_request_acceptance_rate", "Per request: accepted / drafted "
                                         "tokens", buckets=RATE_BUCKETS, registry=r)
        self.acceptance_length = Histogram("specdec_request_acceptance_length", "Per request: tokens emitted per "
                                           "verify step, bonus included", buckets=LENGTH_BUCKETS, registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on host:port (a thread of its own); the port bound (for 0: any free one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def refused(self, api: str, code_name: str) -> None:
        """A request that never reached the verifier (bad input, wrong key, too large, not ready ...)."""
        self.requests.labels(api=api, code=code_name).inc()

    def start(self, api: str) -> "RequestRecord":
        return RequestRecord(self, api)


class RequestRecord:
    """One request's timings and figures; it ends once, as finished, failed or cancelled."""

    def __init__(self, metrics: GatewayMetrics, api: str):
        self.metrics, self.api = metrics, api
        self.arrived = time.perf_counter()
        self.last_sent: float | None = None
        self.ended = False

    def sent(self, num_tokens: int) -> None:
        """A message carrying `num_tokens` tokens left for the client."""
        if not num_tokens:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.last_sent is None:
            m.ttft.observe(now - self.arrived)
        else:
            m.itl.observe(now - self.last_sent)
        self.last_sent = now
        m.generation_tokens.inc(num_tokens)

    def finished(self, reason: str, usage) -> None:
        """The last message went out with `reason` and `usage` (a gateway_pb2.Usage)."""
        if self._end("OK"):
            m = self.metrics
            m.finished.labels(finished_reason=reason).inc()
            m.e2e.observe(time.perf_counter() - self.arrived)
            m.queue.observe(usage.queue_seconds)
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.cached_tokens.inc(usage.cached_tokens)
            m.draft_tokens.inc(usage.draft_tokens)
            m.accepted_tokens.inc(usage.accepted_tokens)
            m.verify_steps.inc(usage.verify_steps)
            if usage.draft_tokens:
                m.acceptance_rate.observe(usage.accepted_tokens / usage.draft_tokens)
            if usage.verify_steps:
                m.acceptance_length.observe(1 + usage.accepted_tokens / usage.verify_steps)

    def failed(self, code_name: str) -> None:
        self._end(code_name)

    def _end(self, code_name: str) -> bool:
        if self.ended:
            return False
        self.ended = True
        self.metrics.requests.labels(api=self.api, code=code_name).inc()
        return True
