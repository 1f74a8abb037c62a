"""GPU benchmark of specdec's kernels and of the verify step, Qwen3.5-4B shape, bf16 (GDN state fp32).

    python bench/kernels.py [--out DIR] [--layers 32] [--batches 1 8 32 64] [-k 3]

Sections (rows: milliseconds per call, GB/s, fraction of the device-copy roofline measured in the same run):
  gdn-verify / gdn-decode  our fused recurrent kernel (deferred commit: a verify replays the last step's
                           --accepted drafts, runs its 1 + k tokens, writes one state; bench/gdn_state_traffic.md)
                           at its launch shape and the other shapes, vs fla-core fused_recurrent for the same
                           1 + k tokens (final state only), vs the torch reference; --batches
  gdn-prefill              our recurrent kernel vs fla-core chunk vs the torch reference
  conv-verify / conv-prefill  our causal conv1d kernel vs the torch reference, and on the window stored channel by
                           channel (the layout before the caches kept it column by column)
  attention-decode / -verify, write-kv, norm-rope, rms-norm+residual, gated-rms-norm, silu-mul, moe-experts
                           the other kernels of a layer, decode and k+1 tokens, vs their torch references
                           (layer_kernels.py; attention over --context cached positions, MoE at the Qwen3-Next
                           shape: 512 experts, top 10)
  moe-route / -experts / -block  with --moe only: a MoE block's decode kernels at two shapes (moe_kernels.py)
  moe-split                with --moe-split only: a token's experts over N GPUs, by columns or whole (moe_kernels.py)
  sampling                 the one-launch speculative sampler vs the torch path (greedy, coupled, q rows; CUDA
                           and --smoke: sampling_bench.py)
  step                     plain decode and k=3 verify of a random 4B-shaped model (--layers of it), eager vs
                           CUDA graph, vs the bare weight-GEMM chain in one graph (step_bench.py)
Writes kernels.json under --out (default $OUT, else bench/results) and prints the table last.
`--smoke` runs tiny shapes (CPU: Triton in the interpreter, timings meaningless) to check the script itself.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import timing  # noqa: E402
from layer_kernels import layer_rows, ours_and_reference  # noqa: E402
from timing import copy_bandwidth, row, table, time_ms  # noqa: E402

from kernels.causal_conv1d import conv_state_columns  # noqa: E402
from kernels.causal_conv1d.reference import causal_conv1d_ref  # noqa: E402
from kernels.gated_delta_rule.reference import gated_delta_rule_ref, gdn_gating  # noqa: E402
from specdec.models.caches import pending_ring_rows  # noqa: E402

SHAPE_4B = dict(hk=16, hv=32, dk=128, dv=128, width=4)
SHAPE_SMOKE = dict(hk=2, hv=4, dk=24, dv=40, width=4)


class GDNCase:
    """Random inputs for B sequences of n tokens (the last d are drafts), each replaying `replayed` drafts of its
    last step from a pending ring sized for `max_drafts`, at one shape."""

    def __init__(self, shape: dict, batch: int, n: int, drafts: int, device, replayed: int = 0, max_drafts: int = 3):
        self.shape, self.batch, self.n, self.drafts = shape, batch, n, drafts
        hk, hv, dk, dv = shape["hk"], shape["hv"], shape["dk"], shape["dv"]
        t, bf16 = batch * n, torch.bfloat16
        mixed = torch.randn(t, 2 * hk * dk + hv * dv, device=device, dtype=bf16)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        self.q, self.k, self.v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
        self.a, self.b = torch.randn(t, hv, device=device, dtype=bf16), torch.randn(t, hv, device=device, dtype=bf16)
        self.A_log = torch.rand(hv, device=device).to(bf16)
        self.dt_bias = torch.randn(hv, device=device).to(bf16)
        self.state = torch.randn(batch + 1, hv, dk, dv, device=device) * 0.1
        self.pending = torch.randn(batch + 1, pending_ring_rows(max_drafts), hk * dk + hv * (dv + 2), device=device,
                                   dtype=bf16)
        i32 = dict(dtype=torch.int32, device=device)
        self.cu = torch.arange(0, t + 1, n, **i32)
        self.slots, self.offsets = torch.arange(batch, **i32), torch.full((batch,), replayed, **i32)
        self.num_drafts = torch.full((batch,), drafts, **i32)
        self.positions = (100 + torch.arange(n, device=device)).repeat(batch)
        self.x = mixed  # conv input [T, C] (C = 2·HK·K + HV·V)
        self.conv_w = torch.randn(mixed.shape[1], shape["width"], device=device, dtype=bf16)
        # the engine's window (W - 1 + max_drafts columns, whatever this step's drafts) in the caches' layout
        self.conv_state = conv_state_columns(batch + 1, mixed.shape[1], shape["width"] - 1 + max_drafts,
                                             device=device, dtype=bf16).normal_()

    @property
    def gdn_args(self):
        return (self.q, self.k, self.v, self.a, self.b, self.A_log, self.dt_bias, self.state, self.pending, self.cu,
                self.slots, self.offsets, self.num_drafts, self.positions, self.n)

    def state_bytes(self, copies: int) -> int:
        s = self.shape
        return copies * self.batch * s["hv"] * s["dk"] * s["dv"] * 4

    def token_bytes(self) -> int:  # q, k, v, a, b in + o out, bf16
        s, t = self.shape, self.batch * self.n
        return 2 * t * (2 * s["hk"] * s["dk"] + 2 * s["hv"] * s["dv"] + 2 * s["hv"])


def fla_fused_recurrent():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        return fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001
        return None


GDN_CONFIGS = ((16, 1, True), (16, 1, False), (32, 2, False))   # (BV, warps, pipelined): launch_config's choices


def config_name(config) -> str:
    bv, warps, pipeline = config
    return f"BV={bv} w{warps} {'pipelined' if pipeline else 'loop'}"


def gdn_rows(shape, batch, k, device, copy_bw, accepted: int) -> list[dict]:
    """Our kernel at its launch shape and the others (a verify replays `accepted` drafts of the last step first:
    the deferred commit), fla-core's for the same new tokens, the torch reference."""
    from kernels.gated_delta_rule.fused_recurrent import gated_delta_rule_triton, launch_config
    rows, n = [], k + 1
    section = "gdn-verify" if k else "gdn-decode"
    replayed = accepted if k else 0
    c = GDNCase(shape, batch, n, k, device, replayed=replayed, max_drafts=k)
    case = f"b{batch} n{n}"
    label = f"ours: {replayed} replayed + {n} tokens, 1 state" if k else "ours"
    moved = c.state_bytes(2) + c.token_bytes()
    chosen = launch_config(batch, n + k)   # what the wrapper picks: the step's tokens + the drafts it may replay
    for config in (None,) + tuple(x for x in GDN_CONFIGS if x != chosen):
        kw = {} if config is None else dict(zip(("block_v", "num_warps", "pipeline"), config))
        ms, mode = time_ms(lambda: gated_delta_rule_triton(*c.gdn_args, **kw), device)
        rows.append(row(section, case, label if config is None else f"ours {config_name(config)}", ms, mode, moved,
                        copy_bw, note=config_name(chosen) if config is None else ""))
    fla = fla_fused_recurrent()
    if fla is not None and device.type == "cuda":
        h0 = c.state[:batch].contiguous()                      # [B, HV, K, V]
        q4, k4, v4 = (x.contiguous()[None] for x in (c.q, c.k, c.v))
        g, beta = gdn_gating(c.a, c.b, c.A_log, c.dt_bias)
        cu = c.cu.long()
        run = lambda: fla(q4, k4, v4, g[None], beta=beta[None], initial_state=h0,  # noqa: E731
                          output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        ms, mode = time_ms(run, device)
        rows.append(row(section, case, f"fla fused_recurrent ({n} tokens, final state)", ms, mode,
                        c.state_bytes(2) + c.token_bytes(), copy_bw, note="g, beta precomputed"))
    ms, mode = time_ms(lambda: gated_delta_rule_ref(*c.gdn_args), device, reps=3, graph=False)   # host syncs
    rows.append(row(section, case, "torch reference", ms, mode, moved, copy_bw))
    return rows


def conv_rows(shape, batch, n, drafts, device, copy_bw, section) -> list[dict]:
    from kernels.causal_conv1d.triton_conv import causal_conv1d_triton
    c = GDNCase(shape, batch, n, drafts, device)
    args = (c.x, c.conv_w, c.conv_state, c.cu, c.slots, c.offsets, c.num_drafts, n)
    moved = 2 * c.x.numel() * 2 + c.conv_w.numel() * 2 + batch * c.x.shape[1] * (2 * shape["width"] - 2 + drafts) * 2
    rows = ours_and_reference(section, f"b{batch} n{n}", lambda: causal_conv1d_triton(*args),
                              lambda: causal_conv1d_ref(*args), moved, device, copy_bw)
    by_channel = args[:2] + (c.conv_state.contiguous(),) + args[3:]   # each channel's window contiguous (before
    ms, mode = time_ms(lambda: causal_conv1d_triton(*by_channel), device)  # b0fc380): every column moves
    return rows + [row(section, f"b{batch} n{n}", "ours, window by channel", ms, mode, moved, copy_bw)]


def prefill_rows(shape, batch, tokens, device, copy_bw) -> list[dict]:
    from kernels.gated_delta_rule.chunk import chunk_gated_delta_rule_fla, fla_chunk_kernel
    from kernels.gated_delta_rule.fused_recurrent import gated_delta_rule_triton
    c = GDNCase(shape, batch, tokens, 0, device)
    moved = c.state_bytes(2) + c.token_bytes()
    case, rows = f"b{batch} x {tokens} tokens", []
    # Prefill runs eagerly in the engine, and fla's chunk kernel syncs with the host (a failed capture would
    # leave torch's CUDA generator in capture mode): time both eagerly.
    ms, mode = time_ms(lambda: gated_delta_rule_triton(*c.gdn_args), device, reps=5, graph=False)
    rows.append(row("gdn-prefill", case, "ours recurrent", ms, mode, moved, copy_bw))
    if fla_chunk_kernel() is not None and device.type == "cuda":
        ms, mode = time_ms(lambda: chunk_gated_delta_rule_fla(*c.gdn_args), device, reps=5, graph=False)
        rows.append(row("gdn-prefill", case, "fla chunk", ms, mode, moved, copy_bw))
    ms, mode = time_ms(lambda: gated_delta_rule_ref(*c.gdn_args), device, reps=1, warmup=1, graph=False)
    rows.append(row("gdn-prefill", case, "torch reference", ms, mode, moved, copy_bw))
    rows += conv_rows(shape, batch, tokens, 0, device, copy_bw, "conv-prefill")
    return rows


def guarded(rows: list[dict], name: str, fn) -> None:
    """Run one section; a failure becomes an error row, the other sections still run."""
    try:
        rows += fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        rows.append(row(name, "", "ERROR", None, note=f"{type(e).__name__}: {str(e)[:160]}"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results", help="folder for kernels.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("-k", "--num-drafts", type=int, default=3)
    p.add_argument("--accepted", type=int, default=3, help="drafts of the last step a verify replays first")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32, help="layers of the 4B-shaped model in the step section")
    p.add_argument("--context", type=int, default=256, help="tokens prefilled per sequence before the step")
    p.add_argument("--skip-step", action="store_true", help="kernels only")
    p.add_argument("--skip-kernels", action="store_true", help="the step and draft-loop sections only")
    p.add_argument("--skip-draft", action="store_true", help="no MTP draft-loop section")
    p.add_argument("--only-sampling", action="store_true", help="the sampling section only")
    p.add_argument("--skip-sampling", action="store_true", help="no sampling section")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, not the speed")
    p.add_argument("--attention-prefill", metavar="CHUNK:CONTEXT", nargs="+", default=None,
                   help="only sweep the paged-attention tunings for one prompt chunk at this context (e.g. 1024:7168)")
    p.add_argument("--fp8-linear", metavar="ROWS", type=int, nargs="+", default=None,
                   help="only the FP8 linear against bf16 at these row counts (e.g. 1 2 4 16 64 256 1024 4096)")
    p.add_argument("--moe", metavar="TOKENS", type=int, nargs="+", default=None,
                   help="only the MoE block's decode kernels at these token counts (e.g. 1 2 4 8 16 32)")
    p.add_argument("--sweep", action="store_true", help="with --fp8-linear / --moe: time every candidate tiling too")
    p.add_argument("--moe-split", metavar="RANKS", type=int, default=None,
                   help="only a decode token's experts over RANKS GPUs, split by columns against placed whole "
                        "(expert parallel), as one rank runs them (moe_kernels.split_rows)")
    args = p.parse_args()
    device = torch.device(args.device)
    shape = SHAPE_SMOKE if args.smoke else SHAPE_4B
    if args.smoke:
        args.batches, args.prefill_tokens, args.layers, args.context = [1, 3], 24, 2, 8
        timing.set_quick()
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(device)
    rows = [row("device", torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "copy", None,
                note=f"{copy_bw / 1e12:.2f} TB/s read+write")]
    print(f"device copy: {copy_bw / 1e12:.2f} TB/s", flush=True)
    if args.attention_prefill:
        from layer_kernels import LAYER_4B, LAYER_SMOKE, attention_prefill_rows
        for spec in args.attention_prefill:
            chunk, context = (int(x) for x in spec.split(":"))
            guarded(rows, "attention-prefill", lambda: attention_prefill_rows(
                LAYER_SMOKE if args.smoke else LAYER_4B, chunk, context, device))
        return finish(rows, args.out)
    if args.fp8_linear:
        from fp8_kernels import fp8_linear_rows
        guarded(rows, "fp8-linear", lambda: fp8_linear_rows(args.fp8_linear, device, copy_bw, args.sweep, args.smoke))
        return finish(rows, args.out)
    if args.moe_split:
        from moe_kernels import split_rows
        guarded(rows, "moe-split", lambda: split_rows(device, copy_bw, args.smoke, args.moe_split))
        return finish(rows, args.out)
    if args.moe:
        from moe_kernels import moe_rows
        guarded(rows, "moe", lambda: moe_rows(args.moe, device, copy_bw, args.sweep, args.smoke))
        return finish(rows, args.out)
    gdn_conv = not (args.skip_kernels or args.only_sampling)
    for batch in args.batches if gdn_conv else []:
        guarded(rows, "gdn-decode", lambda: gdn_rows(shape, batch, 0, device, copy_bw, args.accepted))
        guarded(rows, "gdn-verify", lambda: gdn_rows(shape, batch, args.num_drafts, device, copy_bw, args.accepted))
        for n, section in ((1, "conv-decode"), (args.num_drafts + 1, "conv-verify")):
            guarded(rows, section, lambda: conv_rows(shape, batch, n, n - 1, device, copy_bw, section))
        guarded(rows, "layer", lambda: layer_rows(batch, args.num_drafts, args.context, device, copy_bw,
                                                  args.smoke))
        print(f"kernels at b{batch} done", flush=True)
    if not (args.skip_kernels or args.skip_sampling) and (device.type == "cuda" or args.smoke):
        from sampling_bench import VOCAB_4B, sampling_rows
        vocab = 300 if args.smoke else VOCAB_4B
        for batch in args.batches:
            guarded(rows, "sampling", lambda: sampling_rows(batch, args.num_drafts, device, copy_bw, vocab))
    if gdn_conv:
        guarded(rows, "gdn-prefill", lambda: prefill_rows(shape, 1, args.prefill_tokens, device, copy_bw))
        guarded(rows, "gdn-prefill", lambda: prefill_rows(shape, 4, args.prefill_tokens // 4, device, copy_bw))
    if not (args.skip_step or args.only_sampling):
        from step_bench import step_rows
        guarded(rows, "step", lambda: step_rows(args, device, copy_bw))
    return finish(rows, args.out)


def finish(rows: list[dict], out_dir: str) -> int:
    """Write kernels.json under `out_dir` and print the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "device": rows[0]["case"], "torch": torch.__version__,
            "fla": fla_fused_recurrent() is not None}
    (out / "kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
