"""Pure-torch gated delta rule over a ragged batch, with speculative state slots.

Math, per value head h and token t (state S is [K, V], fp32):
    q, k <- l2norm(q), l2norm(k) (eps 1e-6);  q <- q / sqrt(K)
    S <- S * exp(g_t)                        # gated decay, g_t <= 0
    delta = beta_t * (v_t - S^T k_t)          # delta rule error
    S <- S + k_t delta^T
    o_t = S^T q_t
Key heads repeat to value heads: value head h reads key head h // (HV // HK).

State slots (DESIGN §3.4): each sequence owns `state[slot]`, a group of 1 + max_drafts states. A sequence's
step of n tokens whose last `d` are drafts starts from `state[slot, read_offset]` and writes the state after
token n-1-d+i into `state[slot, i]` for i = 0..d. Plain decoding and prefill use d = 0, read_offset = 0.
"""
import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_ref(
    q: torch.Tensor,             # [T, HK, K]
    k: torch.Tensor,             # [T, HK, K]
    v: torch.Tensor,             # [T, HV, V]
    g: torch.Tensor,             # [T, HV] fp32 log-decay
    beta: torch.Tensor,          # [T, HV]
    state: torch.Tensor,         # [num_slots, 1 + max_drafts, HV, K, V] fp32, updated in place
    cu_seqlens: list[int],       # [B + 1] host ints
    slots: list[int],            # [B]
    read_offsets: list[int],     # [B]
    num_drafts: list[int],       # [B]
) -> torch.Tensor:               # [T, HV, V] in v's dtype
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads = v.shape[1]
    group = num_v_heads // num_k_heads
    qf = l2norm(q.float()).repeat_interleave(group, dim=1) * head_k ** -0.5  # [T, HV, K]
    kf = l2norm(k.float()).repeat_interleave(group, dim=1)                    # [T, HV, K]
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(num_tokens, num_v_heads, v.shape[2], dtype=torch.float32, device=v.device)
    for b, slot in enumerate(slots):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        first_saved = end - 1 - num_drafts[b]
        s = state[slot, read_offsets[b]].clone()                              # [HV, K, V]
        for t in range(start, end):
            s = s * gf[t].exp()[:, None, None]
            delta = bf[t][:, None] * (vf[t] - torch.einsum("hkv,hk->hv", s, kf[t]))  # [HV, V]
            s = s + kf[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
            if t >= first_saved:
                state[slot, t - first_saved] = s
    return out.to(v.dtype)
