"""Pure-torch gated delta rule over a ragged batch, with the deferred commit of draft tokens.

Math, per value head h and token t (state S is [K, V], fp32):
    g_t = -exp(A_log) * softplus(a_t + dt_bias)   beta_t = sigmoid(b_t)        # gating, fp32
    q, k <- l2norm(q), l2norm(k) (eps 1e-6);  q <- q / sqrt(K)
    S <- S * exp(g_t)                        # gated decay, g_t <= 0
    delta = beta_t * (v_t - S^T k_t)          # delta rule error
    S <- S + k_t delta^T
    o_t = S^T q_t
Key heads repeat to value heads: value head h reads key head h // (HV // HK).

Deferred commit (bench/gdn_state_traffic.md, design C): each sequence owns one state, `state[slot]`, and a ring of
R = 2 (1 + max_drafts) pending rows, `pending[slot]`, each the raw inputs of one draft token [k | v | a | b]
(HK*K + HV*V + 2*HV values, the inputs' dtype), kept at its position mod R. A step of n tokens whose last d are
drafts, after a step whose first j = read_offset drafts were accepted:
  1. replays those j drafts from the ring (positions p0 - j .. p0 - 1, p0 the step's first position): committed now;
  2. runs its n tokens, and writes the state after token n-1-d (its last non-draft token) into state[slot];
  3. stashes its d drafts' raw inputs in the ring; the next step replays the accepted ones.
So the state is read once and written once per step, whatever k. Plain decoding and prefill have d = 0 and leave
nothing to replay. A step's n tokens are its last emitted token plus its drafts (n = 1 + d) whenever d > 0, so
the ring entries it writes never alias the j it replays (n + j - 1 < R). Sequences of length 0 (padding in a
CUDA-graph bucket) replay nothing and change nothing.
"""
import torch
import torch.nn.functional as F


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
    state: torch.Tensor,           # [num_slots, HV, K, V] fp32, updated in place
    pending: torch.Tensor,         # [num_slots, R, HK*K + HV*V + 2*HV] raw draft inputs, updated in place
    cu_seqlens: torch.Tensor,      # [B + 1] int32
    slots: torch.Tensor,           # [B] int32
    read_offsets: torch.Tensor,    # [B] int32 drafts of the last step accepted (replayed first)
    num_drafts: torch.Tensor,      # [B] int32 trailing draft tokens in this step (stashed)
    positions: torch.Tensor,       # [T] int64 absolute position of each token
    max_seqlen: int,
    *, replay_only: bool = False,  # fold the replayed drafts into state[slot] and stop (before a chunked prefill)
) -> torch.Tensor:                 # [T, HV, V] in v's dtype (zeros for replay_only)
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    group, ring = num_v_heads // num_k_heads, pending.shape[1]
    cu = cu_seqlens.long()
    bos, eos = cu[:-1], cu[1:]                                                           # [B]
    live = eos > bos
    j = torch.where(live, read_offsets.long(), 0)
    pos = torch.cat([positions.long(), positions.new_zeros(1)])                         # row T: padding
    pos0 = torch.where(live, pos[bos], 0)
    first_saved = eos - 1 - num_drafts.long()
    slot = slots.long()
    raw = torch.cat([k.reshape(num_tokens, -1), v.reshape(num_tokens, -1), a, b], dim=1)  # [T, W] ring rows
    raw = torch.cat([raw, raw.new_zeros(1, raw.shape[1])])
    qf = l2norm(q.float()).repeat_interleave(group, dim=1) * head_k ** -0.5              # [T, HV, K]
    qf = torch.cat([qf, qf.new_zeros(1, *qf.shape[1:])])
    split = [num_k_heads * head_k, num_v_heads * head_v, num_v_heads, num_v_heads]
    s = state[slot].clone()                                                              # [B, HV, K, V]
    out = torch.zeros(num_tokens + 1, num_v_heads, head_v, dtype=torch.float32, device=v.device)
    # The virtual tokens of each sequence, u = 0, 1, ...: its j replayed drafts (from the ring), then its own tokens.
    # Their inputs are gathered and prepared for every u at once; only the recurrence walks u. The number of u's is
    # read on the host (cheap on a CPU, where this runs in production; on CUDA the Triton kernel runs instead and
    # this is its test oracle).
    steps = int((j + (0 if replay_only else eos - bos)).max()) if j.numel() else 0
    us = torch.arange(steps, device=q.device)                                            # [U]
    replayed = us[None, :] < j[:, None]                                                  # [B, U]
    t = bos[:, None] + us[None, :] - j[:, None]                                          # [B, U] token row
    real = (us[None, :] >= j[:, None]) & (t < eos[:, None]) & (not replay_only)          # [B, U]
    row = torch.where(real, t, num_tokens)                                               # [B, U] (T: padding)
    ring_rows = pending[slot[:, None], (pos0[:, None] - j[:, None] + us[None, :]).clamp(min=0) % ring]
    rows = torch.where(replayed[:, :, None], ring_rows, raw[row])                       # [B, U, W]
    kk, vv, aa, bb = rows.split(split, dim=2)
    kf = l2norm(kk.reshape(*row.shape, num_k_heads, head_k).float()).repeat_interleave(group, dim=2)  # [B, U, HV, K]
    g, beta = gdn_gating(aa, bb, A_log, dt_bias)                                         # [B, U, HV]
    moves = replayed | real                                                              # [B, U]
    # A virtual token that does not move its sequence (padding past its end) decays by 1 and writes nothing
    # (beta 0, its inputs are zeros): the step below then leaves that state exactly as it was.
    decay = torch.where(moves[:, :, None], g.exp(), 1.0)                                 # [B, U, HV]
    beta = torch.where(moves[:, :, None], beta, 0.0)                                     # [B, U, HV]
    vf = vv.reshape(*row.shape, num_v_heads, head_v).float()                            # [B, U, HV, V]
    qq = qf[row]                                                                         # [B, U, HV, K]
    commit_at = torch.where(live, first_saved - bos + j, -1)                             # [B] u of the last kept token
    commit_steps = set(commit_at.tolist())                                               # read once (a CPU's path)
    outs = []
    for u in range(steps):
        k_u = kf[:, u, :, None, :]                                                       # [B, HV, 1, K]
        decayed = s * decay[:, u, :, None, None]
        delta = beta[:, u, :, None] * (vf[:, u] - (k_u @ decayed)[:, :, 0])              # [B, HV, V]
        stepped = decayed + k_u.transpose(-1, -2) * delta[:, :, None, :]                # [B, HV, K, V]
        # (a padding step leaves a finite state as it was; replay_only writes every live state back at the end,
        # so there the mask keeps a non-finite one too)
        s = torch.where(moves[:, u, None, None, None], stepped, s) if replay_only else stepped
        outs.append((qq[:, u, :, None, :] @ s)[:, :, 0])                                 # [B, HV, V]
        if u in commit_steps:
            commit = ((commit_at == u) & real[:, u])[:, None, None, None]
            state[slot] = torch.where(commit, s, state[slot])
    if outs:
        out[row.reshape(-1)] = torch.stack(outs, dim=1).reshape(-1, num_v_heads, head_v)
    stash = real & (t > first_saved[:, None])                                            # [B, U] drafts to keep
    if stash.any():
        b_idx, u_idx = stash.nonzero(as_tuple=True)
        entry = (pos0[b_idx] + t[b_idx, u_idx] - bos[b_idx]) % ring
        pending[slot[b_idx], entry] = rows[b_idx, u_idx]
    if replay_only:
        state[slot] = torch.where(live[:, None, None, None], s, state[slot])
    return out[:num_tokens].to(v.dtype)
