"""`specdec gateway`: the public endpoint. Loads the tokenizer (if the model folder has one), waits for the
verifier, and serves specdec.rpc.v1.Gateway until SIGINT / SIGTERM."""
from __future__ import annotations

import logging
import time

import grpc

from specdec.rpc import serving
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc

from .servicer import GatewayServicer
from .tokenizer import TextTokenizer

log = logging.getLogger(__name__)
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def verifier_info(stub: verifier_pb2_grpc.VerifierStub, address: str, wait_s: float) -> gateway_pb2.InfoResponse:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return stub.Info(gateway_pb2.InfoRequest(), timeout=5.0)
        except grpc.RpcError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"verifier at {address} did not answer within {wait_s:.0f}s: {e.code()}") from e
            time.sleep(0.5)


def start(model_dir: str | None, verifier_address: str, host: str, port: int,
          wait_s: float = 600.0) -> serving.RunningServer:
    tokenizer = TextTokenizer.from_folder(model_dir) if model_dir else None
    channel = grpc.insecure_channel(verifier_address, options=serving.channel_options())
    stub = verifier_pb2_grpc.VerifierStub(channel)
    servicer = GatewayServicer(stub, tokenizer, gateway_pb2.InfoResponse())
    running = serving.start_server(lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
                                   [SERVICE], host, port)
    log.info("gateway waiting for the verifier at %s", verifier_address)
    info = verifier_info(stub, verifier_address, wait_s)
    info.has_tokenizer = tokenizer is not None
    servicer.info = info
    running.set_serving(True)
    log.info("gateway for %s (%s, drafter %s, k=%d, tokenizer %s) listening on %s:%d", info.model, info.model_type,
             info.drafter_kind, info.num_draft_tokens, "yes" if tokenizer else "no: token ids only", host, running.port)
    return running


def serve(model_dir: str | None, verifier_address: str, host: str, port: int) -> None:
    serving.wait_for_termination(start(model_dir, verifier_address, host, port), "gateway")
