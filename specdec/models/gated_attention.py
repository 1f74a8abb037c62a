"""Gated full attention: q_proj yields [query | gate] interleaved per head; zero-centred q/k norms before
partial RoPE (one kernel each, norm_rope); paged KV cache; output multiplied by sigmoid(gate) before o_proj
(docs/architecture.md, "The model"). q_proj, k_proj and v_proj run as one GEMM (FusedLinear)."""
import torch
from torch import nn

from kernels.paged_attention import paged_attention, write_kv
from kernels.rotary import norm_rope

from .forward_batch import ForwardBatch
from .fused_linear import FusedLinear
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
        self.rotary = PartialRotary(config.rotary_dim, config.rope_theta)
        self.qkv_proj = FusedLinear(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        num_tokens, d = x.shape[0], self.head_dim
        query_gate, k, v = self.qkv_proj(x)                          # column views of one GEMM
        q, gate = query_gate.view(num_tokens, self.num_heads, 2 * d).split(d, dim=-1)  # [T, NH, D] each
        inv_freq = self.rotary.inv_freq_on(x.device)
        q = norm_rope(q, self.q_norm.weight, self.q_norm.eps, batch.positions, inv_freq)
        k = norm_rope(k.view(num_tokens, self.num_kv_heads, d), self.k_norm.weight, self.k_norm.eps,
                      batch.positions, inv_freq)
        write_kv(k, v.view(num_tokens, self.num_kv_heads, d), k_cache, v_cache, batch.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, batch.positions, batch.block_tables, batch.cu_seqlens,
                            batch.max_seqlen, d ** -0.5, min_context=batch.min_context)   # [T, NH, D]
        return self.o_proj((o * torch.sigmoid(gate)).reshape(num_tokens, -1))
