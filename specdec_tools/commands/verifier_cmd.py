"""`specdec verifier`: serve the target model with speculative decoding over gRPC."""
import argparse

from .cli_args import (add_cache_args, add_draft_policy_arg, add_enforce_eager_arg, add_listen_args,
                       add_load_format_arg, add_model_args, add_no_overlap_arg, add_quantization_arg,
                       add_tensor_parallel_arg, add_trace_steps_arg, check_cache_args, resolve)
from .in_process_drafter import IN_PROCESS_KINDS, in_process_drafter


def add_parser(sub) -> None:
    p = sub.add_parser("verifier", help="serve the target model (verification, caches, scheduling) over gRPC",
                       description="Load the target, connect to a drafter (retrying while it is away: requests "
                                   "then decode without drafts), and serve verifier.proto.")
    add_model_args(p)
    add_tensor_parallel_arg(p)
    add_load_format_arg(p)
    add_quantization_arg(p)
    add_listen_args(p, 50052)
    p.add_argument("--drafter-address", default=None, help="HOST:PORT of a drafter; omit for plain decoding")
    p.add_argument("--in-process-drafter", default=None, choices=IN_PROCESS_KINDS,
                   help="run this drafter inside the verifier's process instead of a drafter service (one "
                        "process, no gRPC hop; the control for what the split costs)")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="--in-process-drafter mtp: draft over the ids of this `specdec draft-vocab` file only")
    p.add_argument("--draft-masks", default="auto", choices=["auto", "on", "off"],
                   help="--in-process-drafter mtp: keep grammar-constrained sequences' drafts inside their grammars "
                        "(auto: where it drafts eagerly, i.e. on the CPU or with --enforce-eager)")
    p.add_argument("-k", "--num-drafts", type=int, default=3)
    add_draft_policy_arg(p)
    p.add_argument("--transport", default="auto", choices=["auto", "cuda_ipc", "shm", "inline"],
                   help="hidden-state transport to the drafter (auto: cuda_ipc on GPU, shm on CPU, else inline)")
    p.add_argument("--step-channel", default="auto", choices=["auto", "grpc"],
                   help="how each step's message reaches the drafter: auto takes the local lane a drafter on this "
                        "host offers (a Unix socket, no gRPC threads in between; gRPC where it cannot be reached), "
                        "grpc always the gRPC stream")
    p.add_argument("--drafter-timeout", type=float, default=10.0, help="seconds before a drafter step counts as failed")
    p.add_argument("--drafter-wait", type=float, default=10.0, metavar="SECONDS",
                   help="at start-up, report SERVING only once the drafter is connected, waiting at most this long "
                        "(default 10; then it serves without drafts until the drafter comes; 0: do not wait). A "
                        "drafter that is down keeps a restarted verifier unavailable for this long")
    add_cache_args(p)
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests waiting beyond --max-running; more get RESOURCE_EXHAUSTED at once")
    add_enforce_eager_arg(p)
    add_no_overlap_arg(p)
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="report SERVING without the start-up warm-up (on a GPU the first requests of each step "
                        "shape then wait for its kernels to compile)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    add_trace_steps_arg(p)
    p.add_argument("--forced-acceptance-length", type=float, default=0.0,
                   help="BENCHMARKS ONLY: force this mean acceptance length (output is not the target's)")
    p.add_argument("--unsafe-forced-acceptance", action="store_true", help="allow --forced-acceptance-length")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from verifier_service.builder import VerifierConfig
    from verifier_service.server import serve
    check_cache_args(args)
    if args.drafter_wait < 0:
        raise ValueError(f"--drafter-wait must be >= 0, got {args.drafter_wait}")
    if args.max_queued < 0:
        raise ValueError(f"--max-queued must be >= 0, got {args.max_queued}")
    if args.drafter_address and args.in_process_drafter:
        raise ValueError("--drafter-address and --in-process-drafter exclude each other: one drafter per verifier")
    if args.draft_vocab and args.in_process_drafter != "mtp":
        raise ValueError("--draft-vocab goes with --in-process-drafter mtp (a drafter service takes its own)")
    make_drafter = in_process_drafter(args.in_process_drafter, args.draft_vocab, args.draft_masks) \
        if args.in_process_drafter else None
    drafting = args.drafter_address or args.in_process_drafter
    model, device, dtype = resolve(args)
    config = VerifierConfig(
        model_dir=model, device=device, dtype=dtype, num_drafts=args.num_drafts if drafting else 0,
        draft_policy=args.draft_policy,
        drafter_address=args.drafter_address, in_process_drafter=args.in_process_drafter, transport=args.transport,
        drafter_timeout_s=args.drafter_timeout, drafter_wait_s=args.drafter_wait, step_channel=args.step_channel,
        max_context=args.max_context, max_running=args.max_running, max_queued=args.max_queued,
        max_batched_tokens=args.max_batched_tokens,
        prefill_chunk=args.prefill_chunk, mixed_prefill_chunk=args.mixed_prefill_chunk,
        lone_prefill_chunk=args.lone_prefill_chunk, kv_blocks=args.kv_blocks,
        prefix_caching=args.prefix_caching, prefix_checkpoint_interval=args.prefix_checkpoint_interval,
        prefix_checkpoints=args.prefix_checkpoints,
        gpu_memory_utilization=args.gpu_memory_utilization, metrics_port=args.metrics_port,
        forced_acceptance_length=args.forced_acceptance_length, unsafe_forced_acceptance=args.unsafe_forced_acceptance,
        enforce_eager=args.enforce_eager, overlap=args.overlap, warm_up=args.warm_up,
        trace_steps=args.trace_steps, tensor_parallel_size=args.tensor_parallel_size, load_format=args.load_format,
        all_reduce=args.all_reduce,
        quantization=args.quantization)
    serve(config, args.host, args.port, make_drafter)
    return 0
