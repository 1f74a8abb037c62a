"""bench/kernels.py --moe: a sparse MoE block's decode kernels at two shapes, against what they replace.

Shapes: `4b-moe` (the make-tiny qwen3.5-4b preset as qwen3_5_moe: hidden 2560, 64 experts, top 8, expert and shared
width 512) and `next-80b` (Qwen3-Next-80B-A3B: hidden 2048, 512 experts, top 10, widths 512). Rows per token count:
  route      torch (softmax, topk, renormalise) vs ours (one Triton launch)
  experts    grouped (pairs sorted by expert, grouped GEMMs), decode (a GEMV per pair; up to 256 pairs), scan (each
             expert finds its pairs; up to 2048 pairs) and ours (what kernels.moe dispatches to); with --sweep, the
             decode GEMVs and the scan kernels at other tiles; "fp8 ..." rows: the same kernels on the experts in
             FP8 (128 x 128 block scales; bytes a byte a weight plus the scales), with --sweep the decode tiles
  block      the whole SparseMoE forward as before the decode kernels (router and shared gate GEMMs, torch
             routing, grouped experts, shared expert and combine in torch) vs now (one GEMM for both gates, Triton
             routing, dispatched experts with the shared expert fused in); up to 256 pairs also now on the per-pair
             GEMVs and on the scan kernels, whatever the dispatcher picks (their boundary)
Each is timed in a CUDA graph over calls that alternate between two copies of the experts (so that a call finds
none of its weights in L2); bytes are the experts the tokens reach, read once, plus (block rows) the router and
shared expert weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from timing import row, time_ms

SHAPES = {"4b-moe": dict(hidden=2560, inter=512, experts=64, top_k=8, shared=512),
          "next-80b": dict(hidden=2048, inter=512, experts=512, top_k=10, shared=512)}
SHAPES_SMOKE = {"smoke": dict(hidden=64, inter=32, experts=8, top_k=2, shared=32)}
BF16 = torch.bfloat16


def tile_candidates() -> list:
    from kernels.moe.triton_moe_decode import GemvTiles
    return [GemvTiles(n, k, w) for n in (4, 8, 16, 32) for k in (128, 256, 512) for w in (4, 8)]


class MoEBlockCase:
    """Random weights of one MoE block (two copies of the routed experts) and T tokens with their routing."""

    def __init__(self, s: dict, num_tokens: int, device):
        h, i, e, k = s["hidden"], s["inter"], s["experts"], s["top_k"]
        self.top_k = k
        self.experts = [(torch.randn(e, 2 * i, h, device=device, dtype=BF16) * h ** -0.5,
                         torch.randn(e, h, i, device=device, dtype=BF16) * i ** -0.5) for _ in range(2)]
        self.router = torch.randn(e, h, device=device, dtype=BF16) * h ** -0.5
        self.shared_gate_up = torch.randn(2 * s["shared"], h, device=device, dtype=BF16) * h ** -0.5
        self.shared_down = torch.randn(h, s["shared"], device=device, dtype=BF16) * s["shared"] ** -0.5
        self.shared_gate = torch.randn(1, h, device=device, dtype=BF16) * h ** -0.5
        self.router_and_shared_gate = torch.cat([self.router, self.shared_gate])           # [E + 1, H]
        self.x = torch.randn(num_tokens, h, device=device, dtype=BF16)
        logits = F.linear(self.x, self.router)
        from kernels.moe_route import moe_route_ref
        self.weights, self.ids = moe_route_ref(logits, k, True)
        self.logits, self.calls = logits, 0
        reached = int(self.ids.unique().numel())
        self.expert_bytes = reached * 3 * i * h * 2 + 2 * self.x.numel() * 2
        from kernels.moe import ExpertScales
        from specdec.models.fp8 import quantize_blocks
        fp8 = [(quantize_blocks(gu, (128, 128)), quantize_blocks(d, (128, 128))) for gu, d in self.experts]
        self.fp8_experts = [(gu[0], d[0], ExpertScales(gu[1], d[1], (128, 128))) for gu, d in fp8]
        scale_bytes = (fp8[0][0][1].numel() + fp8[0][1][1].numel()) // e * 4
        self.fp8_expert_bytes = reached * (3 * i * h + scale_bytes) + 2 * self.x.numel() * 2
        self.block_bytes = self.expert_bytes + (self.router.numel() + self.shared_gate_up.numel()
                                                + self.shared_down.numel() + self.shared_gate.numel()) * 2

    def next_experts(self):
        """The copy of the experts this call reads (alternating: a captured run of calls cycles through both)."""
        self.calls += 1
        return self.experts[self.calls % 2]

    def next_fp8(self):
        """(gate_up, down, scales) of the FP8 copy this call reads."""
        self.calls += 1
        return self.fp8_experts[self.calls % 2]

    def shared_output(self, x):
        from kernels.activation import silu_mul
        return F.linear(silu_mul(F.linear(x, self.shared_gate_up)), self.shared_down)

    def block_before(self):
        """SparseMoE.forward before the decode kernels: router and shared gate GEMMs apart, torch routing, grouped
        experts, the shared expert and the combine in torch."""
        from kernels.moe.triton_moe import moe_experts_triton
        gate_up, down = self.next_experts()
        probs = torch.softmax(F.linear(self.x, self.router).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = moe_experts_triton(self.x, gate_up, down, weights, ids)
        return routed + self.shared_output(self.x) * torch.sigmoid(F.linear(self.x, self.shared_gate))

    def block_now(self, experts=None):
        """SparseMoE.forward now: one GEMM for the router and the shared gate, Triton routing, the experts with
        the shared expert fused in; `experts`: the kernels to run them on (default: kernels.moe's choice)."""
        from kernels.moe import SharedExpert, moe_experts
        from kernels.moe_route import moe_route
        gate_up, down = self.next_experts()
        logits = F.linear(self.x, self.router_and_shared_gate)                            # [T, E + 1]
        weights, ids = moe_route(logits[:, :-1], self.top_k, True)
        shared = SharedExpert(logits[:, -1:], gate_up=self.shared_gate_up, down=self.shared_down)
        return (experts or moe_experts)(self.x, gate_up, down, weights, ids, shared)


def moe_rows(tokens_list: list[int], device, copy_bw: float, sweep: bool, smoke: bool) -> list[dict]:
    from kernels.moe import moe_experts
    from kernels.moe.triton_moe import moe_experts_triton
    from kernels.moe.triton_moe_decode import moe_experts_decode_triton
    from kernels.moe.triton_moe_scan import moe_experts_scan_triton
    from kernels.moe_route import moe_route, moe_route_ref
    out = []
    for shape_name, s in (SHAPES_SMOKE if smoke else SHAPES).items():
        for t in tokens_list:
            c = MoEBlockCase(s, t, device)
            case = f"{shape_name} T={t} ({t * c.top_k} pairs)"
            route_bytes = c.logits.numel() * 2 + c.ids.numel() * 12
            for impl, fn in (("torch", lambda: moe_route_ref(c.logits, c.top_k, True)),
                             ("ours", lambda: moe_route(c.logits, c.top_k, True))):
                ms, mode = time_ms(fn, device)
                out.append(row("moe-route", case, impl, ms, mode, route_bytes, copy_bw))
            impls = [("grouped", lambda: moe_experts_triton(c.x, *c.next_experts(), c.weights, c.ids))]
            if t * c.top_k <= 256:
                impls.append(("decode", lambda: moe_experts_decode_triton(c.x, *c.next_experts(), c.weights, c.ids)))
            if t * c.top_k <= 2048:
                impls.append(("scan", lambda: moe_experts_scan_triton(c.x, *c.next_experts(), c.weights, c.ids)))
            impls.append(("ours", lambda: moe_experts(c.x, *c.next_experts(), c.weights, c.ids)))
            for impl, fn in impls:
                ms, mode = time_ms(fn, device)
                out.append(row("moe-experts", case, impl, ms, mode, c.expert_bytes, copy_bw))
            for bn, bk in ((32, 128), (64, 64), (64, 128), (128, 64)) if sweep and t * c.top_k <= 2048 else []:
                ms, mode = time_ms(lambda: moe_experts_scan_triton(c.x, *c.next_experts(), c.weights, c.ids,
                                                                   block_n=bn, block_k=bk), device)
                out.append(row("moe-experts", case, f"scan n{bn}k{bk}", ms, mode, c.expert_bytes, copy_bw))
            for tiles in tile_candidates() if sweep and t * c.top_k <= 256 else []:
                label = f"decode n{tiles.block_n}k{tiles.block_k}w{tiles.num_warps}"
                try:
                    ms, mode = time_ms(lambda: moe_experts_decode_triton(
                        c.x, *c.next_experts(), c.weights, c.ids, tiles=(tiles, tiles)), device)
                except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses: say so, time the rest
                    out.append(row("moe-experts", case, label, None, note=f"{type(e).__name__}: {str(e)[:80]}"))
                    continue
                out.append(row("moe-experts", case, label, ms, mode, c.expert_bytes, copy_bw))
            out += fp8_rows(c, case, t, device, copy_bw, sweep)
            blocks = [("before", c.block_before), ("now", c.block_now)]
            if t * c.top_k <= 256:    # the decode / scan boundary, each with the shared expert fused
                blocks += [("now, per-pair", lambda: c.block_now(moe_experts_decode_triton)),
                           ("now, scan", lambda: c.block_now(moe_experts_scan_triton))]
            for impl, fn in blocks:
                ms, mode = time_ms(fn, device)
                out.append(row("moe-block", case, impl, ms, mode, c.block_bytes, copy_bw))
            print(f"moe {case} done", flush=True)
            del c
    return out


def split_rows(device, copy_bw: float, smoke: bool, ranks: int = 2, samples: int = 20000) -> list[dict]:
    """One decode token's routed experts over `ranks` GPUs, as a rank runs them (next-80b; T = 1):
      columns   every rank reads 1/ranks of the columns of each of the token's top-k experts (tensor_parallel.py's
                layout): top-k experts of width / ranks
      whole     expert parallel: a rank holds 1/ranks of the experts, whole, and runs those of the token's top-k
                it holds; the step waits for the rank that holds most: n experts of full width, n = 1..k, and
                "whole, expected" = the mean over uniformly random top-k sets of the busiest rank's time
    The all-reduce after the experts is the same either way (partial sums of every rank)."""
    from kernels.moe import moe_experts
    s = SHAPES_SMOKE["smoke"] if smoke else SHAPES["next-80b"]
    k, case, out = s["top_k"], f"{'smoke' if smoke else 'next-80b'} T=1, {ranks} ranks", []

    def timed(shape: dict, impl: str) -> float:
        c = MoEBlockCase(shape, 1, device)
        ms, mode = time_ms(lambda: moe_experts(c.x, *c.next_experts(), c.weights, c.ids), device)
        out.append(row("moe-split", case, impl, ms, mode, c.expert_bytes, copy_bw))
        return ms
    timed({**s, "inter": s["inter"] // ranks}, f"columns ({k} experts, width {s['inter'] // ranks})")
    whole = {n: timed({**s, "experts": s["experts"] // ranks, "top_k": n}, f"whole, {n} experts")
             for n in range(-(-k // ranks), k + 1)}
    picks = torch.rand(samples, s["experts"]).argsort(dim=1)[:, :k]      # [samples, k] random top-k sets
    busiest = torch.stack([(picks // (s["experts"] // ranks) == r).sum(1) for r in range(ranks)]).amax(0)
    expected = sum(whole[int(n)] for n in busiest) / samples
    share = {n: float((busiest == n).float().mean()) for n in whole}
    out.append(row("moe-split", case, "whole, expected", expected, "mean", note="busiest rank's experts: " + ", ".join(
        f"{n}: {p:.0%}" for n, p in share.items() if p)))
    return out


def fp8_rows(c: MoEBlockCase, case: str, t: int, device, copy_bw: float, sweep: bool) -> list[dict]:
    """The routed experts in FP8 on each kernel (and, with --sweep up to 64 pairs, the decode GEMVs' tiles)."""
    from kernels.moe import moe_experts, triton_experts
    from kernels.moe.triton_moe_decode import moe_experts_decode_triton

    def run(fn, **kw):
        gate_up, down, scales = c.next_fp8()
        return fn(c.x, gate_up, down, c.weights, c.ids, None, scales, **kw)
    out = []
    kernels = [("grouped", triton_experts("grouped"))] + ([("decode", triton_experts("decode"))] if t * c.top_k <= 256
                                                          else []) + [("scan", triton_experts("scan"))]
    for impl, fn in kernels + [("ours", moe_experts)]:
        ms, mode = time_ms(lambda: run(fn), device)
        out.append(row("moe-experts", case, f"fp8 {impl}", ms, mode, c.fp8_expert_bytes, copy_bw))
    for tiles in tile_candidates() if sweep and t * c.top_k <= 64 else []:
        if tiles.block_k > 128:
            continue                     # a tile stays inside one 128-column scale block
        label = f"fp8 decode n{tiles.block_n}k{tiles.block_k}w{tiles.num_warps}"
        try:
            ms, mode = time_ms(lambda: run(moe_experts_decode_triton, tiles=(tiles, tiles)), device)
        except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses: say so, time the rest
            out.append(row("moe-experts", case, label, None, note=f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        out.append(row("moe-experts", case, label, ms, mode, c.fp8_expert_bytes, copy_bw))
    return out
