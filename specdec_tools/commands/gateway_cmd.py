"""`specdec gateway`: the public endpoint: gRPC, and the OpenAI-compatible HTTP API with --http-port (tokenizer,
chat template, detokenizer, stop strings). Imports no torch."""
import argparse
import os

from .cli_args import add_listen_args

DEFAULT_MAX_TOKENS_DEFAULT = 1024   # gateway.generator's (not imported here: `specdec --help` stays light)


def add_parser(sub) -> None:
    p = sub.add_parser("gateway", help="serve the public API (specdec.rpc.v1.Gateway; OpenAI HTTP with --http-port)",
                       description="Tokenize, forward to the verifier, stream tokens and text back, over gRPC and, "
                                   "with --http-port, the OpenAI API (/v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health). Health follows the verifier's. Without TLS and an API key, "
                                   "keep it on 127.0.0.1 (SECURITY.md).")
    p.add_argument("--model", default=os.environ.get("SPECDEC_MODEL") or None,
                   help="model folder, for its tokenizer files and chat template (default: $SPECDEC_MODEL, else the "
                        "demo model)")
    p.add_argument("--verifier-address", default="127.0.0.1:50052")
    add_listen_args(p, 50051)
    p.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port, same --host (0: any free port; "
                        "default: no HTTP)")
    add_public_args(p)
    p.set_defaults(run=run)


def add_public_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """What the public endpoint exposes and limits: metrics, TLS, the API key, request and completion sizes, HTTP
    timeouts and connections. `specdec serve` takes the same flags and hands them on (gateway_argv)."""
    group, actions = p.add_argument_group("the public endpoint: security and limits"), []

    def add(*names, **kwargs):
        actions.append(group.add_argument(*names, **kwargs))
    add("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at :PORT/metrics, same --host (0: any free port; default: off)")
    add("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key), HTTPS too")
    add("--tls-key", default=None, help="PEM private key of --tls-cert")
    add("--tls-client-ca", default=None,
                   help="PEM CA bundle: require client certificates signed by it (mutual TLS)")
    add("--api-key-file", default=None,
                   help="file whose first line is the API key; gRPC calls and HTTP requests under /v1 must send "
                        "'authorization: Bearer <key>' (default: $SPECDEC_API_KEY if set, else no key)")
    add("--max-request-bytes", type=int, default=None,
                   help="largest request accepted, in bytes (default 4 MiB); bigger ones get RESOURCE_EXHAUSTED "
                        "(HTTP: 413)")
    add("--max-tokens-default", type=int, default=DEFAULT_MAX_TOKENS_DEFAULT, metavar="N",
                   help="completion tokens of a request that gives no max_tokens (chat, and gRPC with it unset), "
                        "or fewer when the context leaves fewer; /v1/completions keeps OpenAI's 16 below it "
                        f"(default {DEFAULT_MAX_TOKENS_DEFAULT}: room for a long answer or a page of code, while a "
                        "client that forgets max_tokens no longer holds a slot for the whole context)")
    add("--max-tokens-limit", type=int, default=None, metavar="N",
                   help="the most completion tokens a request may ask for: more is refused (INVALID_ARGUMENT, "
                        "HTTP 400 naming max_tokens); also caps --max-tokens-default (default: no limit but the "
                        "context)")
    add("--http-header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="an HTTP request's line and headers must arrive within this, counted from the connection's "
                        "start or the next request's first byte; else the connection is closed (slowloris; "
                        "default 10)")
    add("--http-keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="close an idle kept-alive HTTP connection after this (default 5)")
    add("--http-max-connections", type=int, default=1024, metavar="N",
                   help="open HTTP connections at most; one more is answered 503 and closed at once (default 1024; "
                        "the open-file limit is raised to fit)")
    return actions


def gateway_argv(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The `specdec gateway` flags among `actions` that `args` sets to other than their defaults."""
    argv = []
    for action in actions:
        value = getattr(args, action.dest)
        if value is not None and value != action.default:
            argv += [action.option_strings[0], str(value)]
    return argv


def run(args: argparse.Namespace) -> int:
    from gateway.http_api.config import HttpConfig
    from gateway.generator import MaxTokens
    from gateway.server import GatewayConfig, serve
    from specdec.demo import DEMO_DIR
    from specdec.rpc import serving
    from specdec.rpc.security import ServerTls, read_api_key
    model = args.model or (str(DEMO_DIR) if (DEMO_DIR / "config.json").is_file() else None)
    max_bytes = args.max_request_bytes or serving.PUBLIC_MAX_REQUEST_BYTES
    if max_bytes < 1024:
        raise ValueError(f"--max-request-bytes {max_bytes}: too small for any request (at least 1024)")
    for flag in ("port", "http_port", "metrics_port"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < 65536:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: a port is in [0, 65535]")
    for flag in ("max_tokens_default", "max_tokens_limit", "http_header_timeout", "http_keep_alive_timeout",
                 "http_max_connections"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be positive")
    tls = ServerTls.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)
    api_key = read_api_key(args.api_key_file, os.environ.get("SPECDEC_API_KEY"))
    http = None
    if args.http_port is not None:
        http = HttpConfig(args.http_port, args.host, api_key, max_bytes, args.tls_cert if tls else None,
                          args.tls_key if tls else None, args.tls_client_ca if tls else None,
                          header_timeout_s=args.http_header_timeout, keep_alive_timeout_s=args.http_keep_alive_timeout,
                          max_connections=args.http_max_connections)
    config = GatewayConfig(model, args.verifier_address, args.host, args.port, tls=tls, api_key=api_key,
                           max_request_bytes=max_bytes, http=http, metrics_port=args.metrics_port,
                           max_tokens=MaxTokens(args.max_tokens_default, args.max_tokens_limit))
    serve(config)
    return 0
