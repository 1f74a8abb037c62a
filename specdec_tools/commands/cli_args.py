"""Arguments shared by the service commands, and how they become configs."""
import argparse
import os


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("SPECDEC_MODEL") or None,
                   help="Hugging Face model folder (default: $SPECDEC_MODEL, else the embedded demo model)")
    p.add_argument("--device", default="auto", type=device_name, metavar="{auto,cpu,cuda,cuda:N}",
                   help="where the model runs (default auto: cuda when a GPU is visible, else cpu; cuda is the "
                        "first visible GPU; cuda:N another, e.g. a drafter on a GPU of its own)")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (bf16 on GPU, fp32 on CPU)")


def device_name(text: str) -> str:
    """--device's value: auto, cpu, cuda or cuda:N."""
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda"):
        return text
    if kind == "cuda" and index.isdigit():
        return f"cuda:{int(index)}"
    raise argparse.ArgumentTypeError(f"{text!r}: choose auto, cpu, cuda or cuda:N")


def add_load_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="safetensors (default): the checkpoint's weights; dummy: random weights of config.json's "
                        "shapes made on the device, no weight files needed (BENCHMARKS ONLY: the output is noise; "
                        "pair it with --forced-acceptance-length to time speculation)")


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="fp8: quantize the target's linears to Qwen's FP8 format (e4m3, 128 x 128 block scales) "
                        "at load time; an FP8 checkpoint is read as it is either way. On a GPU they stay FP8 (a "
                        "byte a weight read per step; activations stay in --dtype); on the CPU they are dequantized "
                        "into --dtype. The MoE routed experts and the MTP head are dequantized everywhere")


def add_tensor_parallel_arg(p: argparse.ArgumentParser, all_reduce: bool = True) -> None:
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the target over N ranks by heads and columns (rank r on cuda:r, started by the "
                        "verifier; NCCL between GPUs, gloo on the CPU); default 1")
    if all_reduce:
        p.add_argument("--all-reduce", default="one-shot", choices=["one-shot", "nccl"],
                       help="with --tensor-parallel-size on GPUs: one-shot (default) sums messages of up to 2 MiB "
                            "(decode and verify steps) in one kernel over peer-mapped buffers (torch's symmetric "
                            "memory), NCCL the larger ones; nccl: NCCL sums every message")


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """The verifier's limits and cache sizes (0: the default for the device; verifier_service/cache_sizing.py)."""
    p.add_argument("--max-context", type=int, default=0, metavar="TOKENS",
                   help="longest sequence, prompt and output (default: the model's max_position_embeddings, at most "
                        "what the KV pool holds)")
    p.add_argument("--max-running", type=int, default=0, metavar="N",
                   help="sequences decoded together, each with its own GDN state slot (default: 64 on a GPU, the "
                        "largest CUDA-graph batch; 16 on the CPU)")
    p.add_argument("--max-batched-tokens", type=int, default=0, metavar="N",
                   help="tokens per target forward: prompt chunks take what decoding sequences leave (default: 2048 "
                        "on a GPU, where a chunk alone replays a CUDA graph of up to 2048 tokens and a step of "
                        "several sequences one of up to 1024; 512 on the CPU; larger steps run eagerly)")
    p.add_argument("--prefill-chunk", type=int, default=0, metavar="N",
                   help="prompt tokens per sequence per step (default: 2048 on a GPU, 256 on the CPU)")
    p.add_argument("--mixed-prefill-chunk", type=int, default=0, metavar="N",
                   help="prompt tokens in all in a step that decoding sequences share: each of them waits for the "
                        "whole step, so this bounds their gap while a long prompt prefills (default: 512 on a GPU, "
                        "256 on the CPU; each prompt's chunk is at most --prefill-chunk)")
    p.add_argument("--lone-prefill-chunk", type=int, default=0, metavar="N",
                   help="a prompt chunk of N or more tokens runs alone, in steps that take turns with the other "
                        "running sequences (default 0: chunks share steps with them). On a GPU with fla-core "
                        "installed a chunk alone of 512 tokens or more replays its prefill graph with the chunked "
                        "gated-delta kernel; a mixed step's graph runs only its longest chunk with it")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="the share of the GPU's memory this process may hold (default 0.9): weights, activations, "
                        "CUDA graphs, and a shared pool of KV blocks sized from what is left; the start-up log says "
                        "how many tokens and sequences fit")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not resume prompts from cached prefixes (default: on: a prompt that starts like an "
                        "earlier one reuses its KV blocks and its GDN state at the longest kept checkpoint)")
    p.add_argument("--prefix-checkpoint-interval", type=int, default=0, metavar="TOKENS",
                   help="prefix caching keeps a prompt's GDN state every TOKENS tokens (a multiple of 16) and at its "
                        "end; a later prompt resumes from the last one it shares (default 0: the larger of 1024 and "
                        "--prefill-chunk, since a prompt chunk ends at each checkpoint)")
    p.add_argument("--prefix-checkpoints", type=int, default=0, metavar="N",
                   help="GDN states the prefix cache keeps, least recently used dropped (default 0: 2 x "
                        "--max-running); each takes what one running sequence's GDN state does")
    p.add_argument("--kv-blocks", type=int, default=0, metavar="N",
                   help="KV blocks of 16 tokens, overriding the sizing (default 0: from --gpu-memory-utilization on a "
                        "GPU; --max-running x min(context, 4096) tokens on the CPU)")


def check_cache_args(args: argparse.Namespace) -> None:
    for name in ("max_context", "max_running", "max_batched_tokens", "prefill_chunk", "mixed_prefill_chunk",
                 "lone_prefill_chunk", "kv_blocks", "prefix_checkpoints"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: the default), got {getattr(args, name)}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.prefix_checkpoint_interval < 0 or args.prefix_checkpoint_interval % 16:
        raise ValueError(f"--prefix-checkpoint-interval must be 0 (its default) or a multiple of 16 (the KV block "
                         f"size), got "
                         f"{args.prefix_checkpoint_interval}")


def add_enforce_eager_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no CUDA graphs (slower; for debugging and comparisons)")


def add_draft_policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-policy", default="auto", choices=["auto", "fixed", "adaptive"],
                   help="how many drafts a step verifies: fixed = always k; adaptive = the k in 0..k that maximises "
                        "expected tokens per second, from the batch size, each sequence's running acceptance and "
                        "step costs measured at start-up, and a sequence whose acceptance makes plain decoding "
                        "faster leaves the drafter for good (lossless either way: only speed changes); auto "
                        "(default) = adaptive on a GPU, fixed on the CPU")


def add_no_overlap_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="read each step's tokens before launching the next (default: while no request has "
                        "penalties or logprobs, with no drafter or an MTP drafter in process or on this host "
                        "(device steps), the next step is launched first, so the host's work between steps "
                        "runs while the GPU computes)")


def add_trace_steps_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-steps", default=None, metavar="FILE",
                   help="diagnostics: write timestamps of each step's phases to FILE (JSON lines); "
                        "`specdec trace-report` lines up the verifier's and the drafter's files")


def add_listen_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=default_port, help="port to listen on (0: any free port)")


def resolve(args: argparse.Namespace) -> tuple[str, str, str]:
    """(model_dir, device, dtype) with the defaults filled in."""
    import torch

    from specdec.demo import demo_model_dir
    model = args.model or demo_model_dir()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and int(device.partition(":")[2] or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: {torch.cuda.device_count()} GPU(s) visible to this process")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return model, device, dtype


def add_client_security_args(p: argparse.ArgumentParser) -> None:
    """How a client reaches a gateway served with TLS and/or an API key."""
    g = p.add_argument_group("gateway security (for a gateway started with --tls-* / --api-key-file)")
    g.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's root certificates")
    g.add_argument("--tls-ca", default=None, help="PEM CA bundle that signed the gateway's certificate (implies --tls)")
    g.add_argument("--tls-cert", default=None, help="PEM client certificate (when the gateway requires one)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--api-key-file", default=None,
                   help="file whose first line is the API key (default: $SPECDEC_API_KEY if set)")


def client_security(args: argparse.Namespace):
    from specdec.rpc.security import ClientSecurity, read_api_key
    return ClientSecurity.from_files(args.tls, args.tls_ca, args.tls_cert, args.tls_key,
                                     read_api_key(args.api_key_file, os.environ.get("SPECDEC_API_KEY")))
