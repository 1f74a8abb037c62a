"""bench/kernels.py sections for the kernels around the GDN rule: paged attention (decode and k + 1 verify tokens
over `context` cached positions), the KV write, q/k norm + partial RoPE, the zero-centred RMSNorm with its
residual add, the gated GDN output norm, silu · up, and the MoE experts (Qwen3-Next shape). Each is timed against
its torch reference at batch B, with the bytes it must move and its fraction of the device-copy roofline.
fla-core has none of these, so there is no fla row.
"""
from __future__ import annotations

import torch
from timing import row, time_ms

from kernels.activation.reference import silu_mul_ref
from kernels.moe.reference import moe_experts_ref
from kernels.paged_attention.reference import paged_attention_ref, write_kv_ref
from kernels.rms_norm.reference import gated_rms_norm_ref, rms_norm_ref
from kernels.rotary.reference import norm_rope_ref

LAYER_4B = dict(hidden=2560, inter=9216, heads=16, kv_heads=4, head_dim=256, rotary=64, hv=32, dv=128,
                experts=512, top_k=10, moe_hidden=2048, moe_inter=512, block=16)
LAYER_SMOKE = dict(hidden=64, inter=96, heads=4, kv_heads=2, head_dim=32, rotary=16, hv=4, dv=16,
                   experts=8, top_k=2, moe_hidden=32, moe_inter=16, block=4)
BF16 = torch.bfloat16


def ours_and_reference(section: str, case: str, ours, ref, moved: int, device, copy_bw: float) -> list[dict]:
    """Rows of our kernel (20 calls, in a CUDA graph) and its torch reference (3, eager: some references read
    lengths back to the host, and a capture that fails that way leaves the CUDA generator in capture mode, which
    breaks every later torch.randn of the run)."""
    rows = []
    for impl, fn, reps, graph in (("ours", ours, 20, True), ("torch reference", ref, 3, False)):
        ms, mode = time_ms(fn, device, reps=reps, graph=graph)
        rows.append(row(section, case, impl, ms, mode, moved, copy_bw))
    return rows


def attention_rows(s: dict, batch: int, n: int, context: int, device, copy_bw: float) -> list[dict]:
    """n query tokens per sequence (1: decode, k + 1: verify) at positions context .. context + n - 1."""
    from kernels.paged_attention.triton_paged_attention import paged_attention_triton
    from kernels.paged_attention.triton_write_kv import write_kv_triton
    d, nkv, bs = s["head_dim"], s["kv_heads"], s["block"]
    width = -(-(context + n) // bs)                                                     # blocks per sequence
    k_cache = torch.randn(batch * width + 1, bs, nkv, d, device=device, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(batch * width, device=device, dtype=torch.int32).view(batch, width)
    t = batch * n
    q = torch.randn(t, s["heads"], d, device=device, dtype=BF16)
    positions = (context + torch.arange(n, device=device)).repeat(batch)               # [T]
    cu = torch.arange(0, t + 1, n, device=device, dtype=torch.int32)
    args = (q, k_cache, v_cache, positions, tables, cu, n, d ** -0.5)
    kv_read = 2 * batch * (context + n) * nkv * d * 2
    case = f"b{batch} n{n} ctx{context}"
    section = "attention-verify" if n > 1 else "attention-decode"
    rows = ours_and_reference(section, case, lambda: paged_attention_triton(*args), lambda: paged_attention_ref(*args),
                 kv_read + 2 * q.numel() * 2, device, copy_bw)
    k, v = torch.randn(t, nkv, d, device=device, dtype=BF16), torch.randn(t, nkv, d, device=device, dtype=BF16)
    slots = (tables[:, context // bs].long().repeat_interleave(n) * bs + positions % bs)   # [T]
    kv_args = (k, v, k_cache, v_cache, slots)
    rows += ours_and_reference("write-kv", case, lambda: write_kv_triton(*kv_args), lambda: write_kv_ref(*kv_args),
                  2 * 2 * k.numel() * 2, device, copy_bw)
    return rows


PREFILL_TUNINGS = (  # paged attention for a prompt chunk: query rows x key tile, warps, pipeline stages
    {}, dict(block_n=64), dict(block_n=64, num_warps=4), dict(rows=128), dict(rows=128, block_n=64),
    dict(num_stages=3), dict(block_n=64, num_stages=3), dict(rows=32, block_n=64, num_warps=4),
    dict(rows=128, num_warps=4), dict(rows=128, block_n=64, num_stages=3))


def attention_prefill_rows(s: dict, chunk: int, context: int, device) -> list[dict]:
    """One sequence's prompt chunk of `chunk` query tokens at positions context .. context + chunk - 1 (keys 0 ..
    context + chunk - 1 in the cache), under each of PREFILL_TUNINGS ({}: the launch rule's choice): ms per call
    in a CUDA graph and TFLOP/s of the causal attention (4 · heads · head_dim per query-key pair)."""
    from kernels.paged_attention.triton_paged_attention import paged_attention_triton
    d, nkv, bs, heads = s["head_dim"], s["kv_heads"], s["block"], s["heads"]
    dtype = BF16 if device.type == "cuda" else torch.float32   # the interpreter's bf16 dots are not the GPU's
    width = -(-(context + chunk) // bs)
    k_cache = torch.randn(width + 1, bs, nkv, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(width, device=device, dtype=torch.int32).view(1, width)
    q = torch.randn(chunk, heads, d, device=device, dtype=dtype)
    positions = context + torch.arange(chunk, device=device)
    cu = torch.tensor([0, chunk], device=device, dtype=torch.int32)
    pairs = chunk * context + chunk * (chunk + 1) // 2                                    # causal (query, key) pairs
    want = paged_attention_ref(q, k_cache, v_cache, positions, tables, cu, chunk, d ** -0.5)
    rows = []
    for tuning in PREFILL_TUNINGS:
        def call(tuning=tuning):
            return paged_attention_triton(q, k_cache, v_cache, positions, tables, cu, chunk, d ** -0.5,
                                          tuning=tuning)
        try:
            error = (call().float() - want.float()).abs().max().item()
            ms, mode = time_ms(call, device, reps=10)
        except Exception as e:  # noqa: BLE001 - a tuning that does not compile (shared memory) is a row too
            rows.append(row("attention-prefill", f"chunk {chunk} ctx {context}", f"ours {tuning or 'default'}",
                            None, note=f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        tflops = 4 * heads * d * pairs / (ms * 1e-3) / 1e12
        rows.append(row("attention-prefill", f"chunk {chunk} ctx {context}", f"ours {tuning or 'default'}", ms,
                        mode, note=f"{tflops:.0f} TFLOP/s, max |error| {error:.3g}"))
        print(rows[-1], flush=True)
    return rows


def token_rows(s: dict, batch: int, n: int, device, copy_bw: float) -> list[dict]:
    """The token-parallel kernels of one layer over batch · n tokens."""
    from kernels.activation.triton_silu_mul import silu_mul_triton
    from kernels.rms_norm.triton_rms_norm import gated_rms_norm_triton, rms_norm_triton
    from kernels.rotary.triton_norm_rope import norm_rope_triton
    t, case = batch * n, f"b{batch} n{n}"
    x = torch.randn(t, s["heads"], s["head_dim"], device=device, dtype=BF16)
    w = torch.randn(s["head_dim"], device=device, dtype=BF16) * 0.1
    positions = (100 + torch.arange(n, device=device)).repeat(batch)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, s["rotary"], 2, device=device, dtype=torch.float32) / s["rotary"]))
    rope = (x, w, 1e-6, positions, inv_freq)
    rows = ours_and_reference("norm-rope", case, lambda: norm_rope_triton(*rope), lambda: norm_rope_ref(*rope),
                 2 * x.numel() * 2, device, copy_bw)
    h = torch.randn(t, s["hidden"], device=device, dtype=BF16)
    res, hw = torch.randn_like(h), torch.randn(s["hidden"], device=device, dtype=BF16) * 0.1
    rows += ours_and_reference("rms-norm+residual", case, lambda: rms_norm_triton(h, hw, 1e-6, res),
                  lambda: rms_norm_ref(h, hw, 1e-6, res), 4 * h.numel() * 2, device, copy_bw)
    o = torch.randn(t, s["hv"], s["dv"], device=device, dtype=BF16)
    z, ow = torch.randn_like(o), torch.randn(s["dv"], device=device, dtype=BF16) * 0.1
    rows += ours_and_reference("gated-rms-norm", case, lambda: gated_rms_norm_triton(o, z, ow, 1e-6),
                  lambda: gated_rms_norm_ref(o, z, ow, 1e-6), 3 * o.numel() * 2, device, copy_bw)
    gate_up = torch.randn(t, 2 * s["inter"], device=device, dtype=BF16)
    rows += ours_and_reference("silu-mul", case, lambda: silu_mul_triton(gate_up), lambda: silu_mul_ref(gate_up),
                  3 * gate_up.numel() // 2 * 2, device, copy_bw)
    return rows


def moe_rows(s: dict, batch: int, n: int, device, copy_bw: float) -> list[dict]:
    """Routed experts at the Qwen3-Next shape on the kernel kernels.moe picks for this size: bytes are the experts
    the tokens reach (weights read once)."""
    from kernels.moe import experts_kernel, triton_experts
    t, e, hdim, inter, top = batch * n, s["experts"], s["moe_hidden"], s["moe_inter"], s["top_k"]
    x = torch.randn(t, hdim, device=device, dtype=BF16)
    gate_up = torch.randn(e, 2 * inter, hdim, device=device, dtype=BF16) * 0.02
    down = torch.randn(e, hdim, inter, device=device, dtype=BF16) * 0.02
    ids = torch.stack([torch.randperm(e, device=device)[:top] for _ in range(t)])        # [T, K] distinct
    weights = torch.softmax(torch.randn(t, top, device=device), -1)
    reached = int(ids.unique().numel())
    moved = reached * 3 * inter * hdim * 2 + 2 * x.numel() * 2
    args = (x, gate_up, down, weights, ids)
    ours = triton_experts(experts_kernel(t, top, e))
    return ours_and_reference("moe-experts", f"b{batch} n{n} E{e} top{top}", lambda: ours(*args),
                 lambda: moe_experts_ref(*args), moved, device, copy_bw)


def layer_rows(batch: int, k: int, context: int, device, copy_bw: float, smoke: bool) -> list[dict]:
    s = LAYER_SMOKE if smoke else LAYER_4B
    rows = []
    for n in (1, k + 1):
        rows += attention_rows(s, batch, n, context, device, copy_bw)
        rows += token_rows(s, batch, n, device, copy_bw)
        rows += moe_rows(s, batch, n, device, copy_bw)
    return rows
