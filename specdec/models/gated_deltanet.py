"""Gated DeltaNet token mixer (docs/architecture.md, "The model").

x → in_proj_qkv → causal conv1d (kernel 4, depthwise, SiLU) over [q, k, v] only → gated delta rule
with beta = sigmoid(b), g = -exp(A_log) · softplus(a + dt_bias) in fp32 (computed inside the kernel from the
raw a, b projections) → w · rmsnorm(o) · silu(z) → out_proj.
Qwen3-Next's fused in_proj_qkvz / in_proj_ba are split into these projections by the loader; the four run as
one GEMM here (FusedLinear), their outputs read in place as column slices.
Steps without drafts whose longest sequence has at least CHUNKED_PREFILL_MIN_TOKENS tokens run the chunked
prefill kernel (fla-core's when installed); every other step the fused recurrent one. The threshold is where the
two cross on an H100 at the 4B shape (whole eager prefill steps, `bench/profile_steps.py` prints both): fla-core
0.6.0's chunk call has a large fixed host cost per layer, while the pipelined recurrent kernel's time grows with the
longest sequence. One sequence alone (a prompt chunk in its prefill bucket) of CHUNKED_ONE_MIN_TOKENS or more takes
the chunked kernel too (fla-core's, when installed), through a fixed-length call that needs no host offsets: CUDA
graphs capture it, so its host cost is paid once, at capture. A step that mixes prompt chunks with decoding
sequences runs its chunk lanes (`forward_batch.py`) through that fixed-length call, masked to their rows, and the
rest through the recurrent kernel.
"""
import torch
from torch import nn

from kernels.causal_conv1d import causal_conv1d
from kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_lanes, gated_delta_rule_prefill, launch_config

from .forward_batch import ForwardBatch
from .fused_linear import FusedLinear
from .model_config import ModelConfig
from .norms import GatedRMSNorm

CHUNKED_PREFILL_MIN_TOKENS = 1536  # below the interpolated crossing (~1800), above the measured 512
CHUNKED_ONE_MIN_TOKENS = 512       # one sequence alone (a prefill bucket's graph captures it): no host cost


def replays_change_launch(num_seqs: int, max_drafts: int) -> bool:
    """Does the recurrent kernel run a single-token step of `num_seqs` sequences otherwise when it knows that none
    replays drafts (an engine that verifies up to `max_drafts`)? Then that step has a CUDA graph of its own
    (cuda_graph_runner.py)."""
    return max_drafts > 0 and launch_config(num_seqs, 1) != launch_config(num_seqs, 1 + max_drafts)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k, self.head_v = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = config.gdn_key_dim, config.gdn_value_dim
        conv_dim = config.gdn_conv_dim
        self.in_proj_qkv = nn.Linear(hidden, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d_weight = nn.Parameter(torch.zeros(conv_dim, config.linear_conv_kernel_dim))  # [C, W]
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.in_proj = FusedLinear(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, recurrent: torch.Tensor, pending: torch.Tensor,
                conv: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        ragged = (batch.cu_seqlens, batch.gdn_slots, batch.gdn_read_offsets, batch.num_drafts)
        qkv, z, b, a = self.in_proj(x)       # column views of one [T, conv_dim + value_dim + 2 HV] GEMM
        mixed = causal_conv1d(qkv, self.conv1d_weight, conv, *ragged, batch.max_seqlen)  # [T, conv_dim]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)  # row-strided views
        q = q.view(num_tokens, self.num_k_heads, self.head_k)
        k = k.view(num_tokens, self.num_k_heads, self.head_k)
        v = v.view(num_tokens, self.num_v_heads, self.head_v)
        one_sequence = (batch.num_seqs == 1 and batch.max_num_drafts == 0
                        and batch.max_seqlen >= CHUNKED_ONE_MIN_TOKENS)
        chunked = one_sequence or (batch.max_num_drafts == 0 and batch.max_seqlen >= CHUNKED_PREFILL_MIN_TOKENS)
        if one_sequence:
            rule, extra = gated_delta_rule_prefill, {"one_sequence": True}
        elif chunked:
            rule, extra = gated_delta_rule_prefill, {"cu_seqlens_host": batch.cu_seqlens_host}
        elif batch.chunk_lanes is not None:
            rule, extra = gated_delta_rule_lanes, {"chunk_lanes": batch.chunk_lanes}
        else:
            rule, extra = gated_delta_rule, {"max_replays": batch.max_replays}
        o = rule(q, k, v, a, b, self.A_log, self.dt_bias, recurrent, pending, *ragged, batch.positions,
                 batch.max_seqlen, **extra)                                            # [T, HV, V]
        z = z.view(num_tokens, self.num_v_heads, self.head_v)                          # row-strided
        return self.out_proj(self.norm(o, z).reshape(num_tokens, self.value_dim))
