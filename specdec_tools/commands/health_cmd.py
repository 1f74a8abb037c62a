"""`specdec health ADDRESS`: exit 0 if the gRPC server there is SERVING (container health checks)."""
import argparse
import sys

from .cli_args import add_client_security_args, client_security


def add_parser(sub) -> None:
    p = sub.add_parser("health", help="probe a specdec service's grpc.health.v1 status",
                       description="Exit 0 when the server at ADDRESS reports SERVING, 1 otherwise. Health needs "
                                   "no API key; a TLS gateway needs the --tls* options.")
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--service", default="", help="service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=2.0)
    add_client_security_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdec.rpc.health_probe import is_serving
    ok = is_serving(args.address, args.service, args.timeout, client_security(args).credentials())
    print("SERVING" if ok else "NOT_SERVING", file=sys.stderr)
    return 0 if ok else 1
