"""One `specdec bench` run: checkpoint → roofline references → (profile) → every workload in order, each under
its time guard and within the run's time budget → JSON, table, PNG.

Resources are made when a workload first needs them and kept: the target for the in-process path, the peer's
transformers model, and one running stack per (drafter, forced length, k), stopped once no later workload
uses it. The JSON is rewritten after every workload, so a run that is cut off still leaves its results.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.models.loader import load_model, parse_dtype

from . import checks, report, roofline
from .checkpoint import describe, ensure_checkpoint
from .environment import device_info, device_tag, git_commit, peak_flops, versions
from .traffic import ModelTraffic, utilisation
from .workloads import Conversations, Workload, conversations_for, prompts_for

log = logging.getLogger(__name__)
SCHEMA = "specdec-bench/1"


@dataclass(frozen=True)
class BenchConfig:
    model: str
    device: str                          # cpu | cuda
    dtype: str
    preset: str
    workloads: tuple[Workload, ...]
    cut: tuple[str, ...] = ()            # what this preset leaves out of the full matrix
    out_dir: str = "bench/results"
    tag: str | None = None               # file-name suffix (default: the device, e.g. h100)
    make_tiny: str | None = None         # write the checkpoint with this make-tiny preset if missing
    layers: int | None = None
    workload_timeout_s: float = 600.0
    time_budget_s: float | None = None   # whole run; workloads that would not fit are skipped
    stack_start_estimate_s: float = 90.0
    profile: bool = False
    profile_steps: int = 10
    trace_steps_dir: str | None = None   # gateway path: the services' --trace-steps files go here
    step_channel: str = "auto"           # gateway path: the verifier's --step-channel
    repeats: int = 1                     # timed passes per workload (not the peer path), the median one reported
    overlap: bool = True                 # False: every engine reads a step's tokens before the next launch
    plot: bool = True
    seed: int = 0
    command: str = ""
    tensor_parallel_size: int = 1        # gateway path: the verifier's ranks
    load_format: str = "safetensors"     # dummy: random weights, config.json only (gateway path)
    quantization: str = "none"           # fp8: the target's linears in FP8 (not the peer path)
    grammar: tuple[str, str] | None = None  # gateway path: (kind, text) every request is constrained by
    draft_masks: str = "auto"            # gateway path: the mtp drafter service's --draft-masks
    prefill_chunk: int | None = None     # gateway path: the verifier's --prefill-chunk (token budget widened to fit)
    service_defaults: bool = False       # gateway path: the services' own limits and cache sizes, not the bench's
    lone_prefill_chunk: int | None = None  # gateway path: the verifier's --lone-prefill-chunk
    verifier_args: tuple[str, ...] = ()  # gateway path: more flags for the verifier service (after the bench's)
    drafter_args: tuple[str, ...] = ()   # gateway path: more flags for the drafter service


@dataclass
class BenchRun:
    config: BenchConfig
    results: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def __post_init__(self):
        self.device = torch.device(self.config.device)
        self.start = time.perf_counter()
        self._inproc = self._peer = self._gateway = None

    # ---- resources, made on first use ---------------------------------------------------
    def inproc(self):
        if self._inproc is None:
            from .inprocess import InprocBench
            c = self.config
            self._inproc = InprocBench(load_model(c.model, c.dtype, self.device, quantization=c.quantization),
                                       self.device, c.overlap, c.repeats)
        return self._inproc

    def peer(self):
        if self._peer is None:
            from .peer import PeerBench
            self._peer = PeerBench(self.config.model, self.device, parse_dtype(self.config.dtype))
            self.record["peer"] = {"load_s": self._peer.load_s, "gdn_kernels": self._peer.kernels}
        return self._peer

    def gateway(self):
        if self._gateway is None:
            from .gateway_path import GatewayBench
            c = self.config
            self._gateway = GatewayBench(c.model, c.device, c.dtype, trace_dir=c.trace_steps_dir,
                                         step_channel=c.step_channel, repeats=c.repeats, overlap=c.overlap,
                                         tensor_parallel_size=c.tensor_parallel_size, load_format=c.load_format,
                                         quantization=c.quantization, grammar=c.grammar, draft_masks=c.draft_masks,
                                         prefill_chunk=c.prefill_chunk, service_defaults=c.service_defaults,
                                         lone_prefill_chunk=c.lone_prefill_chunk,
                                         service_args=(c.verifier_args, c.drafter_args))
        return self._gateway

    # ---- the run ------------------------------------------------------------------------
    def run(self) -> dict:
        c = self.config
        made = ensure_checkpoint(c.model, c.make_tiny, c.layers, c.seed, weights=c.load_format != "dummy")
        self.traffic = ModelTraffic.from_checkpoint(c.model, c.dtype, c.quantization)
        info = device_info(self.device)
        self.tag = c.tag or device_tag(info)
        self.record = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": c.command,
                       "git_commit": git_commit(Path(__file__).resolve().parent), "device": info,
                       "versions": versions(),
                       "model": {**describe(c.model, c.dtype, self.traffic), "checkpoint": made},
                       "preset": c.preset, "cut_from_full": list(c.cut),
                       "settings": {"workload_timeout_s": c.workload_timeout_s, "time_budget_s": c.time_budget_s,
                                    "seed": c.seed, "planned": len(c.workloads), "step_channel": c.step_channel,
                                    "repeats": c.repeats, "overlap": c.overlap,
                                    "tensor_parallel_size": c.tensor_parallel_size, "load_format": c.load_format,
                                    "quantization": c.quantization,
                                    "grammar": c.grammar[0] if c.grammar else None,
                                    "draft_masks": c.draft_masks, "prefill_chunk": c.prefill_chunk,
                                    "service_defaults": c.service_defaults,
                                    "lone_prefill_chunk": c.lone_prefill_chunk,
                                    "verifier_args": list(c.verifier_args), "drafter_args": list(c.drafter_args)},
                       "roofline": None, "profile": None, "results": self.results, "skipped": self.skipped,
                       "problems": []}
        log.info("measuring the device copy and the weight-GEMM chain (%d GEMMs)", len(self.traffic.linear_shapes))
        self.record["roofline"] = roofline.measure(self.traffic.linear_shapes, parse_dtype(c.dtype), self.device,
                                                   k=3)
        self._save()
        if c.profile:
            self._profile()
        try:
            self._workloads()
        finally:
            self._close()
        self.record["problems"] = checks.check_all(self.results, constrained=self.config.grammar is not None)
        self.record["seconds"] = round(time.perf_counter() - self.start, 1)
        self._save()
        if c.plot:
            png = report.plot(self.record, self.paths()["png"])
            self.record["plot"] = png.name if png else None
            self._save()
        self.paths()["txt"].write_text(report.render_table(self.record) + "\n")
        return self.record

    def paths(self) -> dict[str, Path]:
        stem = Path(self.config.out_dir) / f"bench_{self.config.preset}_{self.tag}"
        return {"json": stem.with_suffix(".json"), "png": stem.with_suffix(".png"), "txt": stem.with_suffix(".txt")}

    def _save(self) -> None:
        report.write_json(self.record, self.paths()["json"])

    def _profile(self) -> None:
        from .profile import profile_workload
        candidates = [w for w in self.config.workloads if w.path == "inproc"]
        if not candidates:
            log.warning("--profile needs an in-process workload: none planned")
            return
        w = next((w for w in candidates if w.drafter == "mtp"), candidates[0])
        log.info("profiling %d decode steps of %s", self.config.profile_steps, w.name)
        self.record["profile"] = profile_workload(self.inproc(), w, self._prompts(w), self.config.profile_steps)
        self._save()

    def _prompts(self, w: Workload) -> list[list[int]] | Conversations:
        if w.turns:
            return conversations_for(w, self.traffic_vocab, self.config.seed)
        return prompts_for(w, self.traffic_vocab, self.config.seed)

    @property
    def traffic_vocab(self) -> int:
        return self.record["model"]["vocab_size"]

    def _workloads(self) -> None:
        todo = list(self.config.workloads)
        bar = tqdm(todo, desc="specdec bench", unit="workload", dynamic_ncols=True)
        for i, w in enumerate(bar):
            bar.set_postfix_str(w.name)
            reason = self._no_time_for(w)
            if reason:
                self._skip(w, reason)
                continue
            try:
                metrics = self._run_one(w, todo)
            except Exception as e:  # one broken workload must not lose the others' results
                log.exception("workload %s failed", w.name)
                self._skip(w, f"error: {type(e).__name__}: {e}")
                continue
            finally:
                if w.on_stack and not any(g.on_stack and g.stack_key == w.stack_key for g in todo[i + 1:]):
                    self.gateway().stop()
            result = {"name": w.name, "workload": w.to_json(), "metrics": metrics,
                      "bandwidth": self._bandwidth(w, metrics), "prefill": self._prefill(w, metrics)}
            self.results.append(result)
            self._save()
            log.info("%s: %.1f tok/s, TTFT p50 %s ms, ITL p50 %s ms%s", w.name, metrics["output_tokens_per_s"] or 0,
                     metrics["ttft_ms_p50"], metrics["itl_ms_p50"],
                     " (cut by the time guard)" if metrics["truncated"] else "")

    def _no_time_for(self, w: Workload) -> str | None:
        budget = self.config.time_budget_s
        if budget is None:
            return None
        need = self.config.workload_timeout_s
        if w.on_stack and (self._gateway is None or self._gateway.key != w.stack_key):
            need += (self._gateway.last_start_s if self._gateway and self._gateway.last_start_s
                     else self.config.stack_start_estimate_s)
        left = budget - (time.perf_counter() - self.start)
        return f"time budget: {left:.0f} s left, this needs up to {need:.0f} s" if need > left else None

    def _skip(self, w: Workload, reason: str) -> None:
        log.warning("skipping %s: %s", w.name, reason)
        self.skipped.append({"name": w.name, "workload": w.to_json(), "reason": reason})
        self._save()

    def _run_one(self, w: Workload, todo: list[Workload]) -> dict:
        prompts, guard = self._prompts(w), self.config.workload_timeout_s
        if w.path == "inproc":
            return self.inproc().run(w, prompts, guard)
        if self._inproc is not None:
            self._inproc.release()       # its last engine's memory, for the stack or the peer
        if w.path == "peer":
            return self.peer().run(w, prompts, guard)
        gateway = self.gateway()
        started = gateway.ensure(w, [g for g in todo if g.on_stack and g.stack_key == w.stack_key])
        metrics = gateway.run(w, prompts, guard)
        metrics["stack_start_s"] = round(started, 2) if started else None
        if self.config.service_defaults:   # how the services sized themselves (the report prints it)
            metrics["service_caches"] = gateway.cache_lines
        return metrics

    def _bandwidth(self, w: Workload, m: dict) -> dict:
        """bytes(weights + KV + GDN state) of a mean decode step / its time (mean gap between deliveries); per GPU
        under tensor parallelism."""
        step_s = m["itl_ms_mean"] / 1e3 if m.get("itl_ms_mean") else None
        verify = m.get("verify_steps") or 0
        drafts = m.get("draft_tokens", 0) / verify if verify else 0.0
        nbytes = self.traffic.step_bytes(w.concurrency, w.mean_context, drafts) \
            / self.config.tensor_parallel_size
        roof = self.record["roofline"]
        return utilisation(nbytes, step_s, roof["device_copy"]["gbs"], roof["weight_chain"]["gbs"])

    def _prefill(self, w: Workload, m: dict) -> dict | None:
        """A lone request (concurrency 1): its prompt's tokens per second of TTFT, and the share of the device's
        dense bf16 peak its FLOPs are (MFU; ModelTraffic.prefill_flops). None for the other workloads (and for
        conversations, whose prompts grow turn by turn)."""
        ttft = m.get("ttft_ms_p50")
        if w.concurrency != 1 or w.turns or not ttft:
            return None
        seconds, flops = ttft / 1e3, self.traffic.prefill_flops(w.prompt_tokens)
        peak = peak_flops(self.record["device"])          # one GPU's; tensor parallelism spreads over several
        return {"tokens_per_s": round(w.prompt_tokens / seconds, 1), "tflops": round(flops / seconds / 1e12, 2),
                "mfu": round(flops / seconds / (peak * self.config.tensor_parallel_size), 4) if peak else None}

    def _close(self) -> None:
        for resource in (self._gateway, self._peer):
            if resource is not None:
                resource.close()
        self._inproc = self._peer = self._gateway = None
