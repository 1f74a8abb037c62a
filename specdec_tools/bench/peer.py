"""The `peer` path: transformers `generate` on the same checkpoint folder, in this process.

bf16 on a GPU (fp32 on a CPU), batch = concurrency (all prompts have the same length, so no padding), exactly
`max_tokens` new tokens each (min_new_tokens), greedy or T sampling with no top-k / top-p cut. When fla-core is
importable, transformers runs its Gated DeltaNet kernels (chunk prefill, fused recurrent decode); otherwise its
own torch reference: the result says which. A streamer timestamps every decode step, which gives TTFT and ITL
as for the other paths; the token copy it needs is the same host sync transformers makes each step anyway.
"""
from __future__ import annotations

import gc
import importlib.metadata
import logging
import time

import torch

from .latency import RequestTrace, summarize
from .memory import PeakMemory
from .workloads import Workload

log = logging.getLogger(__name__)


def gdn_kernels() -> str:
    """Which Gated DeltaNet implementation transformers picks: fla-core's when importable."""
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # not installed, or broken against this torch / triton
        return "torch (transformers reference)"
    try:
        return f"fla-core {importlib.metadata.version('fla-core')}"
    except importlib.metadata.PackageNotFoundError:
        return "fla (version unknown)"


class StepClock:
    """transformers streamer: put() is called with the prompt, then once per decode step with [B] new tokens."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class PeerBench:
    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM
        self.device = device
        start = time.perf_counter()
        try:  # straight onto the GPU (needs accelerate); else load on the host and move
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, **({"device_map": str(device)} if device.type == "cuda" else {}))
        except (ImportError, ValueError) as e:
            log.info("peer: loading on the host first (%s)", e)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = self.model.to(device).eval()
        self.load_s = round(time.perf_counter() - start, 2)
        self.kernels = gdn_kernels()
        self.weights_mib = round(sum(p.numel() * p.element_size() for p in self.model.parameters()) / 2**20, 1)
        self.eos = self.model.config.eos_token_id
        self._warmed: set[tuple[int, int]] = set()
        log.info("peer: transformers %s loaded in %.1f s, Gated DeltaNet kernels: %s",
                 type(self.model).__name__, self.load_s, self.kernels)

    def _generate(self, ids: torch.Tensor, w: Workload, new_tokens: int, streamer=None, stop=None):
        from transformers import StoppingCriteriaList
        sampling = dict(do_sample=True, temperature=w.temperature, top_k=0, top_p=1.0) if w.temperature > 0 \
            else dict(do_sample=False)
        torch.manual_seed(0)
        with torch.inference_mode():
            return self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, pad_token_id=0, streamer=streamer,
                                       stopping_criteria=StoppingCriteriaList([stop] if stop else []), **sampling)

    def run(self, w: Workload, prompts: list[list[int]], guard_s: float) -> dict:
        from transformers import StoppingCriteria
        cuda = self.device.type == "cuda"
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)   # [B, prompt]
        warmup_s = None
        if ids.shape not in self._warmed:  # kernels compile / autotune per shape: not timed
            t0 = time.perf_counter()
            self._generate(ids, w, 3)
            warmup_s = round(time.perf_counter() - t0, 2)
            self._warmed.add(ids.shape)
        window = PeakMemory(self.device)

        class Deadline(StoppingCriteria):
            def __init__(self, at: float):
                self.at, self.hit = at, False

            def __call__(self, input_ids, scores, **kwargs):
                self.hit = self.hit or time.perf_counter() > self.at
                return torch.full((input_ids.shape[0],), self.hit, dtype=torch.bool, device=input_ids.device)
        clock = StepClock()
        start = time.perf_counter()
        deadline = Deadline(start + guard_s)
        out = self._generate(ids, w, w.max_tokens, streamer=clock, stop=deadline)
        if cuda:
            torch.cuda.synchronize(self.device)
        new = out.shape[1] - ids.shape[1]
        steps = clock.times[1:1 + new]   # times[0] is the prompt; one put per generated token
        traces = [RequestTrace(sent=start, times=list(steps), counts=[1] * len(steps)) for _ in prompts]
        memory = {"weights_mib": self.weights_mib, **window.close()}
        del out
        return {**summarize(traces), "truncated": deadline.hit and new < w.max_tokens,
                "completion_tokens": new * len(prompts), "engine_steps": len(steps), "step_ms": None,
                "memory": memory, "gdn_kernels": self.kernels, "warmup_s": warmup_s}

    def close(self) -> None:
        del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
