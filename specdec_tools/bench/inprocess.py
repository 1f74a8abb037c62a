"""The `inproc` path: SpecEngine in this process with an in-process drafter (MTPDrafter / NgramDrafter), stepped
by hand so every step is timed.

The step split of each pass: step_clock.py.
"""
from __future__ import annotations

import gc
import itertools
import math
import time
from dataclasses import replace

import numpy as np
import torch

from drafter_service.synthetic import SyntheticDrafter
from specdec.models.loader import LoadedModel
from specdec.sampling_params import SamplingParams
from verifier_service.builder import DEVICE_LIMITS, VerifierConfig, build_engine
from verifier_service.draft_policy import StepCosts
from verifier_service.engine import SpecEngine
from verifier_service.scheduler import SchedulerConfig
from verifier_service.warm_up import measure_step_costs

from ..commands.in_process_drafter import IN_PROCESS_KINDS, in_process_drafter

from .latency import RequestTrace, median_pass, summarize
from .memory import PeakMemory
from .step_clock import CallClock, step_split
from .workloads import Workload, salted

BLOCK = 16


def blocks_for(w: Workload) -> int:
    """KV blocks for the whole workload: every sequence's prompt + output + drafts, no preemption."""
    return sum(math.ceil((p + w.max_tokens + w.num_drafts + 1) / BLOCK) + 1 for p in w.prompt_lengths)


def costs_record(costs: StepCosts) -> dict:
    """The adaptive policy's step costs as a result JSON keeps them (`step_costs_ms`), in ms."""
    return {"batch_sizes": list(costs.batch_sizes), "ms": (costs.seconds * 1e3).round(3).tolist(),
            "drafts": costs.drafts.round(3).tolist(),
            "plain_ms": None if costs.plain is None else (costs.plain * 1e3).round(3).tolist()}


def costs_of_record(record: dict) -> StepCosts:
    """The StepCosts a result JSON's `step_costs_ms` holds (costs_record's inverse)."""
    plain = record.get("plain_ms")
    return StepCosts(tuple(record["batch_sizes"]), np.array(record["ms"]) * 1e-3, np.array(record["drafts"]),
                     None if plain is None else np.array(plain) * 1e-3)


def scheduler_for(w: Workload, device_type: str) -> SchedulerConfig:
    """The verifier's defaults on `device_type` (cuda or cpu), widened so that every running sequence verifies in
    one step."""
    limits = DEVICE_LIMITS["cuda" if device_type == "cuda" else "cpu"]
    return SchedulerConfig(max_running=w.concurrency,
                           max_batched_tokens=max(limits["max_batched_tokens"], w.concurrency * (w.k + 1)),
                           prefill_chunk=limits["prefill_chunk"])


class InprocBench:
    def __init__(self, loaded: LoadedModel | None, device: torch.device, overlap: bool = True, repeats: int = 1,
                 target: dict | None = None):
        """`target`: VerifierConfig fields of a target that build_engine's engines load themselves (model_dir,
        dtype, load_format, tensor_parallel_size, ...), which replace build_engine's own, with `loaded` None
        (run() needs `loaded`); the caller stops an engine's tensor-parallel ranks (engine.executor.close())."""
        self.loaded, self.device, self.overlap, self.target = loaded, device, overlap, target or {}
        if loaded is not None and self.target.get("model_dir"):
            raise ValueError("InprocBench: a loaded target or a target's model_dir to load, not both")
        self.repeats = repeats            # timed passes per workload; the one of median tokens/s is reported
        self._engine: SpecEngine | None = None     # the last workload's engine, kept for one that differs only
        self._engine_for: Workload | None = None   # in its draft policy (engine_for)
        self._reused = False                       # did engine_for hand out the last workload's engine?
        self._salts = itertools.count()            # prompt rotations used on the kept engine (workloads.salted)
        self._plain: SpecEngine | None = None      # the last plain workload's engine, kept beside the others for
        self._plain_for: Workload | None = None    # the adaptive passes of the same shape (plain_engine_for)
        self._plain_salts = itertools.count()      # its prompt rotations (those of its own workload, continued)

    def engine_for(self, w: Workload) -> SpecEngine:
        """The engine for w: the last workload's when w differs from it only in the draft policy (then the fixed
        and the adaptive policy are measured on one engine: the same graphs, memory and drafter, so that the
        policy is all that differs), else a new one (run freed the last one first, unless it serves w)."""
        self._reused = self.serves(w)
        if not self._reused:
            self._engine, self._engine_for = self.build_engine(w), replace(w, draft_policy="fixed")
            self._salts = itertools.count()
            return self._engine
        engine = self._engine
        engine.policy.adaptive = w.draft_policy == "adaptive"
        if engine.policy.adaptive and engine.policy.costs is None:
            measure_step_costs(engine)
        engine.policy.forget()
        return engine

    def serves(self, w: Workload) -> bool:
        """Does the kept engine serve w (the last workload's, but for the draft policy)?"""
        return self._engine is not None and self._engine_for == replace(w, draft_policy="fixed")

    def release(self, keep_plain: bool = False) -> None:
        """Free the kept engines (before another engine or a stack of services needs the device's memory); with
        `keep_plain`, the plain one stays."""
        if self._engine is not None or (self._plain is not None and not keep_plain):
            self._engine = self._engine_for = None
            if not keep_plain:
                self._plain = self._plain_for = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def plain_engine_for(self, w: Workload) -> SpecEngine | None:
        """The kept plain engine, if it serves w's shape (w less its drafter)."""
        twin = replace(w, drafter="none", forced_length=None, accept_rate=None, draft_vocab=None,
                       draft_policy="fixed")
        return self._plain if self._plain is not None and self._plain_for == twin else None

    def build_engine(self, w: Workload) -> SpecEngine:
        """The verifier's engine (verifier_service.builder.build_engine) sized for `w`, its drafter in process; with
        the adaptive draft policy, its step costs measured (as a verifier does at start-up)."""
        k, scheduler = w.num_drafts, scheduler_for(w, self.device.type)
        drafter = w.drafter if w.drafter in IN_PROCESS_KINDS + ("synthetic",) else None
        config = VerifierConfig(
            model_dir="", device=str(self.device), num_drafts=k, in_process_drafter=drafter,
            max_context=w.prompt_tokens + w.max_tokens, max_running=w.concurrency,
            max_batched_tokens=scheduler.max_batched_tokens, prefill_chunk=scheduler.prefill_chunk, block_size=BLOCK,
            kv_blocks=blocks_for(w), forced_acceptance_length=w.forced_length or 0.0,
            unsafe_forced_acceptance=bool(w.forced_length), overlap=self.overlap, warm_up=False,
            draft_policy=w.draft_policy)
        config = replace(config, **self.target)
        if drafter == "synthetic":   # k random drafts a step (no references), their acceptance forced
            def make(loaded, config):
                return SyntheticDrafter([], k, loaded.config.vocab_size, accept_rate=w.accept_rate)
        else:
            make = in_process_drafter(drafter, w.draft_vocab if drafter == "mtp" else None) if drafter else None
        engine = build_engine(config, make, self.loaded)
        warm = [SamplingParams(max_tokens=k + 2, ignore_eos=True),
                SamplingParams(max_tokens=k + 2, temperature=0.8, seed=1, ignore_eos=True)]
        engine.generate([[1, 2, 3, 4], [5, 6, 7]], warm)  # every path once: prefill, verify, sampling, drafter
        if engine.policy.adaptive:
            measure_step_costs(engine)
        return engine

    def run(self, w: Workload, prompts: list[list[int]], guard_s: float) -> dict:
        if not self.serves(w):   # before the memory window opens: the new engine's build is in it
            self.release(keep_plain=self.plain_engine_for(w) is not None)
        window = PeakMemory(self.device)
        engine = self.engine_for(w)
        if w.drafter == "none":   # kept for the adaptive passes of its shape, which alternate with passes of it
            self._plain, self._plain_for, self._plain_salts = engine, w, self._salts
        # Warm-up, not timed: the whole workload once (every kernel variant it meets compiles first: Triton
        # specialises per shape class, and steps mixing prefill chunks with decodes appear only once requests
        # outlive the others' prefill; fla autotunes; this concurrency's graph buckets replay), then the
        # counters are read afresh below. Every pass on an engine rotates the prompts its own way
        # (workloads.salted): none finds another's prefixes in the prefix cache.
        warm_start = time.perf_counter()
        engine.generate(salted(prompts, next(self._salts)), [
            SamplingParams(max_tokens=w.max_tokens, temperature=w.temperature, seed=i, ignore_eos=True)
            for i in range(len(prompts))])
        warmup_s = round(time.perf_counter() - warm_start, 2)
        clocks = CallClock(self.device), CallClock(self.device)     # the target's forward, the drafter's calls
        timed = [(engine.executor, "forward", clocks[0])] + [
            (engine.drafter, name, clocks[1]) for name in ("propose", "draft_on_device")   # (overlapped steps draft
            if engine.drafter is not None and hasattr(engine.drafter, name)]               # through the second)
        own = [vars(owner).get(name) for owner, name, _ in timed]    # (None: the class's method)
        for owner, name, clock in timed:
            setattr(owner, name, clock.wrap(getattr(owner, name)))
        # as a verifier does once it is warm (specdec/startup_heap.py): full collections skip what is alive now
        # (torch, Triton, the model, this engine), so that none stalls a timed step
        gc.collect()
        gc.freeze()
        try:
            all_passes = self._timed_passes(engine, w, prompts, guard_s, clocks)
        finally:
            gc.unfreeze()
            for (owner, name, _), attribute in zip(timed, own):   # unwrapped (the engine may serve the next one)
                if attribute is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, attribute)
        passes, fixed_passes, plain_passes = all_passes
        median, rates = median_pass(passes)
        weights = sum(p.numel() * p.element_size() for p in self.loaded.model.parameters())
        memory = {"weights_mib": round(weights / 2**20, 1), **window.close()}
        del engine
        out = {**median, "memory": memory, "warmup_s": warmup_s, "passes_tokens_per_s": rates}
        if fixed_passes:
            fixed, fixed_rates = median_pass(fixed_passes)
            out.update(paired_fixed_tokens_per_s=fixed["output_tokens_per_s"],
                       paired_fixed_passes_tokens_per_s=fixed_rates, paired_fixed_truncated=fixed["truncated"])
        if plain_passes:
            plain, plain_rates = median_pass(plain_passes)
            out.update(paired_plain_tokens_per_s=plain["output_tokens_per_s"],
                       paired_plain_passes_tokens_per_s=plain_rates, paired_plain_truncated=plain["truncated"])
        return out

    def _timed_passes(self, engine: SpecEngine, w: Workload, prompts: list[list[int]], guard_s: float,
                      clocks: tuple[CallClock, CallClock]) -> tuple[list[dict], list[dict], list[dict]]:
        """Up to `repeats` timed passes within one guard_s for them all (a further one starts only if one as long as
        the last still fits; none after a pass cut by the guard). The adaptive policy on the fixed one's engine:
        each of its passes comes with one of the fixed policy (the second list, `paired_fixed_*`) and, when the
        plain engine of its shape is kept, one of plain decoding (the third, `paired_plain_*`): the three in
        alternation, so that a drift of the machine's speed (a few percent between runs) falls on all. Round r runs
        kind r (mod 3) first and the others in their order (afp, fap, paf): each runs first once in three rounds,
        and the adaptive and the fixed pass each follow the other engine's pass once. A pass cut by the guard ends
        its round."""
        paired = self._reused and w.draft_policy == "adaptive"
        plain_engine = self.plain_engine_for(w) if paired else None
        passes, fixed_passes, plain_passes = [], [], []
        # (passes it adds to, engine, workload, prompt rotations, the policy's adaptive flag: None leaves it)
        kinds = [(passes, engine, w, self._salts, True if paired else None)]
        if paired:
            kinds.append((fixed_passes, engine, replace(w, draft_policy="fixed"), self._salts, False))
        if plain_engine is not None:   # (the clocks time only the other engine: its step split is host-only)
            kinds.append((plain_passes, plain_engine, self._plain_for, self._plain_salts, None))
        deadline, last_s = time.perf_counter() + guard_s, 0.0
        while len(passes) < self.repeats and not any(p["truncated"] for p in passes + fixed_passes + plain_passes):
            started = time.perf_counter()
            if passes and deadline - started < last_s:
                break
            first = len(passes) % len(kinds)
            for into, on, workload, salts, adaptive in [kinds[first]] + kinds[:first] + kinds[first + 1:]:
                if adaptive is not None:
                    engine.policy.adaptive = adaptive
                into.append(self._timed_pass(on, workload, salted(prompts, next(salts)),
                                             deadline - time.perf_counter(), clocks))
                if into[-1]["truncated"]:
                    break
            if paired:
                engine.policy.adaptive = True
            last_s = time.perf_counter() - started
        return passes, fixed_passes, plain_passes

    def _timed_pass(self, engine: SpecEngine, w: Workload, prompts: list[list[int]], guard_s: float,
                    clocks: tuple[CallClock, CallClock]) -> dict:
        """One timed pass of the workload on a warm engine: its latencies, the engine's counters over it and the
        step split."""
        target_clock, drafter_clock = clocks
        for clock in clocks:
            clock.records = []
        before, chosen_before, left_before = _counts(engine), list(engine.policy.chosen), engine.policy.num_left
        traces, steps, truncated = self._drive(engine, w, prompts, guard_s, clocks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        verify, drafted, accepted, emitted, preemptions = (
            None if a is None else a - b for a, b in zip(_counts(engine), before))
        chosen = [a - b for a, b in zip(engine.policy.chosen, chosen_before)]
        left_drafter = engine.policy.num_left - left_before
        costs = engine.policy.costs
        summary = summarize(list(traces.values()))
        first_all = max((t.times[0] for t in traces.values() if t.times), default=0.0)
        split = step_split(steps, target_clock.seconds_by_step(), drafter_clock.seconds_by_step(),
                           engine.drafter is not None, first_all)
        return {**summary, "truncated": truncated, "completion_tokens": summary["output_tokens"],
                "prefills": sum(1 for t in traces.values() if t.times), "verify_steps": verify,
                "draft_tokens": drafted, "accepted_tokens": accepted, "emitted_by_verify": emitted,
                "mean_acceptance_length": round(emitted / verify, 4) if verify else None,
                "mean_drafts": round(drafted / verify, 4) if verify else None, "steps_by_k": chosen,
                "left_drafter": left_drafter,
                "step_costs_ms": None if costs is None else costs_record(costs),
                "engine_steps": len(steps), "preemptions": preemptions, "step_ms": split}

    def _drive(self, engine: SpecEngine, w: Workload, prompts, guard_s: float, clocks):
        start = time.perf_counter()
        traces = {}
        for i, prompt in enumerate(prompts):
            rid = f"bench-{i}"
            params = SamplingParams(max_tokens=w.max_tokens, temperature=w.temperature, seed=i, ignore_eos=True)
            engine.add_request(rid, prompt, params)
            traces[rid] = RequestTrace(sent=start)
        steps, truncated = [], False
        while engine.has_work:
            for clock in clocks:
                clock.step = len(steps)
            t0 = time.perf_counter()
            outputs = engine.step()
            t1 = time.perf_counter()
            steps.append((t1, t1 - t0, dict(engine.last_step_seconds), engine.overlapping))
            for o in outputs:
                if o.request_id in traces:
                    traces[o.request_id].add(t1, len(o.new_token_ids))
            if t1 - start > guard_s and engine.has_work:
                truncated = True
                for rid in traces:
                    engine.abort(rid)
        return traces, steps, truncated


def _counts(engine: SpecEngine) -> tuple:
    """Engine-lifetime counters (verify steps, drafted, accepted, emitted, preemptions); a workload is a delta."""
    s = engine.stats
    return (s.verify_steps, s.drafted, s.accepted, s.emitted, getattr(engine.scheduler, "num_preemptions", None))
