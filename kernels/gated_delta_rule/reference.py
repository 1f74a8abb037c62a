"""Pure-torch gated delta rule over a ragged batch, with speculative state slots.

Math, per value head h and token t (state S is [K, V], fp32):
    g_t = -exp(A_log) * softplus(a_t + dt_bias)   beta_t = sigmoid(b_t)        # gating, fp32
    q, k <- l2norm(q), l2norm(k) (eps 1e-6);  q <- q / sqrt(K)
    S <- S * exp(g_t)                        # gated decay, g_t <= 0
    delta = beta_t * (v_t - S^T k_t)          # delta rule error
    S <- S + k_t delta^T
    o_t = S^T q_t
Key heads repeat to value heads: value head h reads key head h // (HV // HK).

State slots (DESIGN §3.4): each sequence owns `state[slot]`, a group of 1 + max_drafts states. A sequence's
step of n tokens whose last `d` are drafts starts from `state[slot, read_offset]` and writes the state after
token n-1-d+i into `state[slot, i]` for i = 0..d. Plain decoding and prefill use d = 0, read_offset = 0.
Sequences of length 0 (padding in a CUDA-graph bucket) change nothing.

This reference loops over the max_seqlen token steps only (all sequences advance together, masked), and never
reads a device value back to the host, so it also runs inside a CUDA graph.
"""
import torch
import torch.nn.functional as F

from kernels.ragged import padded_token_index


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [T, HV] log-decay, beta [T, HV]) in fp32 from the raw projections a, b [T, HV]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gated_delta_rule_ref(
    q: torch.Tensor,               # [T, HK, K]
    k: torch.Tensor,               # [T, HK, K]
    v: torch.Tensor,               # [T, HV, V]
    a: torch.Tensor,               # [T, HV] raw decay projection
    b: torch.Tensor,               # [T, HV] raw beta projection
    A_log: torch.Tensor,           # [HV]
    dt_bias: torch.Tensor,         # [HV]
    state: torch.Tensor,           # [num_slots, 1 + max_drafts, HV, K, V] fp32, updated in place
    cu_seqlens: torch.Tensor,      # [B + 1] int32
    slots: torch.Tensor,           # [B] int32
    read_offsets: torch.Tensor,    # [B] int32
    num_drafts: torch.Tensor,      # [B] int32
    max_seqlen: int,
) -> torch.Tensor:                 # [T, HV, V] in v's dtype
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    group = num_v_heads // num_k_heads
    g, beta = gdn_gating(a, b, A_log, dt_bias)                                           # [T, HV] each
    qf = l2norm(q.float()).repeat_interleave(group, dim=1) * head_k ** -0.5              # [T, HV, K]
    kf = l2norm(k.float()).repeat_interleave(group, dim=1)                               # [T, HV, K]
    index, valid = padded_token_index(cu_seqlens, max_seqlen)                            # [B, L]
    slot, lens = slots.long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    first_saved = lens - 1 - num_drafts.long()                                           # [B]
    last_state = state.shape[1] - 1
    s = state[slot, read_offsets.long()].clone()                                         # [B, HV, K, V]
    out = torch.zeros(num_tokens + 1, num_v_heads, head_v, dtype=torch.float32, device=v.device)
    for t in range(max_seqlen):
        rows, live = index[:, t], valid[:, t]                                            # [B]
        decayed = s * g[rows].exp()[:, :, None, None]
        delta = beta[rows][:, :, None] * (v[rows].float() - torch.einsum("bhkv,bhk->bhv", decayed, kf[rows]))
        stepped = decayed + kf[rows][:, :, :, None] * delta[:, :, None, :]               # [B, HV, K, V]
        s = torch.where(live[:, None, None, None], stepped, s)
        out[torch.where(live, rows, num_tokens)] = torch.einsum("bhkv,bhk->bhv", s, qf[rows])
        save = live & (t >= first_saved)                                                 # [B]
        dest = (t - first_saved).clamp(0, last_state)                                    # [B]
        state[slot, dest] = torch.where(save[:, None, None, None], s, state[slot, dest])
    return out[:num_tokens].to(v.dtype)
