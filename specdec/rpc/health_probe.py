"""`specdec health ADDRESS`: exit 0 when the server at ADDRESS reports SERVING (for compose health checks)."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, service: str = "", timeout: float = 2.0,
               credentials: grpc.ChannelCredentials | None = None) -> bool:
    """`credentials`: for a TLS server (None: plaintext)."""
    try:
        with (grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
