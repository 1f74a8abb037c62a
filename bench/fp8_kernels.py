"""bench/kernels.py --fp8-linear: the block-scaled FP8 linear (kernels/fp8_linear) against the bf16 GEMM it
replaces, at the 4B shape's projections and a range of row counts (1-16: decode and verify, W8A16; more: W8A8).

Rows per (projection, M): `bf16 cuBLAS` (F.linear on the bf16 weight), `fp8 ours` (the tiles choose_tiles picks)
and with --sweep every candidate tiling (`fp8 w8a16|w8a8 mM nN kSPLIT gGROUP_M wWARPS sSTAGES`; W8A8 rows include quantizing
the activations). Each is timed in a CUDA graph; bytes are the weight, its scales, the input and the output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from timing import row, time_ms

BLOCK = (128, 128)
# (name, N, K) of the 4B shape: GDN in_proj qkv+z, attention q(+gate)+k+v, o / GDN out, MLP gate_up, MLP down
PROJECTIONS_4B = [("gdn-in", 12288, 2560), ("attn-qkv", 10240, 2560), ("attn-o", 2560, 4096),
                  ("gate-up", 18432, 2560), ("down", 2560, 9216)]
PROJECTIONS_SMOKE = [("smoke", 192, 256)]


def candidates(num_rows: int) -> list:
    """(weight_only, tiles): W8A16 GEMV splits up to 16 rows; W8A8 tiles and K splits above."""
    from kernels.fp8_linear.triton_fp8_linear import Fp8Tiles
    if num_rows <= 16:
        return [(True, Fp8Tiles(16, n, k, 1, 4, 3)) for n in (64, 128) for k in (1, 2, 4, 8)]
    block = Fp8Tiles(64, 64, 1, 8, 4, 3) if num_rows <= 256 else Fp8Tiles(128, 128, 1, 8, 8, 3)
    return [(False, Fp8Tiles(block.block_m, block.block_n, k, 8, block.num_warps, 3)) for k in (1, 2, 4, 8)] + \
        [(False, Fp8Tiles(64, 128, k, 8, 4, 3)) for k in (1, 2, 4)]


def name_of(tiles) -> str:
    return f"m{tiles.block_m}n{tiles.block_n}k{tiles.split_k}g{tiles.group_m}w{tiles.num_warps}s{tiles.num_stages}"


def fp8_linear_rows(rows_list: list[int], device, copy_bw: float, sweep: bool, smoke: bool) -> list[dict]:
    from kernels.fp8_linear.triton_fp8_linear import choose_tiles, fp8_linear_triton
    from specdec.models.fp8 import quantize_blocks
    out = []
    for name, n, k in PROJECTIONS_SMOKE if smoke else PROJECTIONS_4B:
        w = torch.randn(n, k, device=device) * k ** -0.5
        q, s = quantize_blocks(w.cpu(), BLOCK)
        q, s, w = q.to(device), s.to(device), w.to(torch.bfloat16)
        for m in rows_list:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            case = f"{name} {n}x{k} M={m}"
            io = m * k * 2 + m * n * 2
            fp8_bytes, bf16_bytes = n * k + s.numel() * 4 + io, n * k * 2 + io
            ms, mode = time_ms(lambda: F.linear(x, w), device)
            out.append(row("fp8-linear", case, "bf16 cuBLAS", ms, mode, bf16_bytes, copy_bw))
            ms, mode = time_ms(lambda: fp8_linear_triton(x, q, s, BLOCK), device)
            out.append(row("fp8-linear", case, f"fp8 ours {name_of(choose_tiles(m, n, k))}", ms, mode, fp8_bytes,
                           copy_bw))
            for weight_only, t in candidates(m) if sweep else []:
                label = f"fp8 {'w8a16' if weight_only else 'w8a8'} {name_of(t)}"
                try:
                    ms, mode = time_ms(lambda: fp8_linear_triton(x, q, s, BLOCK, tiles=t, weight_only=weight_only),
                                       device)
                except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses: say so, time the rest
                    out.append(row("fp8-linear", case, label, None, note=f"{type(e).__name__}: {str(e)[:80]}"))
                    continue
                out.append(row("fp8-linear", case, label, ms, mode, fp8_bytes, copy_bw))
            print(f"fp8-linear {case} done", flush=True)
    return out
