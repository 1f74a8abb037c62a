"""`specdec gateway`: the public endpoint: gRPC, and the OpenAI-compatible HTTP API with --http-port (tokenizer,
chat template, detokenizer, stop strings). Imports no torch."""
import argparse
import os

from .cli_args import add_listen_args


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
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at :PORT/metrics, same --host (0: any free port; default: off)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key), HTTPS too")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None,
                   help="PEM CA bundle: require client certificates signed by it (mutual TLS)")
    p.add_argument("--api-key-file", default=None,
                   help="file whose first line is the API key; gRPC calls and HTTP requests under /v1 must send "
                        "'authorization: Bearer <key>' (default: $SPECDEC_API_KEY if set, else no key)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request accepted, in bytes (default 4 MiB); bigger ones get RESOURCE_EXHAUSTED "
                        "(HTTP: 413)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gateway.http_api.config import HttpConfig
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
    tls = ServerTls.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)
    api_key = read_api_key(args.api_key_file, os.environ.get("SPECDEC_API_KEY"))
    http = None
    if args.http_port is not None:
        http = HttpConfig(args.http_port, args.host, api_key, max_bytes, args.tls_cert if tls else None,
                          args.tls_key if tls else None, args.tls_client_ca if tls else None)
    config = GatewayConfig(model, args.verifier_address, args.host, args.port, tls=tls, api_key=api_key,
                           max_request_bytes=max_bytes, http=http, metrics_port=args.metrics_port)
    serve(config)
    return 0
