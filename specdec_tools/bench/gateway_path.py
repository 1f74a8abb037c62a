"""The `gateway` path: the real stack (gateway, verifier, drafter as three processes, `specdec_tools.local_stack`) and
N concurrent gRPC streams through the public Gateway API, one request each. The `colocated` path: the same with
the drafter inside the verifier's process (`--in-process-drafter`), so that gateway / colocated is the split's cost.
A conversation workload (turns > 0) runs N conversations at once, each a gRPC stream per turn, in order: turn t + 1
is sent when turn t has finished, its prompt turn t's prompt + the tokens turn t gave back + new user tokens.

Every pass sends other token sequences (workloads.salted: the first workload's timed pass 0 the workload's own
prompts, every other pass them rotated by a salt of its own), so that no pass finds an earlier one's prompts, of
this workload or another, in the verifier's prefix cache.

The step split comes from the verifier's Prometheus endpoint (`--metrics-port`): the mean per engine step of
each phase of `specdec_step_seconds` (the engine's host time per phase), scraped before and after the
workload: target (host time: on a GPU the forward's kernels finish inside the next phase), verify (sampling),
drafter (the engine's host time sending the step message and waiting for the answer at the start of the next
step) and drafter_compute (the drafter service's own time per step, as it reports it: it overlaps the engine's
work between the send and the wait, so it may exceed drafter). host = workload wall time / engine steps -
target - verify - drafter (commit, stop checks, scheduling, output streams, idle).
"""
from __future__ import annotations

import logging
import re
import tempfile
import time
import urllib.request
from pathlib import Path

from specdec_tools.local_stack import LocalStack, StackConfig, free_port

from .gateway_clients import send_conversations, send_streams
from .inprocess import blocks_for, scheduler_for
from .latency import interference, median_pass, summarize, turn_figures
from .memory import gpu_memory_by_pid, rss_mib
from .workloads import Conversations, Workload, salted

log = logging.getLogger(__name__)
CXX_FRAME = re.compile(r"frame #\d+: ")   # a line of the C++ stack torch prints on an abort
_SAMPLE = re.compile(r'^(\w+)(?:\{([^}]*)\})?\s+([-+0-9.eEinfa]+)$')


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text exposition -> {(metric name, labels text): value}."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def phase_means(before: dict, after: dict) -> tuple[dict[str, float], int]:
    """Mean seconds per engine step of each `specdec_step_seconds` phase between two scrapes, and the steps."""
    means, steps = {}, 0
    for (name, labels), value in after.items():
        if name == "specdec_step_seconds_count":
            phase = re.search(r'phase="([^"]*)"', labels).group(1)
            count = value - before.get((name, labels), 0.0)
            total = after[("specdec_step_seconds_sum", labels)] - before.get(("specdec_step_seconds_sum", labels), 0.0)
            if count > 0:
                means[phase], steps = total / count, max(steps, int(count))
    return means, steps


class GatewayBench:
    """Keeps one stack running per stack key (drafter, forced length, k); restarts it when the key changes."""

    def __init__(self, model: str, device: str, dtype: str, startup_timeout_s: float = 300.0,
                 trace_dir: str | None = None, step_channel: str = "auto", repeats: int = 1, overlap: bool = True,
                 tensor_parallel_size: int = 1, load_format: str = "safetensors", quantization: str = "none",
                 grammar: tuple[str, str] | None = None, draft_masks: str = "auto",
                 prefill_chunk: int | None = None, service_defaults: bool = False,
                 lone_prefill_chunk: int | None = None,
                 service_args: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())):
        self.model, self.device, self.dtype, self.startup_timeout_s = model, device, dtype, startup_timeout_s
        self.grammar = grammar            # (kind, text) every request is constrained by, or None
        self.draft_masks = draft_masks    # the mtp drafter's --draft-masks
        self.prefill_chunk = prefill_chunk  # the verifier's --prefill-chunk and --mixed-prefill-chunk (None: its own)
        self.service_defaults = service_defaults  # no sizing flags: the services size themselves
        self.lone_prefill_chunk = lone_prefill_chunk  # the verifier's --lone-prefill-chunk (None: its default)
        self.service_args = service_args  # (verifier's, drafter's) flags given to the bench, after its own
        self.workloads_run = 0            # each workload's passes rotate its prompts by salts of their own
        self.tensor_parallel_size, self.load_format = tensor_parallel_size, load_format
        self.quantization = quantization  # the verifier's --quantization
        self.step_channel = step_channel  # the verifier's --step-channel (a drafter service's steps)
        self.repeats = repeats            # timed passes per workload; the one of median tokens/s is reported
        self.overlap = overlap            # False: the verifier's --no-overlap
        self.trace_dir = trace_dir  # the services' --trace-steps files: <path>-<drafter label>-k<k>-<service>.jsonl
        self.stack: LocalStack | None = None
        self.key = None
        self.metrics_port = 0
        self.logs = tempfile.TemporaryDirectory(prefix="specdec-bench-logs-")
        self.last_start_s: float | None = None
        self.cache_lines: list[str] = []   # the services' start-up lines on their cache sizes
        self.log_starts: dict[str, int] = {}   # log file sizes when the running stack started

    def ensure(self, w: Workload, group: list[Workload]) -> float | None:
        """Start the stack for w's key (sized for every workload of `group`); returns seconds spent starting it,
        None if the running one serves."""
        if self.stack is not None and self.key == w.stack_key:
            return None
        self.stop()
        self.metrics_port = free_port()
        running = max(g.concurrency for g in group)
        context = max(max(g.prompt_lengths) + g.max_tokens + g.k + 1 for g in group)
        budget = max(scheduler_for(g, self.device.split(":")[0]).max_batched_tokens for g in group)
        chunk = (["--prefill-chunk", str(self.prefill_chunk), "--mixed-prefill-chunk", str(self.prefill_chunk)]
                 if self.prefill_chunk else [])
        chunk += ["--lone-prefill-chunk", str(self.lone_prefill_chunk)] if self.lone_prefill_chunk else []
        budget = max(budget, self.prefill_chunk + running * (w.k + 1)) if self.prefill_chunk else budget
        sizing = [] if self.service_defaults else [
            "--max-running", str(running), "--max-batched-tokens", str(budget),
            "--kv-blocks", str(max(blocks_for(g) for g in group)), "--max-context", str(context)]
        if self.service_defaults and self.prefill_chunk:   # (the chunk needs its budget either way)
            sizing = ["--max-batched-tokens", str(budget)]
        verifier = chunk + sizing + ["--metrics-port", str(self.metrics_port),
                                     "--step-channel", self.step_channel] + ([] if self.overlap else ["--no-overlap"])
        verifier += ["--tensor-parallel-size", str(self.tensor_parallel_size), "--load-format", self.load_format]
        verifier += ["--quantization", self.quantization] if self.quantization != "none" else []
        drafter = ["--max-seqs", str(running), "--max-context", str(context)] \
            if w.drafter == "mtp" and not self.service_defaults else []
        drafter += ["--load-format", self.load_format] if w.drafter == "mtp" else []
        drafter += ["--draft-masks", self.draft_masks] if w.drafter == "mtp" else []
        drafter += ["--draft-vocab", w.draft_vocab] if w.draft_vocab else []
        service = w.drafter
        if w.path == "colocated":  # the same drafter inside the verifier's process (sized by its own flags)
            verifier += ["--in-process-drafter", w.drafter, "-k", str(w.num_drafts)]
            verifier += ["--draft-vocab", w.draft_vocab] if w.draft_vocab else []
            service, drafter = "none", []
        if self.trace_dir:
            stem = Path(self.trace_dir) / f"{w.path}-{w.drafter_label.replace('@', '-at-')}-k{w.num_drafts}"
            verifier += ["--trace-steps", f"{stem}-verifier.jsonl"]
            drafter += ["--trace-steps", f"{stem}-drafter.jsonl"] if service != "none" else []
        if w.forced_length:
            verifier += ["--forced-acceptance-length", str(w.forced_length), "--unsafe-forced-acceptance"]
        verifier += [] if w.prefix_cache else ["--no-prefix-caching"]
        verifier += ["--draft-policy", w.draft_policy] if w.drafter != "none" else []   # (a GPU's default: adaptive)
        verifier += list(self.service_args[0])
        drafter += list(self.service_args[1]) if service != "none" else []
        config = StackConfig(model=self.model, drafter=service, num_drafts=w.num_drafts or 3, device=self.device,
                             dtype=self.dtype, port=0, verifier_args=tuple(verifier), drafter_args=tuple(drafter),
                             log_dir=self.logs.name,
                             startup_timeout_s=self.startup_timeout_s)
        start = time.perf_counter()
        self.log_starts = {f.name: f.stat().st_size for f in Path(self.logs.name).glob("*.log")}
        self.stack, self.key = LocalStack(config), w.stack_key
        try:
            self.stack.start()
        except BaseException as e:  # an interrupt while it starts must not leave the processes behind
            tails = self.log_tails()
            self.stop()
            if isinstance(e, Exception):
                raise RuntimeError(f"the stack for {w.drafter_label} did not start: {e}\n{tails}") from e
            raise
        self.last_start_s = time.perf_counter() - start
        log.info("stack for %s started in %.1f s", w.drafter_label, self.last_start_s)
        self.cache_lines = self.log_lines("caches: ", "drafter KV cache: ")
        for line in self.cache_lines:
            log.info("%s", line)
        return self.last_start_s

    def log_lines(self, *needles: str) -> list[str]:
        """The running stack's log lines holding any of these (from the needle on), oldest first."""
        found = []
        for f in sorted(Path(self.logs.name).glob("*.log")):
            with open(f, "rb") as log_file:
                log_file.seek(self.log_starts.get(f.name, 0))    # the services append: this stack's lines only
                text = log_file.read().decode(errors="replace")
            for line in text.splitlines():
                found += [line[line.index(n):] for n in needles if n in line][:1]
        return found

    def log_tails(self, lines: int = 12) -> str:
        """The last lines of each service's log, without a C++ stack's frames (an abort at exit prints dozens of
        them after the Python traceback that says why)."""
        parts = []
        for f in sorted(Path(self.logs.name).glob("*.log")):
            tail = [line for line in f.read_text(errors="replace").splitlines()
                    if not CXX_FRAME.match(line)][-lines:]
            parts.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def scrape(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def run(self, w: Workload, prompts: list[list[int]] | Conversations, guard_s: float) -> dict:
        """Warm-up, then the timed passes; `prompts`: one per stream, or a conversation workload's Conversations."""
        # Warm-up, not timed: the whole workload once, so that every kernel variant it meets compiles first
        # (Triton specialises per shape class, e.g. paged attention per query-block and split count, which the
        # steps mixing prefill chunks with decodes reach only once requests outlive the others' prefill), fla
        # autotunes, and the graph buckets of this concurrency are hit before measuring. Its prompts are the
        # workload's rotated: the same lengths and shapes, none of the timed passes' prefixes cached. Workload n's
        # timed passes rotate them by n (repeats + 1) + pass, its warm-up by that + repeats, so that no workload finds
        # another's prompts cached either (workloads of one length share their prompts: c1's is c16's first).
        first, self.workloads_run = self.workloads_run * (self.repeats + 1), self.workloads_run + 1
        warm_start = time.perf_counter()
        self._send(w, salted(prompts, first + self.repeats), guard_s)
        warmup_s = round(time.perf_counter() - warm_start, 2)
        log.info("%s: warm-up pass done in %.1f s; timing %d pass(es)", w.name, warmup_s, self.repeats)
        passes = self._timed_passes(w, prompts, guard_s, first)
        median, rates = median_pass(passes)
        return {**median, "warmup_s": warmup_s, "passes_tokens_per_s": rates}

    def _timed_passes(self, w: Workload, prompts: list[list[int]], guard_s: float, first_salt: int = 0
                      ) -> list[dict]:
        """Up to `repeats` timed passes within one guard_s for them all (as one pass has with --repeats 1):
        the first always runs; a further one starts only if a pass as long as the last still fits."""
        deadline = time.perf_counter() + guard_s
        passes: list[dict] = []
        last_s = 0.0
        while len(passes) < self.repeats:
            left, started = deadline - time.perf_counter(), time.perf_counter()
            if passes and left < last_s:
                log.warning("%s: %d of %d timed passes fit in the workload's %.0f s", w.name, len(passes),
                            self.repeats, guard_s)
                break
            passes.append(self._measure(w, salted(prompts, first_salt + len(passes)), left))
            last_s = time.perf_counter() - started
        return passes

    def _send(self, w: Workload, prompts: list[list[int]] | Conversations, guard_s: float):
        """One pass: (traces, finals, truncated, turn records or None)."""
        if w.turns:
            records, truncated = send_conversations(self.stack.address, w, prompts, guard_s, self.grammar)
            return ([r.trace for r in records], [(r.finish_reason, r.usage) for r in records], truncated,
                    records)
        return (*send_streams(self.stack.address, w, prompts, guard_s, self.grammar), None)

    def _measure(self, w: Workload, prompts: list[list[int]] | Conversations, guard_s: float) -> dict:
        """One timed pass of the workload, with the verifier's counters and step split over it."""
        before = self.scrape()
        traces, finals, truncated, records = self._send(w, prompts, guard_s)
        after = self.scrape()
        summary = summarize(traces)
        phases, steps = phase_means(before, after)
        usage = [u for reason, u in finals if u is not None]
        complete = len(usage) == w.requests and not truncated
        totals = {f: sum(getattr(u, f) for u in usage) for f in
                  ("completion_tokens", "verify_steps", "draft_tokens", "accepted_tokens")}
        if not complete:  # cancelled streams have no usage: the verifier's counters instead
            totals = {"completion_tokens": summary["output_tokens"],
                      "verify_steps": int(_delta(before, after, "specdec_verify_steps_total")),
                      "draft_tokens": int(_delta(before, after, "specdec_draft_tokens_total")),
                      "accepted_tokens": int(_delta(before, after, "specdec_accepted_tokens_total"))}
        prefills = sum(1 for t in traces if t.times)
        verify = totals["verify_steps"]
        wall_per_step = summary["seconds"] / steps if steps else None
        length = (totals["completion_tokens"] - prefills) / verify if verify else None
        if w.long_prompt:
            summary["interference"] = interference(traces)
        if records is not None:
            summary["multiturn"] = turn_figures(records)
        if ("specdec_prefix_cache_queries_total", "") in after:   # the verifier's own count, admissions included
            summary["prefix_cache_queried_tokens"] = int(_delta(before, after, "specdec_prefix_cache_queries_total"))
            summary["prefix_cache_hit_tokens"] = int(_delta(before, after, "specdec_prefix_cache_hits_total"))
        return {**summary, "truncated": truncated, **totals, "prefills": prefills,
                "finish_reasons": sorted({reason for reason, _ in finals}),
                "first_error": next((t.error for t in traces if t.error), None),   # (in request order)
                "mean_acceptance_length": round(length, 4) if length else None,
                "engine_steps": steps, "step_ms": self._split(phases, wall_per_step, w), "memory": self._memory()}

    @staticmethod
    def _split(phases: dict[str, float], wall_per_step: float | None, w: Workload) -> dict:
        ms = {p: round(v * 1e3, 4) for p, v in phases.items()}
        has_drafter = w.drafter != "none"
        out = {"target_forward": ms.get("target"), "sampling": ms.get("verify"),
               "drafter_round_trip": ms.get("drafter") if has_drafter else None,
               "drafter_compute": ms.get("drafter_compute") if has_drafter else None}
        if wall_per_step:
            out["total"] = round(wall_per_step * 1e3, 4)
            phases = sum(ms.get(p, 0.0) for p in ("target", "verify", "drafter"))  # not drafter_compute
            out["host"] = round(max(0.0, out["total"] - phases), 4)
        return out

    def _memory(self) -> dict:
        pids = {name: p.pid for name, p in self.stack.procs.items()}
        gpu = gpu_memory_by_pid() if self.device.startswith("cuda") else {}
        if gpu:
            return {f"{name}_gpu_mib": gpu.get(pid) for name, pid in pids.items() if name != "gateway"}
        return {f"{name}_rss_mib": rss_mib(pid) for name, pid in pids.items()}

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack, self.key = None, None

    def close(self) -> None:
        self.stop()
        self.logs.cleanup()


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get((name, ""), 0.0) - before.get((name, ""), 0.0)
