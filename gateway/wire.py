"""The Gateway service's registration, with a request decoder that names the field a bad message breaks.

gRPC's own decoding turns an unparsable request into INTERNAL "Exception deserializing request!". Ours hands
the servicer a ``MalformedRequest`` instead, whose message names the field (e.g. ``sampling.stop[1]`` holding
invalid UTF-8), and the servicer refuses it with INVALID_ARGUMENT.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from specdec.rpc.v1 import gateway_pb2

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
# String fields of GenerateRequest by field number ("[]": repeated; a dict: a nested message's string fields).
_SAMPLING_STRINGS = {6: "stop[]"}
_MESSAGE_STRINGS = {1: "role", 2: "content"}
_REQUEST_STRINGS = {1: "request_id", 2: "prompt", 4: ("sampling", _SAMPLING_STRINGS),
                    5: ("messages[]", _MESSAGE_STRINGS)}
_LENGTH_DELIMITED = 2


@dataclass(frozen=True)
class MalformedRequest:
    message: str


def decode_generate_request(data: bytes) -> gateway_pb2.GenerateRequest | MalformedRequest:
    try:
        return gateway_pb2.GenerateRequest.FromString(data)
    except DecodeError as e:
        field = _bad_utf8_field(data, _REQUEST_STRINGS)
        if field is not None:
            return MalformedRequest(f"{field}: not valid UTF-8 (string fields must be UTF-8 text)")
        return MalformedRequest(f"request: not a valid specdec.rpc.v1.GenerateRequest ({e})")


def add_gateway_to_server(servicer, server) -> None:
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=decode_generate_request,
            response_serializer=gateway_pb2.GenerateResponse.SerializeToString),
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info, request_deserializer=gateway_pb2.InfoRequest.FromString,
            response_serializer=gateway_pb2.InfoResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _bad_utf8_field(data: bytes, strings: dict, prefix: str = "") -> str | None:
    """The first string field (per `strings`) whose bytes are not UTF-8; None if none is, or the wire is broken."""
    counts: dict[int, int] = {}
    try:
        for number, wire_type, value in _fields(data):
            spec = strings.get(number)
            if spec is None or wire_type != _LENGTH_DELIMITED:
                continue
            index = counts[number] = counts.get(number, -1) + 1
            name, nested_strings = spec if isinstance(spec, tuple) else (spec, None)
            name = prefix + (name.replace("[]", f"[{index}]") if name.endswith("[]") else name)
            if nested_strings is not None:
                nested = _bad_utf8_field(value, nested_strings, f"{name}.")
                if nested is not None:
                    return nested
                continue
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return name
    except ValueError:
        return None
    return None


def _fields(data: bytes):
    """(field number, wire type, value) of each field of a protobuf message; ValueError if truncated."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(data, pos)
        elif wire_type == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire_type == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire_type == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"wire type {wire_type}")
        if pos > len(data):
            raise ValueError("truncated")
        yield number, wire_type, value


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("bad varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
