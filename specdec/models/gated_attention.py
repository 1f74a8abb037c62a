"""Gated full attention: q_proj yields [query | gate] interleaved per head; zero-centred q/k norms before
partial RoPE; paged KV cache; output multiplied by sigmoid(gate) before o_proj (DESIGN §2)."""
import torch
from torch import nn

from kernels.paged_attention import paged_attention, write_kv

from .forward_batch import ForwardBatch
from .model_config import ModelConfig
from .norms import ZeroCentredRMSNorm
from .rotary import PartialRotary


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * d * 2, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        self.q_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, config.rms_norm_eps)
        self.rotary = PartialRotary(d, config.rotary_dim, config.rope_theta)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        query_gate = self.q_proj(x).view(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = query_gate.split(self.head_dim, dim=-1)            # [T, NH, D] each
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = self.rotary.cos_sin(batch.positions)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, batch.positions, batch.block_tables, batch.cu_seqlens,
                            batch.max_seqlen, self.head_dim ** -0.5)  # [T, NH, D]
        o = o.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(o)
