"""Prometheus metrics of the verifier (served on --metrics-port)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .engine import SpecEngine
from .requests import RequestOutput


class VerifierMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.steps = Counter("specdec_verify_steps", "Target forwards", registry=r)
        self.drafted = Counter("specdec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.emitted = Counter("specdec_emitted_tokens", "Tokens emitted by verify steps", registry=r)
        self.accepted_at = Gauge("specdec_acceptance_rate", "Acceptance rate per draft position",
                                 ["position"], registry=r)
        self.mean_length = Gauge("specdec_mean_acceptance_length",
                                 "Tokens emitted per verify step, bonus included", registry=r)
        self.step_time = Histogram("specdec_step_seconds", "Host time per step phase", ["phase"], registry=r,
                                   buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0))
        self.queue_depth = Gauge("specdec_waiting_requests", "Requests waiting for admission", registry=r)
        self.running = Gauge("specdec_running_requests", "Requests in the running batch", registry=r)
        self.kv_used = Gauge("specdec_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.gdn_used = Gauge("specdec_gdn_slots_used", "GDN state slot groups in use", registry=r)
        self.fallbacks = Gauge("specdec_drafter_fallbacks", "Steps decoded without drafts (drafter away)", registry=r)
        self.engine_failures = Counter("specdec_engine_failures", "Times the engine loop stopped on an internal "
                                       "error (the verifier then reports NOT_SERVING)", registry=r)
        self.preemptions = Counter("specdec_preemptions", "Sequences preempted by recompute (their caches freed; "
                                   "they prefill prompt + output again): KV blocks ran out, or the drafter lost "
                                   "its hidden states", registry=r)
        self.draft_length = Counter("specdec_steps_by_draft_length", "Decode steps by the drafts per sequence the "
                                    "draft policy gave them (fixed: always k; steps with no sequence in the "
                                    "drafter are not counted)", ["k"], registry=r)
        self.left_drafter = Counter("specdec_sequences_left_drafter", "Sequences the adaptive draft policy gave "
                                    "up on: they decode without the drafter from then on", registry=r)
        self.prefix_queries = Counter("specdec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "at admissions", registry=r)
        self.prefix_hits = Counter("specdec_prefix_cache_hits", "Prompt tokens looked up in the prefix cache and "
                                   "served from it (their KV / GDN state not computed)", registry=r)
        self._seen = (0, 0, 0, 0)
        self._preempted = 0
        self._prefix = (0, 0)                  # (queried, hit) tokens at the last observe
        self._chosen: list[int] = []
        self._left = 0

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def observe(self, engine: SpecEngine, outputs: list[RequestOutput], seconds: float) -> None:
        s = engine.stats
        steps, drafted, accepted, emitted = s.verify_steps, s.drafted, s.accepted, s.emitted
        last = self._seen
        self.steps.inc(steps - last[0])
        self.drafted.inc(drafted - last[1])
        self.accepted.inc(accepted - last[2])
        self.emitted.inc(emitted - last[3])
        self._seen = (steps, drafted, accepted, emitted)
        for i, rate in enumerate(s.per_position_acceptance):
            self.accepted_at.labels(position=str(i)).set(rate)
        self.mean_length.set(s.mean_acceptance_length)
        chosen = engine.policy.chosen
        if len(self._chosen) != len(chosen):
            self._chosen = [0] * len(chosen)
        for k, (now, seen) in enumerate(zip(chosen, self._chosen)):
            if now > seen:
                self.draft_length.labels(k=str(k)).inc(now - seen)
        self._chosen = list(chosen)
        self.left_drafter.inc(max(0, engine.policy.num_left - self._left))
        self._left = engine.policy.num_left
        for phase, t in engine.last_step_seconds.items():
            self.step_time.labels(phase=phase).observe(t)
        blocks = engine.executor.blocks
        self.queue_depth.set(len(engine.scheduler.waiting))
        self.running.set(len(engine.scheduler.running))
        self.kv_used.set(blocks.kv_blocks.size - blocks.kv_blocks.num_free)
        self.gdn_used.set(blocks.gdn_slots.size - blocks.gdn_slots.num_free)
        self.fallbacks.set(engine.fallback_steps)
        preempted = engine.scheduler.num_preemptions
        self.preemptions.inc(preempted - self._preempted)
        self._preempted = preempted
        prefix = engine.scheduler.prefix_stats
        self.prefix_queries.inc(prefix.queried_tokens - self._prefix[0])
        self.prefix_hits.inc(prefix.hit_tokens - self._prefix[1])
        self._prefix = (prefix.queried_tokens, prefix.hit_tokens)
