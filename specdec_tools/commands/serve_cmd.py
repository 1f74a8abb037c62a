"""`specdec serve`: gateway + verifier + drafter as separate local processes, until Ctrl-C."""
import argparse
import sys

from .cli_args import (add_draft_policy_arg, add_enforce_eager_arg, add_load_format_arg, add_model_args,
                       add_quantization_arg, add_tensor_parallel_arg, device_name, resolve)
from .gateway_cmd import add_public_args, gateway_argv
from .in_process_drafter import IN_PROCESS_KINDS


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="start gateway, verifier and drafter locally (one command)",
                       description="Start the three services as separate processes on 127.0.0.1, wait until "
                                   "all are healthy, print the gateway address, stop them all on Ctrl-C, SIGTERM "
                                   "or SIGHUP. The services also exit if this process is killed. While serving, "
                                   "a service that dies is logged and restarted after a backoff (1 s, doubling up "
                                   "to 30 s): the drafter always (decoding goes on without drafts meanwhile), the "
                                   "verifier and the gateway up to --max-restarts times in a row; one more death "
                                   "stops the stack and `serve` exits with status 3, for an outer supervisor "
                                   "(systemd, compose restart:, Kubernetes) to act on.")
    add_model_args(p)
    add_stack_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address the gateway listens on (the verifier and the drafter stay on 127.0.0.1); beyond "
                        "this host, serve TLS and an API key (SECURITY.md)")
    p.add_argument("--port", type=int, default=50051, help="gateway port (0: any free port)")
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (0: any free port; default: off)")
    p.add_argument("--verifier-metrics-port", type=int, default=0, metavar="PORT",
                   help="the verifier's Prometheus metrics on 127.0.0.1:PORT (default: off; --metrics-port is the "
                        "gateway's)")
    public = add_public_args(p)
    p.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="restarts of a dead verifier or gateway in a row before the stack stops and `serve` exits "
                        "with status 3 (default 5; a service healthy for 60 s starts its count over; 0: stop at "
                        "the first death). A dead drafter is always restarted")
    p.set_defaults(run=run, public_args=public)


def add_stack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default=None,
                   help="mtp | draft_model | ngram | none | an installed plugin's kind "
                        "(default: mtp when the checkpoint has mtp.* weights, else ngram)")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="with --drafter draft_model: the smaller model that drafts (same tokenizer as --model)")
    p.add_argument("-k", "--num-drafts", type=int, default=3)
    add_draft_policy_arg(p)
    p.add_argument("--transport", default="auto", choices=["auto", "cuda_ipc", "shm", "inline"])
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="with the mtp drafter: draft over the ids of this `specdec draft-vocab` file only")
    add_enforce_eager_arg(p)
    add_tensor_parallel_arg(p)
    p.add_argument("--drafter-device", default=None, metavar="DEVICE", type=device_name,
                   help="the drafter service's device, e.g. cuda:1 for a GPU of its own (default: the verifier's "
                        "--device, its rank 0's GPU). On another GPU of this host hidden states still cross by "
                        "CUDA IPC, then a peer-to-peer copy; the shared embed_tokens / lm_head are copied once")
    add_load_format_arg(p)
    add_quantization_arg(p)
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="the verifier does not resume prompts from cached prefixes (default: on)")
    p.add_argument("--in-process-drafter", action=argparse.BooleanOptionalAction, default=None,
                   help="run the drafter (mtp or ngram) inside the verifier's process, with no drafter service "
                        "(default: on for `generate` on a CPU, where two processes taking turns on few cores cost "
                        "more than the exchange; off for `serve`, whose drafter can be swapped and restarted)")


def stack_config(args: argparse.Namespace, port: int, log_dir: str | None = None, http_port: int | None = None):
    from specdec_tools.local_stack import StackConfig
    from specdec.models.loader import has_mtp_weights
    model, device, dtype = resolve(args)
    drafter = args.drafter or ("mtp" if has_mtp_weights(model) else "ngram")
    if drafter != "none":
        from drafter_service.factory import available_kinds
        if drafter not in available_kinds():
            raise ValueError(f"--drafter {drafter!r}: choose none or one of {', '.join(available_kinds())}")
    if (drafter == "draft_model") != bool(args.draft_model):
        raise ValueError("--drafter draft_model and --draft-model DIR go together")
    if args.draft_vocab and drafter != "mtp":
        raise ValueError("--draft-vocab goes with the mtp drafter")
    in_process = args.in_process_drafter
    if in_process is None:   # the default: `generate` passes in_process_default
        in_process = (getattr(args, "in_process_default", False) and device == "cpu" and drafter in IN_PROCESS_KINDS
                      and args.tensor_parallel_size == 1)
    if in_process and drafter not in IN_PROCESS_KINDS + ("none",):
        raise ValueError(f"--in-process-drafter runs {' or '.join(IN_PROCESS_KINDS)}, not --drafter {drafter}")
    if in_process and drafter == "mtp" and args.tensor_parallel_size != 1:
        raise ValueError("--in-process-drafter mtp cannot run beside tensor-parallel ranks: drop it (the drafter "
                         "then runs as a service)")
    drafter_args = ("--draft-model", args.draft_model) if args.draft_model else ()
    drafter_args += ("--draft-vocab", args.draft_vocab) if args.draft_vocab else ()
    drafter_args += ("--enforce-eager",) if args.enforce_eager and not in_process else ()
    verifier_args = ("--enforce-eager",) if args.enforce_eager else ()
    verifier_args += ("--draft-policy", args.draft_policy)
    if args.tensor_parallel_size != 1:
        verifier_args += ("--tensor-parallel-size", str(args.tensor_parallel_size), "--all-reduce", args.all_reduce)
    if args.drafter_device:
        if in_process or drafter == "none":
            raise ValueError("--drafter-device places the drafter service: not with --in-process-drafter or "
                             "--drafter none")
        drafter_args += ("--device", args.drafter_device)
    if args.quantization != "none":
        verifier_args += ("--quantization", args.quantization)
    if args.load_format != "safetensors":
        verifier_args += ("--load-format", args.load_format)
        drafter_args += ("--load-format", args.load_format) if not in_process else ()
    if getattr(args, "verifier_metrics_port", 0):
        verifier_args += ("--metrics-port", str(args.verifier_metrics_port))
    if not args.prefix_caching:
        verifier_args += ("--no-prefix-caching",)
    public = getattr(args, "public_args", None)    # `serve`'s gateway flags (`generate` starts a plain stack)
    return StackConfig(model=model, drafter=drafter, num_drafts=args.num_drafts, drafter_in_process=in_process,
                       device=device, dtype=dtype,
                       port=port, http_port=http_port, transport=args.transport, log_dir=log_dir,
                       drafter_args=drafter_args, verifier_args=verifier_args,
                       gateway_args=tuple(gateway_argv(args, public)) if public else (),
                       gateway_host=getattr(args, "host", "127.0.0.1"), gateway_tls=bool(getattr(args, "tls_cert", None)))


def run(args: argparse.Namespace) -> int:
    from specdec_tools.local_stack import LocalStack, run_stack
    from specdec_tools.stack_supervisor import RestartPolicy, Supervisor
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: at least 0")
    stack = LocalStack(stack_config(args, args.port, http_port=args.http_port))
    c = stack.config

    def until_stopped(address: str) -> int:
        http = f", OpenAI API on {stack.http_url}" if stack.http_url else ""
        print(f"specdec serving {c.model} on {address}{http} (drafter {c.drafter}, k={c.num_drafts}, {c.device}); "
              f"Ctrl-C to stop", file=sys.stderr, flush=True)
        # Sleeps in short ticks, never one endless wait: the kernel may deliver a process's signal to any of its
        # threads, and a main thread blocked on a lock is then never woken to run the Python handler.
        return Supervisor(stack, RestartPolicy(max_restarts=args.max_restarts)).run()
    code = run_stack(stack, until_stopped)
    return 0 if code == 130 else code  # stopping on a signal is how `serve` is meant to end
