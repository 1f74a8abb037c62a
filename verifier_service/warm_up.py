"""Start-up warm-up: the step shapes a server will meet, run before it reports SERVING, so that no client
request waits for a kernel to compile. Triton compiles a variant per shape class the first time it sees it
(paged attention picks its query tile and split count from the step's batch, the norms their rows per program);
the CUDA graphs compile what their steps need while they are captured (decode, verify, a prompt chunk alone, and
prompt chunks mixed with decodes up to the mixed buckets' 1024 tokens), but larger steps run
eagerly, and on a cold cache the first compile of an eager mixed step stalls every running request for as long as
it takes. The mixed steps below replay their graphs where one holds them.

What runs (every sequence is gone afterwards, the counters start afresh):
  - short generations: prefills of several lengths; greedy and sampled rows (the sampler kernel's greedy and
    sampled variants: it compiles once per mode, not per batch size), penalties and logprobs;
  - on a GPU, when the prefill chunk, the token budget and the context all reach CHUNKED_PREFILL_MIN_TOKENS (the
    chunked GDN path: fla-core's kernels and the replay-only pass before them), one prompt of that length alone,
    and beside a short one when the budget holds both (several prompts at once past the mixed graphs: eager);
  - on a GPU, for each batch bucket B up to max_running: B - 1 sequences verifying k drafts (the warm-up drafter
    proposes k copies of each last token, so no drafter needs to be up), then decoding without drafts (as while a
    drafter is away), in steps mixed with one prefill chunk of each of a few sizes, and with four prompts of half
    a prefill chunk at once (several sequences prefilling in one step, as when a burst of requests arrives).

`measure_step_costs` (the adaptive draft policy's costs, draft_policy.py) runs after the warm-up, once the drafter
is connected: for each batch bucket B and k in 0..K, B sequences decode verifying k drafts each, through the
engine and the drafter as they serve, and the median wall time of a few steps is kept per (B, k) (a compile or a
collector's pause in one step would move a mean by a step's worth); then B sequences out of
the drafter (`speculation: false`: plain decoding beside an idle drafter), the plain column.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from specdec.drafting import DraftBatch, DraftOutput
from specdec.models.cuda_graph_runner import buckets_for
from specdec.models.gated_deltanet import CHUNKED_PREFILL_MIN_TOKENS
from specdec.sampling_params import SamplingParams

from .acceptance_stats import AcceptanceStats
from .draft_policy import DraftPolicy, StepCosts
from .engine import SpecEngine

log = logging.getLogger(__name__)
PREFILL_SIZES = (16, 64, 256)   # prefill chunks mixed with the decoders: attention query tiles 16, and the splits
MIN_CONTEXT = 40                # the mixed steps' decoders take 3 prompt tokens and up to 32 new ones
COST_STEPS = 9                  # steps timed per (batch, k): their median is kept (one stall moves it little)
COST_SETTLE = 3                 # steps after the prefill before the timing (the drafts of the first are in)


class EchoDrafter:
    """Proposes k copies of each sequence's last token: verify steps of the real shape without a drafter."""
    kind = "warm-up"
    needs_hidden = False

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts

    def propose(self, batch: DraftBatch) -> DraftOutput:
        return DraftOutput(drafts=[[s.token_ids[-1]] * s.num_drafts for s in batch.seqs])

    def release(self, seq_ids: list[int]) -> None:
        pass

    def clear(self) -> None:
        pass


def warm_up(engine: SpecEngine, mixed: bool | None = None) -> None:
    """Run the warm-up (see the module docstring); `mixed`: the GPU parts too, the chunked prefill and the mixed
    steps (default: on a GPU only; a CPU compiles nothing)."""
    start, steps = time.perf_counter(), engine.step_count
    drafter = engine.drafter
    k = engine.config.num_drafts if drafter is not None else 0
    blocks = engine.executor.blocks
    try:
        engine.drafter = EchoDrafter(k) if k else None
        blocks.paused = True   # its made-up prompts share prefixes: cached, they would not run the shapes meant
        if engine.max_len < MIN_CONTEXT:
            log.warning("warm-up skipped: a maximum context of %d tokens leaves no room for it (%d needed); the "
                        "first requests may wait for kernels to compile", engine.max_len, MIN_CONTEXT)
        else:
            _short_generations(engine)
            if mixed if mixed is not None else engine.executor.device.type == "cuda":
                _chunked_prefill(engine)
                _mixed_steps(engine, k)
            while engine.has_work:   # an overlapped step still running: its aborted requests' tokens are dropped
                engine.step()
    finally:
        engine.drafter, blocks.paused = drafter, False
        log.info("warm-up: %d steps in %.1f s", engine.step_count - steps, time.perf_counter() - start)
        reset_counters(engine)


def reset_counters(engine: SpecEngine) -> None:
    """The engine's statistics start afresh: what a warm-up did is not served traffic."""
    engine.stats, engine.step_count, engine.drafting.fallback_steps = AcceptanceStats(), 0, 0
    engine.scheduler.num_preemptions, engine.overlapped_draft_steps = 0, 0
    engine.scheduler.prefix_stats.queried_tokens = engine.scheduler.prefix_stats.hit_tokens = 0
    engine.policy.forget()


def measure_step_costs(engine: SpecEngine) -> StepCosts | None:
    """The adaptive policy's step costs (see the module docstring), given to engine.policy and returned; None
    when no drafter drafts now (k = 0) or no batch fits the token budget and the KV cache."""
    num_drafts = engine.drafting.k
    config = engine.scheduler.config
    max_tokens = (COST_SETTLE + COST_STEPS + 3) * (num_drafts + 1)
    length = 4 + max_tokens + num_drafts + 1
    capacity = engine.executor.blocks.kv_blocks.size * engine.executor.block_size
    sizes = [b for b in sorted({min(b, config.max_running) for b in buckets_for(config.max_running)})
             if b * (num_drafts + 1) <= config.max_batched_tokens and b * (length + engine.executor.block_size)
             <= capacity and length <= engine.max_len]
    if num_drafts == 0 or not sizes:
        log.warning("adaptive draft length: %s; every step verifies k = %d",
                    "no drafter is connected" if num_drafts == 0 else "no batch fits the step costs' measurement",
                    engine.config.num_drafts)
        return None
    start, policy, rows, drafts, plain = time.perf_counter(), engine.policy, [], [], []
    try:
        for b in tqdm(sizes, desc="measuring step costs", unit="batch", leave=False):
            timed = [_timed_steps(engine, b, k, max_tokens, speculation=True) for k in range(num_drafts + 1)]
            rows.append([seconds for seconds, _ in timed])
            drafts.append([drafted for _, drafted in timed])
            plain.append(_timed_steps(engine, b, 0, max_tokens, speculation=False)[0])
    finally:
        engine.policy = policy
        reset_counters(engine)
    rows, plain = np.array(rows), np.array(plain)
    rows[:, 0] = np.maximum(rows[:, 0], plain)   # k = 0 beside the drafter does at least a plain step's work
    policy.costs = StepCosts(tuple(sizes), rows, np.array(drafts), plain)
    log.info("adaptive draft length: step costs measured in %.1f s (ms per step, B sequences verifying k drafts "
             "each, drafter included, then none in the drafter; then the drafts a verify step had):\n%s",
             time.perf_counter() - start, policy.costs.table())
    short = [k for k in range(1, num_drafts + 1) if policy.costs.drafts[:, k].min() < 0.8 * k]
    if short:   # a drafter that proposes fewer than asked (n-gram on the measurement's made-up prompts)
        log.warning("adaptive draft length: the drafter proposed fewer drafts than asked while k = %s was timed: "
                    "those costs are low, which favours larger k", ", ".join(map(str, short)))
    return policy.costs


def _timed_steps(engine: SpecEngine, batch: int, k: int, max_tokens: int, speculation: bool) -> tuple[float, float]:
    """Seconds per step of `batch` sequences decoding with k drafts each (out of the drafter when not
    `speculation`), and the drafts a verify step had; they are aborted after."""
    engine.policy = DraftPolicy(k, adaptive=False)
    vocab, device = engine.executor.config.vocab_size, engine.executor.device
    ids = [f"step-cost-{batch}-{k}-{speculation}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [(13 * i + j + 1) % vocab for j in range(4)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculation=speculation))
    for _ in range(1 + COST_SETTLE):   # the prefill, then decoding until drafts are verified
        engine.step()
    _sync(device)
    before, ends = (engine.stats.drafted, engine.stats.verify_steps), [time.perf_counter()]
    for _ in range(COST_STEPS):       # (in a steady run of steps each one's wall time is the device's step time)
        engine.step()
        ends.append(time.perf_counter())
    _sync(device)
    ends[-1] = time.perf_counter()
    seconds = float(np.median(np.diff(ends)))
    verified = engine.stats.verify_steps - before[1]
    drafted = (engine.stats.drafted - before[0]) / verified if verified else 0.0
    for rid in ids:
        engine.abort(rid)
    while engine.has_work:
        engine.step()
    return seconds, drafted


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mixed_steps(engine: SpecEngine, k: int) -> None:
    """Each batch bucket's mixed steps, with k drafts per decoder and without (the steps while a drafter is away)."""
    chunk = engine.scheduler.config.prefill_chunk
    prefills = [(n, 1) for n in PREFILL_SIZES if n <= chunk] + [(max(1, chunk // 2), 4)]
    for bucket in tqdm(buckets_for(engine.scheduler.config.max_running), desc="warming up", unit="bucket",
                       leave=False):
        for drafter in ([EchoDrafter(k)] if k else []) + [None]:
            engine.drafter = drafter
            for size, count in prefills:
                _mixed_step(engine, bucket - 1, size, count)


def _short_generations(engine: SpecEngine) -> None:
    vocab, room = engine.executor.config.vocab_size, engine.max_len - 8
    lengths = sorted({min(n, room) for n in (3, 17, 70)})
    prompts = [[(7 * i + j) % vocab for j in range(n)] for i, n in enumerate(lengths)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.7, min_p=0.05, repetition_penalty=1.1, logprobs=2, seed=2,
                             ignore_eos=True)]
    engine.generate(prompts, params[:len(prompts)])


def _chunked_prefill(engine: SpecEngine) -> None:
    """When serving can reach the chunked GDN path (prefill chunk, token budget and context): one prompt of
    CHUNKED_PREFILL_MIN_TOKENS tokens alone, so that its first chunk is all of it (the one-sequence call), then,
    where the token budget holds a short prompt beside such a chunk, the two in one step (the call over several
    sequences, with host offsets: always eager); else nothing."""
    config, size = engine.scheduler.config, CHUNKED_PREFILL_MIN_TOKENS
    if min(engine.max_len - 4, config.prefill_chunk, config.max_batched_tokens) < size:
        return
    vocab, params = engine.executor.config.vocab_size, SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate([[(3 * j + 1) % vocab for j in range(size)]], [params])
    if config.max_batched_tokens >= size + 16 and config.max_running >= 2:   # other tokens: no cached prefix
        engine.generate([[(3 * j + 2) % vocab for j in range(size)], [(5 * j + 2) % vocab for j in range(16)]],
                        [params, params])


def _mixed_step(engine: SpecEngine, decoders: int, prefill: int, count: int) -> None:
    """`decoders` sequences decoding (verifying drafts when k > 0), then one step that adds `count` prompts of
    `prefill` tokens beside them (as many chunks as the token budget takes); all of them are aborted after."""
    vocab, config = engine.executor.config.vocab_size, engine.scheduler.config
    decoders = min(decoders, config.max_running - 1)
    count = max(1, min(count, config.max_running - decoders))
    prefill = max(1, min(prefill, engine.max_len - 8, config.max_batched_tokens - decoders * (engine.num_drafts + 1)))
    ids = [f"warm-up-{decoders}-{prefill}-{count}-{i}" for i in range(decoders + count)]
    decoding = SamplingParams(max_tokens=32, ignore_eos=True)  # still drafting k after three steps
    for i, rid in enumerate(ids[:decoders]):
        engine.add_request(rid, [(11 * i + j) % vocab for j in range(3)], decoding)
    for _ in range(2 if decoders else 0):  # the prefill, then a verify step: all of them are decoding
        engine.step()
    for i, rid in enumerate(ids[decoders:]):
        engine.add_request(rid, [(5 * j + i + 1) % vocab for j in range(prefill)],
                           SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    for rid in ids:
        engine.abort(rid)
