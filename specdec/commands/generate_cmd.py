"""`specdec generate`: complete a prompt with the target model, in this process."""
import argparse
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt and stream it to the terminal",
                       description="Complete a prompt (text, or --prompt-token-ids) greedily and print it.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (needs tokenizer files in the model folder)")
    p.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids instead of text")
    p.add_argument("--model", required=True, help="Hugging Face model folder")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (bf16 on GPU, fp32 on CPU)")
    p.set_defaults(run=run)


def resolve_device(device: str, dtype: str) -> tuple[str, str]:
    import torch
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def prompt_ids(args, model_dir: str) -> tuple[list[int], object | None]:
    if args.prompt_token_ids:
        try:
            return [int(t) for t in args.prompt_token_ids.split(",") if t.strip()], None
        except ValueError as e:
            raise ValueError(f"--prompt-token-ids: {e}") from e
    if args.prompt is None:
        raise ValueError("give a prompt or --prompt-token-ids")
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir} has no usable tokenizer ({e}); use --prompt-token-ids") from e
    return tokenizer.encode(args.prompt), tokenizer


def run(args: argparse.Namespace) -> int:
    from specdec.models.loader import load_model
    from verifier_service.model_runner import ModelRunner
    from verifier_service.plain_generate import greedy_generate
    device, dtype = resolve_device(args.device, args.dtype)
    ids, tokenizer = prompt_ids(args, args.model)
    loaded = load_model(args.model, dtype=dtype, device=device)
    block_size = 16
    runner = ModelRunner(loaded, num_blocks=(len(ids) + args.max_tokens) // block_size + 2,
                         block_size=block_size, max_seqs=1, device=device)
    start = time.perf_counter()
    out = greedy_generate(runner, [ids], args.max_tokens)[0]
    elapsed = time.perf_counter() - start
    print(tokenizer.decode(out) if tokenizer else " ".join(map(str, out)))
    print(f"[{len(ids)} prompt tokens, {len(out)} completion tokens, {elapsed:.2f} s]", file=sys.stderr)
    return 0
