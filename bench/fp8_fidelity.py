"""How much FP8 weights change a model: top-1 agreement and KL of FP8 vs the checkpoint's own logits, and whether
greedy speculation on the FP8 model gives the FP8 model's plain output.

    python -P bench/fp8_fidelity.py                       # the demo model, 256 windows of held-out source
    python -P bench/fp8_fidelity.py --model DIR --device cuda --dtype bfloat16

The FP8 model is the same checkpoint loaded with `--quantization fp8` (its linears rounded through e4m3 with
128 x 128 block scales, specdec/models/fp8.py); an FP8 checkpoint (`--fp8-model DIR`) can be compared instead.
`--fp8-weights kept` keeps the linears in FP8 as a GPU does (specdec/models/fp8_linear.py), through the kernels'
torch reference on a CPU; `dequantized` (the CPU's default) multiplies by the dequantized weights; `auto` does what
the device does.
Windows are `--window` tokens of the demo model's held-out files (Python standard library sources it was not
trained on), every position scored: top-1 agreement = the FP8 argmax equals the reference argmax; KL = KL(p_ref ||
p_fp8) in nats, mean over positions. The greedy check runs `--spec-prompts` prompts through the engine with the MTP
drafter and without, on the FP8 model.
"""
from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch

from specdec.demo import demo_model_dir
from specdec.models.caches import ModelCaches
from specdec.models.forward_batch import ForwardBatch
from specdec.models.loader import load_model
from specdec.sampling_params import SamplingParams

HELD_OUT = ("bisect.py", "calendar.py", "colorsys.py", "csv.py", "difflib.py", "fnmatch.py", "fractions.py", "glob.py",
            "gzip.py", "heapq.py", "html/parser.py", "ipaddress.py", "json/decoder.py", "netrc.py", "numbers.py",
            "operator.py", "pprint.py", "quopri.py", "sched.py", "shlex.py", "statistics.py", "string.py",
            "textwrap.py", "wave.py")


def windows(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens, taken in turn from the held-out files (evenly spaced in each)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [tokenizer.encode((stdlib / name).read_text()) for name in HELD_OUT if (stdlib / name).is_file()]
    out = []
    for i in range(count):
        ids = files[i % len(files)]
        turn, turns = i // len(files), -(-count // len(files))
        start = (len(ids) - length) * turn // max(turns - 1, 1)
        out.append(ids[start:start + length])
    return out


@torch.inference_mode()
def logits_of(model, prompts: list[list[int]], device: str, block_size: int = 16) -> torch.Tensor:
    """[Σ len, V] fp32 logits at every position (one prefill of all prompts)."""
    num_blocks = sum(-(-len(p) // block_size) for p in prompts)
    caches = ModelCaches.allocate(model.config, num_blocks=num_blocks, block_size=block_size,
                                  num_gdn_slots=len(prompts), device=device, dtype=model.embed_tokens.weight.dtype)
    tables, first = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append(list(range(first, first + n)))
        first += n
    batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, block_size, list(range(len(prompts))),
                               logits="all", device=device)
    return model(batch, caches)[1].float()


def compare(reference, fp8, prompts: list[list[int]], device: str, batch: int) -> dict:
    agree = kl_sum = positions = 0
    for at in range(0, len(prompts), batch):
        part = prompts[at:at + batch]
        ref_logp = logits_of(reference, part, device).log_softmax(-1)
        fp8_logp = logits_of(fp8, part, device).log_softmax(-1)
        agree += (ref_logp.argmax(-1) == fp8_logp.argmax(-1)).sum().item()
        kl_sum += (ref_logp.exp() * (ref_logp - fp8_logp)).sum().item()
        positions += ref_logp.shape[0]
    return {"positions": positions, "top1_agreement": agree / positions, "mean_kl_nats": kl_sum / positions}


def greedy_spec_equals_plain(model_dir: str, quantization: str, prompts: list[list[int]], device: str,
                             dtype: str, max_tokens: int, fp8_weights: bool | None = None) -> dict:
    from specdec_tools.commands.in_process_drafter import in_process_drafter
    from verifier_service.builder import VerifierConfig, build_engine
    outputs, stats = {}, None
    for drafter in ("mtp", None):
        config = VerifierConfig(model_dir=model_dir, device=device, dtype=dtype, num_drafts=3 if drafter else 0,
                                in_process_drafter=drafter, quantization=quantization, max_context=1024,
                                max_running=8, max_batched_tokens=512, prefill_chunk=256, warm_up=False)
        loaded = load_model(model_dir, dtype, device, quantization=quantization, fp8_weights=fp8_weights)
        engine = build_engine(config, in_process_drafter(drafter) if drafter else None, loaded)
        outputs[drafter] = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        stats = stats or engine.stats
    same = sum(a == b for a, b in zip(outputs["mtp"], outputs[None]))
    return {"prompts": len(prompts), "identical": same, "mtp_mean_acceptance_length": stats.mean_acceptance_length}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(demo_model_dir()), help="reference checkpoint (default: the demo model)")
    p.add_argument("--fp8-model", default=None, help="an FP8 checkpoint to compare (default: --model with "
                                                     "--quantization fp8)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fp8-weights", choices=["auto", "kept", "dequantized"], default="auto",
                   help="kept: FP8 linears as a GPU runs them; dequantized: dequantized weights; auto: the device's")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--window", type=int, default=128, help="tokens per window")
    p.add_argument("--batch", type=int, default=16, help="windows per forward")
    p.add_argument("--spec-prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt in the speculation check")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(args.model) / "tokenizer.json"))
    prompts = windows(tokenizer, args.prompts, args.window)
    start = time.perf_counter()
    reference = load_model(args.model, args.dtype, args.device).model
    fp8_dir, quantization = (args.fp8_model, "none") if args.fp8_model else (args.model, "fp8")
    fp8_weights = {"auto": None, "kept": True, "dequantized": False}[args.fp8_weights]
    fp8 = load_model(fp8_dir, args.dtype, args.device, quantization=quantization, fp8_weights=fp8_weights).model
    result = {"model": args.model, "fp8": fp8_dir if args.fp8_model else "--quantization fp8", "dtype": args.dtype,
              "fp8_weights": args.fp8_weights, "windows": len(prompts), "window": args.window,
              "logits": compare(reference, fp8, prompts, args.device, args.batch),
              "greedy_fp8_spec_vs_plain": greedy_spec_equals_plain(fp8_dir, quantization,
                                                                    [w[:32] for w in prompts[:args.spec_prompts]],
                                                                    args.device, args.dtype, args.max_tokens,
                                                                    fp8_weights),
              "seconds": round(time.perf_counter() - start, 1)}
    logits, greedy = result["logits"], result["greedy_fp8_spec_vs_plain"]
    print(f"FP8 vs {args.dtype} logits over {logits['positions']} positions ({len(prompts)} windows of "
          f"{args.window}): top-1 agreement {logits['top1_agreement']:.4f}, mean KL {logits['mean_kl_nats']:.5f} nats")
    print(f"greedy FP8 with the MTP drafter vs plain FP8: {greedy['identical']} of {greedy['prompts']} prompts "
          f"identical ({args.max_tokens} tokens each; mean acceptance length "
          f"{greedy['mtp_mean_acceptance_length']:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if greedy["identical"] == greedy["prompts"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
