"""Cache tensors the model reads and writes: a paged KV cache for full-attention layers and slotted GDN state.

Ownership of blocks and slots (who gets which) belongs to the verifier's allocator; these are only tensors.
Each cache has one extra row no sequence owns: KV block `num_blocks` and GDN slot `num_gdn_slots`, where the
padding tokens / padding sequences of a CUDA-graph bucket write.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.causal_conv1d import conv_state_columns

from .model_config import ModelConfig


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per attention layer [num_blocks + 1 scratch, block_size, NKV, D]
    v: list[torch.Tensor]
    block_size: int

    @property
    def num_blocks(self) -> int:
        """Blocks sequences may own (the scratch block is not counted)."""
        return self.k[0].shape[0] - 1 if self.k else 0

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block dst[i] := block src[i] in every layer (src and dst distinct)."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]


def pending_ring_rows(max_drafts: int) -> int:
    """Rows of a sequence's ring of draft inputs: a step of 1 + d tokens stashes d drafts and replays up to
    max_drafts of the last step's, and the two sets must not alias (kernels/gated_delta_rule/reference.py)."""
    return 2 * (1 + max_drafts)


@dataclass
class GDNCache:
    recurrent: list[torch.Tensor]  # per GDN layer [num_slots + 1 scratch, HV, K, V] fp32
    pending: list[torch.Tensor]    # per GDN layer [num_slots + 1, 2 (1 + max_drafts), HK*K + HV*V + 2*HV] draft inputs
    conv: list[torch.Tensor]       # per GDN layer [num_slots + 1 scratch, conv_dim, kernel - 1 + max_drafts] (a
    #                                column's channels contiguous: kernels.causal_conv1d.conv_state_columns)
    scratch_slot: int = 0          # the slot padding sequences use (the last one)

    def reset(self, slot: int) -> None:
        """Zero a sequence's state before it starts (a new prompt or a recompute after preemption). Its pending
        drafts need no reset: a fresh sequence replays none (read offset 0)."""
        for r, c in zip(self.recurrent, self.conv):
            r[slot].zero_()
            c[slot].zero_()

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot dst[i] := slot src[i] (recurrent and conv state; a checkpoint's pending drafts are none)."""
        for r, c in zip(self.recurrent, self.conv):
            r[dst] = r[src]
            c[dst] = c[src]


@dataclass
class ModelCaches:
    kv: KVCache
    gdn: GDNCache
    layer_slot: dict[int, int]  # model layer index -> index into kv.* or gdn.* lists

    @staticmethod
    def allocate(config: ModelConfig, num_blocks: int, block_size: int, num_gdn_slots: int,
                 max_drafts: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> "ModelCaches":
        shapes = CacheShapes(config, block_size, max_drafts)
        kv_shape = (num_blocks + 1, *shapes.kv_block)
        attn, gdn = config.attention_layers, config.gdn_layers
        kv = KVCache(k=[torch.zeros(kv_shape, dtype=dtype, device=device) for _ in attn],
                     v=[torch.zeros(kv_shape, dtype=dtype, device=device) for _ in attn], block_size=block_size)
        n = num_gdn_slots + 1
        states = GDNCache(recurrent=[torch.zeros((n, *shapes.recurrent), dtype=torch.float32, device=device)
                                     for _ in gdn],
                          pending=[torch.zeros((n, *shapes.pending), dtype=dtype, device=device) for _ in gdn],
                          conv=[conv_state_columns(n, *shapes.conv, dtype=dtype, device=device) for _ in gdn],
                          scratch_slot=num_gdn_slots)
        layer_slot = {layer: i for i, layer in enumerate(attn)} | {layer: i for i, layer in enumerate(gdn)}
        return ModelCaches(kv=kv, gdn=states, layer_slot=layer_slot)


class CacheShapes:
    """The per-block and per-slot shapes of `ModelCaches`, and what one KV block or one GDN slot costs in bytes
    over all layers (what sizing the caches from the device's memory divides by)."""

    def __init__(self, config: ModelConfig, block_size: int, max_drafts: int = 0):
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        head_k, head_v = config.linear_key_head_dim, config.linear_value_head_dim
        self.config = config
        self.kv_block = (block_size, config.num_key_value_heads, config.head_dim)           # K or V, one layer
        self.recurrent = (hv, head_k, head_v)                                                # fp32
        self.pending = (pending_ring_rows(max_drafts), hk * head_k + hv * (head_v + 2))
        self.conv = (config.gdn_conv_dim, config.linear_conv_kernel_dim - 1 + max_drafts)

    def block_bytes(self, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """One KV block (K and V) over every full-attention layer, or over `num_layers` such layers (a drafter's)."""
        layers = len(self.config.attention_layers) if num_layers is None else num_layers
        return 2 * layers * math.prod(self.kv_block) * dtype.itemsize

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's GDN state (recurrent fp32, pending drafts, conv window) over every GDN layer."""
        per_layer = (math.prod(self.recurrent) * torch.float32.itemsize
                     + (math.prod(self.pending) + math.prod(self.conv)) * dtype.itemsize)
        return len(self.config.gdn_layers) * per_layer
