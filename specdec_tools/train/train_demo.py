"""Train a small Qwen3.5 text model with an MTP head on the Python standard library and export it.

    python -m specdec_tools.train.train_demo --out DIR [options]

Steps: collect the stdlib sources (corpus), train a byte-level BPE (bpe), tokenize training and held-out
files, train trunk + MTP (trainer), evaluate on fixed held-out windows, write a Hugging Face checkpoint
folder (export) with a model card and training_log.json (model_card).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import platform
import random
import sys
import time
from pathlib import Path

import torch

from . import bpe, corpus
from .data import WindowSampler, fixed_windows
from .export import MAX_FOLDER_BYTES, write_weights
from .model import DemoModel, ModelShape, build_config, evaluate
from .model_card import write_card_and_log
from .trainer import Trainer, TrainSettings

PERIODIC_EVAL_WINDOWS = 32  # held-out windows used by --eval-every (the final evaluation uses all)
# what a previous run leaves in --out (may be overwritten); anything else there stops the run
OWN_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json", "README.md", "training_log.json"})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m specdec_tools.train.train_demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a small Qwen3.5 (text) model with one MTP layer on the Python standard library's "
                    "own source and write a Hugging Face checkpoint folder (bf16 safetensors, tokenizer, "
                    "model card) that transformers and specdec both load.")
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to write (created)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto = cuda if available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="training autocast dtype (auto: bfloat16 on cuda, float32 on cpu); master weights fp32")
    g = p.add_argument_group("data")
    g.add_argument("--train-files", type=int, default=None, help="use only N training files (evenly spaced)")
    g.add_argument("--tokenizer-files", type=int, default=None,
                   help="train the BPE on only N of the training files (evenly spaced)")
    g.add_argument("--vocab-size", type=int, default=4096)
    g = p.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=8, help="layer i is full attention iff (i+1) %% 4 == 0")
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--gdn-key-heads", type=int, default=4)
    g.add_argument("--gdn-value-heads", type=int, default=8)
    g.add_argument("--gdn-head-dim", type=int, default=32)
    g.add_argument("--intermediate", type=int, default=768)
    g = p.add_argument_group("training")
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--steps", type=int, default=3000)
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (linear warm-up, cosine decay)")
    g.add_argument("--warmup-steps", type=int, default=150)
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of --lr")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--dropout", type=float, default=0.1,
                   help="training-only dropout on embedding / mixer / MLP outputs (not part of the checkpoint); "
                        "the stdlib is small (~2.5-3M tokens), and without it the model memorises it")
    g.add_argument("--mtp-weight", type=float, default=0.3, help="loss = next-token CE + w * MTP CE")
    g.add_argument("--max-minutes", type=float, default=None,
                   help="stop training after this many minutes (the schedule is fitted to it); still exports")
    g.add_argument("--log-every", type=int, default=50)
    g.add_argument("--eval-every", type=int, default=500, help="held-out eval every N steps (0 = only at the end)")
    g.add_argument("--eval-windows", type=int, default=256, help="held-out windows of seq-len+2 tokens")
    args = p.parse_args(argv)
    if args.gdn_value_heads % args.gdn_key_heads or args.heads % args.kv_heads:
        p.error("--gdn-value-heads must be a multiple of --gdn-key-heads and --heads of --kv-heads")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if args.out.exists():
        foreign = sorted(q.name for q in args.out.iterdir() if q.name not in OWN_FILES) if args.out.is_dir() else [""]
        if foreign:
            p.error(f"--out {args.out} must be a new or empty folder (or a previous output of this command); "
                    f"it holds {', '.join(foreign[:3]) or 'a file'}")
    return args


def log(message: str) -> None:
    print(message, flush=True)


def resolve(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    name = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return device, getattr(torch, name)


def make_autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def prepare_corpus(args: argparse.Namespace, out: Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Tokenizer (saved into `out`), the training and held-out token streams, and the corpus summary."""
    root = corpus.stdlib_root()
    train = corpus.spread(corpus.training_files(root), args.train_files)
    held = corpus.held_out_files(root)
    tok_files = corpus.spread(train, args.tokenizer_files)
    t0 = time.perf_counter()
    tok = bpe.train_tokenizer(tok_files, args.vocab_size)
    bpe.save_tokenizer(tok, out)
    train_stream, train_bytes = bpe.encode_files(tok, train)
    held_stream, held_bytes = bpe.encode_files(tok, held)
    log(f"corpus: {len(train)} training files ({train_stream.numel():,} tokens), {len(held)} held-out files "
        f"({held_stream.numel():,} tokens); tokenizer vocab {tok.get_vocab_size()} "
        f"({time.perf_counter() - t0:.1f}s)")
    info = {"python_version": platform.python_version(), "stdlib_root": str(root),
            "train_files": len(train), "held_out_files": len(held),
            "train_tokens": train_stream.numel(), "held_out_tokens": held_stream.numel(),
            "train_bytes": train_bytes, "held_out_bytes": held_bytes,
            "held_out_names": [corpus.relative_name(f, root) for f in held]}
    tokenizer = {"vocab_size": tok.get_vocab_size(), "requested_vocab_size": args.vocab_size,
                 "trained_on_files": len(tok_files)}
    return {"corpus": info, "tokenizer": tokenizer}, train_stream, held_stream


def settings_from(args: argparse.Namespace) -> TrainSettings:
    return TrainSettings(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup_steps=min(args.warmup_steps, max(1, args.steps // 10)), weight_decay=args.weight_decay,
        mtp_weight=args.mtp_weight, max_seconds=args.max_minutes * 60 if args.max_minutes else None,
        log_every=args.log_every, eval_every=args.eval_every)


def shape_from(args: argparse.Namespace) -> ModelShape:
    return ModelShape(vocab_size=args.vocab_size, hidden=args.hidden, layers=args.layers, heads=args.heads,
                      kv_heads=args.kv_heads, head_dim=args.head_dim, gdn_key_heads=args.gdn_key_heads,
                      gdn_value_heads=args.gdn_value_heads, gdn_head_dim=args.gdn_head_dim,
                      intermediate=args.intermediate)


def training_summary(args, argv, settings: TrainSettings, device, dtype, result) -> dict:
    import transformers
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {"device": device.type, "device_name": name, "autocast_dtype": str(dtype).removeprefix("torch."),
            "seed": args.seed, "seq_len": args.seq_len, "steps": settings.steps, "batch_size": settings.batch_size,
            "lr": settings.lr, "min_lr_ratio": settings.min_lr_ratio, "warmup_steps": settings.warmup_steps,
            "weight_decay": settings.weight_decay, "betas": list(settings.betas), "grad_clip": settings.grad_clip,
            "mtp_weight": settings.mtp_weight, "dropout": args.dropout, "max_minutes": args.max_minutes,
            "steps_done": result.steps_done, "tokens_seen": result.tokens_seen,
            "train_seconds": result.train_seconds, "eval_seconds": result.eval_seconds,
            "stopped_early": result.stopped_early, "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "command": " ".join(["python -m specdec_tools.train.train_demo", *argv])}


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = resolve(args)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    seed_everything(args.seed)
    started = time.perf_counter()
    info, train_stream, held_stream = prepare_corpus(args, out)

    shape = shape_from(args)
    model = DemoModel(build_config(shape, eos_token_id=0)).to(device)
    model.add_dropout(args.dropout)
    n_params, n_mtp = model.num_parameters(), sum(p.numel() for p in model.mtp.parameters())
    log(f"model: {n_params:,} parameters ({n_mtp:,} in the MTP head), layers {shape.layer_types()}; "
        f"device {device}, autocast {dtype}")

    window = args.seq_len + 2
    sampler = WindowSampler(train_stream, window, device, args.seed)
    held_windows = fixed_windows(held_stream, window, args.eval_windows).to(device)
    pick = torch.linspace(0, held_windows.shape[0] - 1, min(PERIODIC_EVAL_WINDOWS, held_windows.shape[0])).long()
    autocast = make_autocast(device, dtype)
    settings = settings_from(args)
    periodic = functools.partial(evaluate, model, held_windows[pick.to(device)], args.batch_size, autocast)
    result = Trainer(model, sampler, settings, autocast, periodic, log).run()

    held_loss, held_mtp = evaluate(model, held_windows, args.batch_size, autocast)
    log(f"done: {result.steps_done} steps in {result.train_seconds:.0f}s; final train loss "
        f"{result.final_train_loss:.4f} (mtp {result.final_train_mtp_loss:.4f}); held-out loss {held_loss:.4f} "
        f"(mtp {held_mtp:.4f}) on {held_windows.shape[0]} windows")

    export = write_weights(model, out)
    run_log = {**info,
               "model": {"shape": shape.as_dict(), "layer_types": shape.layer_types(), "parameters": n_params,
                         "trunk_parameters": n_params - n_mtp, "mtp_parameters": n_mtp},
               "training": training_summary(args, argv, settings, device, dtype, result),
               "results": {"final_train_loss": result.final_train_loss,
                           "final_train_mtp_loss": result.final_train_mtp_loss,
                           "held_out_loss": held_loss, "held_out_mtp_loss": held_mtp,
                           "held_out_windows": held_windows.shape[0], "window_tokens": args.seq_len,
                           "total_seconds": time.perf_counter() - started},
               "export": export, "history": result.history, "evals": result.evals}
    total = write_card_and_log(out, run_log, MAX_FOLDER_BYTES)
    log(f"wrote {out} ({total / 1e6:.2f} MB <= {MAX_FOLDER_BYTES / 1e6:.0f} MB; model.safetensors "
        f"{export['model_safetensors_bytes'] / 1e6:.2f} MB) in {time.perf_counter() - started:.0f}s total")
    return out


if __name__ == "__main__":
    main()
