"""Paged attention, fused norms and MoE experts: our Triton kernels against their torch references, at the
Qwen3.5-4B shape (attention, norms) and two MoE shapes, with each kernel's fraction of the bandwidth roofline.

Roofline = (minimum bytes the call must move / its time) / (device copy bandwidth measured in this run, bytes read
+ written). Our kernels are timed eagerly and as CUDA-graph replays (the engine runs them inside graphs); the
references eagerly (they sync). Where torch has a tuned kernel for the same math on unpaged KV (SDPA), it is timed
too, as a yardstick for what a library kernel (FlashAttention / FlashInfer class) reaches on this GPU.

    python bench/kernels_fastkern.py --out-dir bench/results            # GPU, < 3 minutes on an H100
    TRITON_INTERPRET=1 python bench/kernels_fastkern.py --smoke          # CPU: tiny shapes, checks it runs
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

# Run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels.moe import moe_experts_ref  # noqa: E402
from kernels.paged_attention import paged_attention_ref  # noqa: E402
from kernels.rms_norm import gated_rms_norm_ref, rms_norm_ref  # noqa: E402

log = logging.getLogger("bench.kernels_fastkern")

# Qwen3.5-4B: 16 q / 4 kv heads × 256, hidden 2560, GDN 32 v-heads × 128; KV block 16 (the verifier's default)
ATTN, HIDDEN, GDN_HEADS, GDN_DIM, BLOCK = (16, 4, 256), 2560, 32, 128, 16
# MoE layers: (hidden, experts, top_k, intermediate) of Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B (one layer each)
MOE_SHAPES = {"qwen3.5-moe": (2048, 256, 8, 512), "qwen3-next": (2048, 512, 10, 512)}
GRAPH_CALLS = 10


class Timer:
    def __init__(self, device: torch.device, min_reps: int, budget_s: float):
        self.device, self.min_reps, self.budget_s = device, min_reps, budget_s

    def __call__(self, fn, graph: bool = False) -> float:
        """Median µs per call. graph: GRAPH_CALLS calls captured in one CUDA graph, time per call of a replay
        (the GPU time without launch overhead, as inside the engine's graphs)."""
        fn()
        if self.device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        calls = 1
        if graph:
            g, calls = torch.cuda.CUDAGraph(), GRAPH_CALLS
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    fn()
            fn = g.replay
        fn()
        torch.cuda.synchronize()
        times, spent = [], 0.0
        while len(times) < self.min_reps or (spent < self.budget_s and len(times) < 200):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e3)
            spent += times[-1] * 1e-6
        return sorted(times)[len(times) // 2] / calls


def copy_bandwidth(timer: Timer, device, gib: float) -> float:
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (us * 1e-6)  # bytes read + written per second


def paged_case(seqs, dtype, device, gen):
    """seqs: (cached tokens before the step, query tokens). Shuffled blocks, as a running server leaves them."""
    nh, nkv, d = ATTN
    widths = [-(-(c + n) // BLOCK) for c, n in seqs]
    perm = torch.randperm(sum(widths), generator=gen)
    tables = torch.zeros(len(seqs), max(widths), dtype=torch.int32)
    cu, pos, used = [0], [], 0
    for b, ((c, n), w) in enumerate(zip(seqs, widths)):
        tables[b, :w] = perm[used:used + w].int()
        used, cu = used + w, cu + [cu[-1] + n]
        pos += range(c, c + n)
    shape = (sum(widths), BLOCK, nkv, d)
    case = dict(q=torch.randn(cu[-1], nh, d, generator=gen), k_cache=torch.randn(shape, generator=gen),
                v_cache=torch.randn(shape, generator=gen), positions=torch.tensor(pos),
                block_tables=tables, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    case = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in case.items()}
    return case | dict(max_seqlen=max(n for _, n in seqs), scale=d ** -0.5)


def sdpa_dense(case, seqs):
    """Same math with contiguous (unpaged) KV through torch SDPA, all sequences the same shape."""
    (c, n), b = seqs[0], len(seqs)
    nh, nkv, d = ATTN
    keys = torch.randn(b, nkv, c + n, d, device=case["q"].device, dtype=case["q"].dtype)
    q = case["q"].view(b, n, nh, d).transpose(1, 2)
    mask = None if n == 1 else (torch.arange(c + n, device=q.device)[None] <= torch.arange(c, c + n,
                                                                                          device=q.device)[:, None])
    causal = c == 0 and n > 1
    return partial(F.scaled_dot_product_attention, q, keys, keys, attn_mask=None if causal else mask,
                   is_causal=causal, enable_gqa=True)


def attention_rows(smoke: bool, dtype, device, gen):
    from kernels.paged_attention.triton_paged_attention import paged_attention_triton
    ctxs, batches, prefill = ((16, 40), (1, 3), 24) if smoke else ((128, 2048), (1, 8, 32, 64), 2048)
    cases = [(f"verify k=3 b{b} ctx{c}", [(c - 4, 4)] * b) for c in ctxs for b in batches]
    cases += [(f"decode b{batches[-1]} ctx{ctxs[-1]}", [(ctxs[-1] - 1, 1)] * batches[-1]),
              (f"prefill {prefill}", [(0, prefill)])]
    nh, nkv, d = ATTN
    for name, seqs in cases:
        case = paged_case(seqs, dtype, device, gen)
        out = torch.empty_like(case["q"])
        kv_bytes = sum(c + n for c, n in seqs) * nkv * d * 2 * case["k_cache"].element_size()
        flops = sum(4 * n * (c + (n + 1) / 2) * nh * d for c, n in seqs)
        yield dict(kernel="paged_attention", case=name, bytes=kv_bytes + 2 * case["q"].numel() * 2, flops=flops,
                   ours=partial(paged_attention_triton, **case, out=out),
                   ref=partial(paged_attention_ref, **case, out=out),
                   sdpa=sdpa_dense(case, seqs) if device.type == "cuda" else None)


def norm_rows(smoke: bool, dtype, device, gen):
    from kernels.rms_norm.triton_rms_norm import gated_rms_norm_triton, rms_norm_triton
    hidden, heads, dim = (40, 4, 24) if smoke else (HIDDEN, GDN_HEADS, GDN_DIM)
    for tokens in ((1, 9) if smoke else (1, 4, 64, 256, 2048)):
        x, r = (torch.randn(tokens, hidden, generator=gen).to(device, dtype) for _ in range(2))
        w = torch.randn(hidden, generator=gen).to(device, dtype)
        yield dict(kernel="rms_norm+residual", case=f"{tokens}x{hidden}", bytes=4 * x.numel() * x.element_size(),
                   ours=partial(rms_norm_triton, x, w, 1e-6, r), ref=partial(rms_norm_ref, x, w, 1e-6, r))
        o, z = (torch.randn(tokens, heads, dim, generator=gen).to(device, dtype) for _ in range(2))
        wg = torch.randn(dim, generator=gen).to(device, dtype)
        yield dict(kernel="gated_rms_norm", case=f"{tokens}x{heads}x{dim}", bytes=3 * o.numel() * o.element_size(),
                   ours=partial(gated_rms_norm_triton, o, z, wg, 1e-6), ref=partial(gated_rms_norm_ref, o, z, wg, 1e-6))


def moe_rows(smoke: bool, dtype, device, gen):
    from kernels.moe.triton_moe import moe_experts_triton
    shapes = {"smoke": (40, 6, 2, 24)} if smoke else MOE_SHAPES
    for shape_name, (hidden, experts, top_k, inter) in shapes.items():
        gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
        down = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(device, dtype)
        for tokens in ((1, 7) if smoke else (1, 4, 16, 64, 256, 2048)):
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            weights, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
            weights, ids = (weights / weights.sum(-1, keepdim=True)).to(device), ids.to(device)
            used = ids.unique().numel()
            yield dict(kernel=f"moe {shape_name}", case=f"{tokens} tok, {used}/{experts} experts",
                       bytes=used * 3 * inter * hidden * gate_up.element_size() + 2 * x.numel() * x.element_size(),
                       flops=6 * tokens * top_k * inter * hidden,
                       ours=partial(moe_experts_triton, x, gate_up, down, weights, ids),
                       ref=partial(moe_experts_ref, x, gate_up, down, weights, ids))


def measure(row: dict, timer: Timer, copy_bw: float, graphs: bool) -> dict:
    result = {k: row[k] for k in ("kernel", "case", "bytes")} | {"flops": row.get("flops", 0.0)}
    result["ours_us"] = timer(row["ours"])
    result["ours_graph_us"] = timer(row["ours"], graph=True) if graphs else None
    result["ref_us"] = timer(row["ref"])
    result["sdpa_us"] = timer(row["sdpa"]) if row.get("sdpa") else None
    best = min(t for t in (result["ours_us"], result["ours_graph_us"]) if t)
    result["gbps"] = row["bytes"] / (best * 1e-6) / 1e9
    result["roofline"] = result["gbps"] * 1e9 / copy_bw
    result["tflops"] = result["flops"] / (best * 1e-6) / 1e12
    result["speedup_vs_ref"] = result["ref_us"] / best
    return result


def table(results: list[dict]) -> str:
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = ["| kernel | case | ours µs | ours graph µs | torch ref µs | ×ref | SDPA dense µs | GB/s | roofline | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['kernel']} | {r['case']} | {r['ours_us']:.1f} | {fmt(r['ours_graph_us'], '.1f')} | "
                     f"{r['ref_us']:.1f} | {r['speedup_vs_ref']:.1f} | {fmt(r['sdpa_us'], '.1f')} | "
                     f"{r['gbps']:.0f} | {r['roofline']:.0%} | {r['tflops']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="bench/results", help="folder for kernels_fastkern_<device>.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU (timings meaningless)")
    parser.add_argument("--only", choices=["attention", "norms", "moe"], nargs="+",
                        default=["attention", "norms", "moe"], help="which groups to run")
    parser.add_argument("--min-reps", type=int, default=10, help="timed calls per measurement, at least")
    parser.add_argument("--budget-ms", type=float, default=150.0, help="time spent per measurement, at most-ish")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available() and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1 on the CPU)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer, gen = Timer(device, args.min_reps, args.budget_ms * 1e-3), torch.Generator().manual_seed(0)
    copy_bw = copy_bandwidth(timer, device, 0.01 if args.smoke else 1.0)
    log.info("device copy: %.0f GB/s (read + write)", copy_bw / 1e9)
    groups = {"attention": attention_rows, "norms": norm_rows, "moe": moe_rows}
    results = []
    for group in args.only:
        # rows are built one at a time (a b64 × 2048 KV cache is 0.5 GB) and measured before the next exists
        for row in tqdm(groups[group](args.smoke, dtype, device, gen), desc=group, file=sys.stderr):
            results.append(measure(row, timer, copy_bw, graphs=device.type == "cuda"))
            log.info("%s %s: ours %.1f µs, ref %.1f µs", row["kernel"], row["case"], results[-1]["ours_us"],
                     results[-1]["ref_us"])
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    meta = dict(device=device_name, torch=torch.__version__, command=" ".join(sys.argv), dtype=str(dtype),
                copy_bandwidth_gbps=copy_bw / 1e9, smoke=args.smoke)
    out = Path(args.out_dir) / f"kernels_fastkern_{device_name.replace(' ', '_')}{'_smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    log.info("wrote %s", out)
    print(f"\n{device_name}, {dtype}, device copy {copy_bw / 1e9:.0f} GB/s\n{table(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
