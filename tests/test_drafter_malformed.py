"""Malformed verifier -> drafter messages (wrong step counter, ids out of range, a buffer never registered, a
region past its buffer, bytes that do not match the shape, hidden rows that do not match the tokens, a setup
naming a missing file) are refused with INVALID_ARGUMENT naming the field, before anything is applied: the
sequence they were about drafts afterwards exactly like an identical sequence that never saw them. The same over
the local lane (the Step messages over a Unix socket), where a refusal closes the socket and is logged."""
import logging
import socket

import grpc
import pytest
import torch

from drafter_service.factory import DrafterConfig
from drafter_service.server import start as start_drafter
from specdec.rpc.serving import channel_options
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.rpc.v1 import drafter_pb2_grpc
from specdec.transport import tensor_bytes
from specdec.transport.frames import recv_frame, send_frame
from specdec.transport.host import host_id
from specdec.transport.shm_buffer import ShmBuffer

PROMPT = [5, 17, 3, 99, 42, 8, 1]
NEXT = [PROMPT[-1], 11, 250]  # the newest prompt token, then two committed output tokens


@pytest.fixture(scope="module")
def drafter(tiny_dir):
    running = start_drafter(DrafterConfig("mtp", 3, str(tiny_dir)), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}", options=channel_options())
    shm = ShmBuffer.create(64 * 64 * 4)  # 64 rows of the tiny model's hidden size 64, fp32
    yield drafter_pb2_grpc.DrafterStub(channel), shm
    shm.close()
    channel.close()
    running.stop(0)


def hidden_rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))  # [n, hidden]


def inline(rows: torch.Tensor) -> pb.TensorRef:
    return pb.TensorRef(transport=pb.INLINE, shape=list(rows.shape), dtype="float32", data=tensor_bytes.to_bytes(rows))


def step(n: int, seq_id: int, start: int, tokens: list[int], hidden: pb.TensorRef, release=()) -> pb.DraftStepRequest:
    return pb.DraftStepRequest(step=pb.StepInput(step=n, release_seq_ids=list(release), hidden=hidden, seqs=[
        pb.SeqInput(seq_id=seq_id, start_pos=start, token_ids=tokens, num_drafts=3)]))


def grpc_stream(stub, messages):
    """(drafts per answered step, the error that ended the stream or None)."""
    answers = []
    try:
        for response in stub.Step(iter(messages), timeout=30):
            answers.append([list(d.token_ids) for d in response.drafts])
    except grpc.RpcError as e:
        return answers, e
    return answers, None


def lane_stream(stub, messages):
    """The same over the drafter's local lane: (drafts per answered step, "closed" if the drafter closed the lane
    before answering every step, else None)."""
    name = stub.Info(pb.DrafterInfoRequest(host_id=host_id()), timeout=10).local_lane
    answers, steps = [], sum(m.HasField("step") for m in messages)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect("\0" + name)
        try:
            for m in messages:
                send_frame(sock, m.SerializeToString())
            sock.shutdown(socket.SHUT_WR)     # the end of the stream
        except OSError:                       # it closed already: a refusal
            pass
        while (frame := recv_frame(sock)) is not None:
            answers.append([list(d.token_ids) for d in pb.DraftStepResponse.FromString(frame).drafts])
    return answers, ("closed" if len(answers) < steps else None)


def malformed(kind: str, seq_id: int, shm: ShmBuffer) -> list[pb.DraftStepRequest]:
    rows = hidden_rows(len(NEXT) - 1, 2)
    ok = inline(rows)
    setup = pb.DraftStepRequest(setup=pb.Setup(buffers=[pb.SharedBuffer(
        name="hidden", transport=pb.SHM, shm_path=str(shm.path), size_bytes=shm.size_bytes, dtype="float32")]))
    bad = {
        "replayed step": [step(1, seq_id, len(PROMPT) - 1, NEXT, ok, [seq_id])],
        "id out of range": [step(2, seq_id, len(PROMPT) - 1, [NEXT[0], 300, 1], ok, [seq_id])],
        "negative id": [step(2, seq_id, len(PROMPT) - 1, [NEXT[0], -4, 1], ok, [seq_id])],
        "buffer never registered": [step(2, seq_id, len(PROMPT) - 1, NEXT, pb.TensorRef(
            transport=pb.SHM, shape=[2, 64], dtype="float32", buffer="hidden", offset_bytes=0), [seq_id])],
        "region past the buffer": [setup, step(2, seq_id, len(PROMPT) - 1, NEXT, pb.TensorRef(
            transport=pb.SHM, shape=[2, 64], dtype="float32", buffer="hidden", offset_bytes=shm.size_bytes - 8),
            [seq_id])],
        "bytes do not match": [step(2, seq_id, len(PROMPT) - 1, NEXT, pb.TensorRef(
            transport=pb.INLINE, shape=[2, 64], dtype="float32", data=b"\0" * 100), [seq_id])],
        "rows do not match": [step(2, seq_id, len(PROMPT) - 1, NEXT, inline(hidden_rows(5, 2)), [seq_id])],
        "unknown dtype": [step(2, seq_id, len(PROMPT) - 1, NEXT, pb.TensorRef(
            transport=pb.INLINE, shape=[2, 64], dtype="int8", data=b"\0" * 128), [seq_id])],
        "setup of a missing file": [pb.DraftStepRequest(setup=pb.Setup(buffers=[pb.SharedBuffer(
            name="hidden", transport=pb.SHM, shm_path="/nonexistent/x", size_bytes=64, dtype="float32")]))],
    }
    return bad[kind]


FIELDS = {"replayed step": "previous step", "id out of range": "token_ids", "negative id": "token_ids",
          "buffer never registered": "never registered", "region past the buffer": "past the end",
          "bytes do not match": "inline data", "rows do not match": "hidden has shape",
          "unknown dtype": "dtype", "setup of a missing file": "setup"}


@pytest.mark.parametrize("carrier", ["grpc", "lane"])
@pytest.mark.parametrize("kind", list(FIELDS))
def test_malformed_step_is_refused_and_changes_nothing(drafter, kind, carrier, caplog):
    stub, shm = drafter
    stream = {"grpc": grpc_stream, "lane": lane_stream}[carrier]
    faulted = 100 + 4 * list(FIELDS).index(kind) + 2 * (carrier == "lane")
    clean = faulted + 1
    prompt_rows = inline(hidden_rows(len(PROMPT) - 1, 1))
    # Stream A: the faulted sequence's prompt, then the malformed message (which also asks to release it).
    with caplog.at_level(logging.WARNING, logger="drafter_service"):
        answers, error = stream(stub, [step(1, faulted, 0, PROMPT, prompt_rows)] + malformed(kind, faulted, shm))
    if carrier == "lane":   # the lane has no status: the drafter logs why it closed it
        error = next((r.getMessage() for r in caplog.records if "local lane closed" in r.getMessage()), None)
        assert error and "INVALID_ARGUMENT" in error and FIELDS[kind] in error
    else:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and FIELDS[kind] in error.details()
    assert len(answers) == 1
    # Stream B (the verifier reconnected): the faulted sequence continues; the clean one has the same history.
    continued, error = stream(stub, [step(1, faulted, len(PROMPT) - 1, NEXT, inline(hidden_rows(2, 2)))])
    assert error is None
    reference, error = stream(stub, [step(1, clean, 0, PROMPT, prompt_rows),
                                     step(2, clean, len(PROMPT) - 1, NEXT, inline(hidden_rows(2, 2)))])
    assert error is None and answers[0] == reference[0]
    assert continued[0] == reference[1] and len(continued[0][0]) == 3
