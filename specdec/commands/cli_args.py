"""Arguments shared by the service commands, and how they become configs."""
import argparse
import os


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("SPECDEC_MODEL") or None,
                   help="Hugging Face model folder (default: $SPECDEC_MODEL, else the embedded demo model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (bf16 on GPU, fp32 on CPU)")


def add_enforce_eager_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every verifier step eagerly: no CUDA graphs (slower; for debugging and comparisons)")


def add_listen_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=default_port, help="port to listen on (0: any free port)")


def resolve(args: argparse.Namespace) -> tuple[str, str, str]:
    """(model_dir, device, dtype) with the defaults filled in."""
    import torch

    from specdec.demo import demo_model_dir
    model = args.model or demo_model_dir()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return model, device, dtype
