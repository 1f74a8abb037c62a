"""bench/kernels.py --fp8-linear: the block-scaled FP8 linear (kernels/fp8_linear) against the bf16 GEMM it
replaces, at the 4B shape's projections and a range of row counts (1-128: decode and verify, the GEMV; more:
prompt chunks, the weight dequantized for the dense GEMM).

Rows per (projection, M): `bf16 cuBLAS` (F.linear on the bf16 weight), `fp8 ours` (what fp8_linear_triton runs:
the GEMV's tiles or `dequant+cuBLAS`) and with --sweep other GEMV tilings (`fp8 mM nN kSPLIT wWARPS sSTAGES`).
Each is timed in a CUDA graph; bytes are the weight, its scales, the input and the output.
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
    """GEMV tilings around what choose_tiles picks (row tiles, output tiles, K splits)."""
    from kernels.fp8_linear.triton_fp8_linear import Fp8Tiles
    block_ms = (16,) if num_rows <= 16 else (32, 64) if num_rows <= 64 else (64, 128)
    return [Fp8Tiles(m, n, k, 4, s) for m in block_ms for n in (64, 128) for k in (1, 2, 4, 8) for s in (3, 4)]


def name_of(tiles) -> str:
    if tiles is None:
        return "dequant+cuBLAS"
    return f"m{tiles.block_m}n{tiles.block_n}k{tiles.split_k}w{tiles.num_warps}s{tiles.num_stages}"


def fp8_linear_rows(rows_list: list[int], device, copy_bw: float, sweep: bool, smoke: bool) -> list[dict]:
    from kernels.fp8_linear.triton_fp8_linear import GEMV_ROWS, choose_tiles, fp8_linear_triton
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
            picked = choose_tiles(m, k) if m <= GEMV_ROWS else None
            out.append(row("fp8-linear", case, f"fp8 ours {name_of(picked)}", ms, mode, fp8_bytes, copy_bw))
            for t in candidates(m) if sweep else []:
                label = f"fp8 {name_of(t)}"
                try:
                    ms, mode = time_ms(lambda: fp8_linear_triton(x, q, s, BLOCK, tiles=t), device)
                except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses: say so, time the rest
                    out.append(row("fp8-linear", case, label, None, note=f"{type(e).__name__}: {str(e)[:80]}"))
                    continue
                out.append(row("fp8-linear", case, label, ms, mode, fp8_bytes, copy_bw))
            print(f"fp8-linear {case} done", flush=True)
    return out
