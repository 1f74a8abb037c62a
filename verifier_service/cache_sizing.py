"""How large the verifier's caches are: a shared pool of KV blocks, one GDN / conv state slot per running sequence,
and the longest sequence they serve.

- `--kv-blocks N`: N blocks, as given.
- On a GPU (one process): sized from memory. After the weights are loaded, two eager steps of the extreme shapes
  run on throw-away caches (a prompt chunk of `max_batched_tokens` tokens, and `max_running` sequences verifying
  k drafts with every logit row), and their activation peak is measured. The caches get what
  `--gpu-memory-utilization` leaves (specdec/models/memory_budget.py) once that peak is set aside twice (once for
  eager steps, once for the CUDA graphs' shared pool) with the sampler's buffers: `max_running` slots, the rest in
  KV blocks. An in-process MTP drafter's KV block for the same tokens is counted with each block.
- On the CPU and under tensor parallelism: `max_running` sequences of min(context, 4096) tokens, as a pool (one
  sequence may hold more than its share).

The longest sequence is `--max-context` (default: the model's max_position_embeddings), at most what the pool
holds. When running sequences outgrow the pool, the scheduler preempts the youngest by recompute.
"""
from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass

import torch

from specdec.models.batch_staging import StepPlan
from specdec.models.caches import CacheShapes
from specdec.models.loader import LoadedModel, parse_dtype
from specdec.models.memory_budget import GIB, DeviceMemory
from specdec.models.model_config import ModelConfig

from .model_runner import ModelRunner

log = logging.getLogger(__name__)
STATIC_TOKENS_PER_SEQ = 4096     # the CPU's pool: this many tokens per running sequence
SAMPLER_ROW_BUFFERS = 4          # fp32 [rows, vocab] buffers the sampler may hold at once (probabilities, noise...)


@dataclass(frozen=True)
class CacheSize:
    num_blocks: int
    num_slots: int          # GDN / conv state slots: the most sequences running at once
    max_context: int        # the longest sequence (prompt + output) served
    block_size: int
    summary: str            # what the start-up log says


@dataclass(frozen=True)
class CacheRequest:
    """What the sizing needs to know of the verifier's configuration."""
    max_context: int              # 0: the model's max_position_embeddings
    max_running: int
    max_batched_tokens: int
    max_drafts: int
    block_size: int
    kv_blocks: int                # > 0: exactly this many
    gpu_memory_utilization: float
    dtype: str = "float32"        # the caches' (the target's) dtype
    drafter_layers: int = 0       # an in-process MTP drafter's attention layers (KV for the same tokens)
    num_checkpoints: int = 0      # GDN / conv state rows for prefix-cache checkpoints, beside the running slots


def size_caches(request: CacheRequest, config: ModelConfig, device: torch.device, loaded: LoadedModel | None,
                parallel: bool = False) -> CacheSize:
    """`loaded`: the target in this process; `parallel`: tensor parallelism (the ranks hold the target: the pool is
    not sized from memory)."""
    r = request
    wanted_context = min(r.max_context or config.max_position_embeddings, config.max_position_embeddings)
    dtype = parse_dtype(r.dtype) if parallel else loaded.model.embed_tokens.weight.dtype
    shapes = CacheShapes(config, r.block_size, r.max_drafts)
    block_bytes = shapes.block_bytes(dtype) + shapes.block_bytes(dtype, r.drafter_layers)
    slots_bytes = (r.max_running + r.num_checkpoints) * shapes.slot_bytes(dtype)
    if r.kv_blocks > 0:
        blocks, how = r.kv_blocks, "--kv-blocks"
    elif device.type != "cuda" or parallel:
        blocks = r.max_running * math.ceil(min(wanted_context, STATIC_TOKENS_PER_SEQ) / r.block_size)
        how = (f"{r.max_running} sequences of {min(wanted_context, STATIC_TOKENS_PER_SEQ)} tokens"
               + (" (tensor parallel: not sized from memory)" if parallel else ""))
    else:
        activations = measure_activations(loaded, r, device)
        sampler = SAMPLER_ROW_BUFFERS * r.max_running * (1 + r.max_drafts) * config.vocab_size * 4
        memory = DeviceMemory.read(device)
        room, bound = memory.cache_bytes(r.gpu_memory_utilization, 2 * activations + sampler)
        blocks = (room - slots_bytes) // block_bytes
        need = math.ceil(r.max_batched_tokens / r.block_size) + r.max_running
        if blocks < need:
            raise ValueError(
                f"not enough GPU memory for the caches: {room / GIB:.2f} GiB left "
                f"({memory.describe(r.gpu_memory_utilization)}, activations {activations / GIB:.2f} GiB x 2), "
                f"{r.max_running} GDN slots and {r.num_checkpoints} checkpoints take {slots_bytes / GIB:.2f} GiB and at least {need} KV blocks of "
                f"{block_bytes / 2**20:.2f} MiB are needed: raise --gpu-memory-utilization, or lower --max-running / "
                f"--max-batched-tokens")
        how = (f"{memory.describe(r.gpu_memory_utilization)}, activation peak {activations / GIB:.2f} GiB (x 2) "
               f"and sampler {sampler / GIB:.2f} GiB set aside"
               + ("; bounded by FREE memory: another process holds more than its share" if bound == "free memory"
                  else ""))
    if r.kv_blocks <= 0:   # never more than max_running sequences of the whole context can use
        blocks = min(blocks, r.max_running * math.ceil(wanted_context / r.block_size))
    max_context = min(wanted_context, blocks * r.block_size)
    if max_context < wanted_context:
        log.warning("the KV pool holds %d tokens: sequences are limited to that, not %d", max_context, wanted_context)
    summary = (f"caches: {blocks:,} KV blocks of {r.block_size} ({blocks * r.block_size:,} tokens, "
               f"{blocks * block_bytes / GIB:.2f} GiB) and {r.max_running} GDN state slots + {r.num_checkpoints} "
               f"prefix-cache checkpoints ({slots_bytes / GIB:.2f} GiB); up to {r.max_running} sequences, the longest {max_context:,} tokens, "
               f"{blocks * r.block_size // r.max_running:,} tokens each when all run ({how})")
    return CacheSize(blocks, r.max_running, max_context, r.block_size, summary)


def measure_activations(loaded: LoadedModel, r: CacheRequest, device: torch.device) -> int:
    """Peak bytes two eager steps add above the weights and their own throw-away caches: one prompt chunk of
    max_batched_tokens tokens, and max_running sequences of 1 + k tokens with every logit row."""
    chunk_blocks = math.ceil(r.max_batched_tokens / r.block_size)
    runner = ModelRunner(loaded, num_blocks=max(chunk_blocks, r.max_running), block_size=r.block_size,
                         max_seqs=r.max_running, max_drafts=r.max_drafts, device=device,
                         max_model_len=chunk_blocks * r.block_size, max_batched_tokens=r.max_batched_tokens,
                         enforce_eager=True)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    prompt = StepPlan.from_lists([[1] * r.max_batched_tokens], [0], [list(range(chunk_blocks))], [0])
    verify_len = 1 + r.max_drafts
    verify = StepPlan.from_lists([[1] * verify_len] * r.max_running, [0] * r.max_running,
                                 [[i] for i in range(r.max_running)], list(range(r.max_running)),
                                 num_drafts=[r.max_drafts] * r.max_running, logits="all")
    for plan in (prompt, verify):
        runner.run(plan)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return peak
