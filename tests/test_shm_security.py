"""Shared memory between the verifier and the drafter (issue 34): segments are created 0600 and never through a
planted name; the verifier unlinks a connection's files once its drafter answered a step (decoding unchanged) and
removes dead processes' files as it starts; a drafter's Setup maps only a verifier's segment (under the shm
directory, named specdec-<pid>-<id>, a regular file, no link, of its own user, of exactly the size said), and
refuses anything else, at once, as INVALID_ARGUMENT."""
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from engine_factory import make_engine, random_prompts

import specdec.transport.shm_buffer as shm_buffer
from drafter_service.factory import DrafterConfig
from drafter_service.server import start as start_drafter
from specdec.rpc.serving import channel_options
from specdec.rpc.v1 import drafter_pb2 as pb
from specdec.rpc.v1 import drafter_pb2_grpc
from specdec.sampling_params import SamplingParams
from specdec.transport.shm_buffer import ShmBuffer, remove_segments_of, remove_stale_segments
from verifier_service.drafter_client import RemoteDrafter
from verifier_service.drafter_link import DrafterLinkConfig

SIZE = 64 * 64 * 4   # 64 rows of the tiny model's hidden size 64, fp32
SHM = shm_buffer._shm_dir()
NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def segment_name(pid: int | None = None) -> str:
    return f"specdec-{os.getpid() if pid is None else pid}-{uuid.uuid4().hex[:8]}"


def write_file(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture
def made():
    """Paths a test creates (removed afterwards, whatever they are)."""
    paths: list[Path] = []
    yield paths
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink(missing_ok=True)


def refused_path(kind: str, genuine: ShmBuffer, made: list[Path], tmp_path: Path) -> tuple[str, str]:
    """(a path a Setup may name with size SIZE that must be refused, words of the refusal)."""
    name = SHM / segment_name()
    if kind == "outside the shm directory":
        return str(write_file(tmp_path / genuine.path.name, SIZE)), "not a verifier's segment"
    if kind == "not named like a segment":
        made.append(write_file(SHM / f"other-{uuid.uuid4().hex[:8]}", SIZE))
        return str(made[-1]), "not a verifier's segment"
    if kind == "..":
        return f"{SHM}/../{SHM.name}/{genuine.path.name}", "not a verifier's segment"
    if kind == "a second /":
        return f"{SHM}//{genuine.path.name}", "not a verifier's segment"
    if kind == "symlink to a segment":
        name.symlink_to(genuine.path)
        made.append(name)
        return str(name), "symbolic link"
    if kind == "fifo":
        os.mkfifo(name, 0o600)
        made.append(name)
        return str(name), "not a regular file"
    if kind == "directory":
        name.mkdir(mode=0o700)
        made.append(name)
        return str(name), "not a regular file"
    if kind in ("bigger", "smaller"):
        made.append(write_file(name, SIZE + 8 if kind == "bigger" else SIZE - 8))
        return str(name), "the setup says"
    if kind == "another user's":
        made.append(write_file(name, SIZE))
        os.chown(name, NOBODY, NOBODY)
        return str(name), f"owned by uid {NOBODY}"
    assert kind == "missing"
    return str(name), "missing"


REFUSED = ["outside the shm directory", "not named like a segment", "..", "a second /", "symlink to a segment",
           "fifo", "directory", "bigger", "smaller", pytest.param("another user's", marks=root_only), "missing"]


def within(seconds: float, call):
    """call()'s result or exception, failing the test if it does not return in time (a FIFO opened for reading
    blocks until a writer comes)."""
    done: list = []

    def run():
        try:
            done.append(("value", call()))
        except Exception as e:
            done.append(("error", e))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"still blocked after {seconds}s"
    return done[0]


# ---- ShmBuffer ----------------------------------------------------------------------------------------------

def test_segments_are_created_0600_whatever_the_umask():
    old = os.umask(0)
    try:
        buffer = ShmBuffer.create(SIZE)
    finally:
        os.umask(old)
    try:
        st = os.stat(buffer.path)
        assert oct(st.st_mode & 0o777) == oct(0o600) and st.st_uid == os.geteuid()
        assert buffer.path.parent == SHM and buffer.path.name.startswith(f"specdec-{os.getpid()}-")
    finally:
        buffer.close()
    assert not buffer.path.exists()


def test_create_never_opens_a_planted_name(monkeypatch, tmp_path):
    """Another local user who guesses the next name and plants a link there gets nothing: create() fails rather
    than follow it (and truncate or share the file it points at)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret")
    fixed = uuid.UUID(int=0xABCDEF12 << 96)
    monkeypatch.setattr(shm_buffer.uuid, "uuid4", lambda: fixed)
    planted = SHM / f"specdec-{os.getpid()}-{fixed.hex[:8]}"
    planted.symlink_to(victim)
    try:
        with pytest.raises(FileExistsError):
            ShmBuffer.create(SIZE)
        assert victim.read_bytes() == b"secret" and planted.is_symlink()
    finally:
        planted.unlink()


@pytest.mark.parametrize("kind", REFUSED)
def test_attach_refuses_what_is_not_a_verifiers_segment(kind, made, tmp_path):
    genuine = ShmBuffer.create(SIZE)
    try:
        path, words = refused_path(kind, genuine, made, tmp_path)
        outcome, error = within(10.0, lambda: ShmBuffer.attach(path, SIZE))
        assert outcome == "error" and isinstance(error, (ValueError, OSError)), f"{kind}: mapped"
        assert words in str(error)
    finally:
        genuine.close()


def test_a_genuine_segment_is_shared_and_outlives_its_name():
    verifier = ShmBuffer.create(SIZE)
    drafter = ShmBuffer.attach(str(verifier.path), SIZE)
    verifier.unlink()   # as the verifier does once the drafter answered
    assert not verifier.path.exists()
    verifier.view(64, torch.float32, (2, 3)).copy_(torch.arange(6.0).view(2, 3))
    assert drafter.view(64, torch.float32, (2, 3)).tolist() == [[0, 1, 2], [3, 4, 5]]
    drafter.view(0, torch.int64, (2,)).copy_(torch.tensor([7, -1]))   # the drafts buffer is written back
    assert verifier.view(0, torch.int64, (2,)).tolist() == [7, -1]
    verifier.close()   # a retire after the unlink: the name is gone already
    with pytest.raises(FileNotFoundError):
        ShmBuffer.attach(str(verifier.path), SIZE)


# ---- through a drafter's Setup ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def drafter(tiny_dir):
    running = start_drafter(DrafterConfig("mtp", 3, str(tiny_dir)), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}", options=channel_options())
    yield drafter_pb2_grpc.DrafterStub(channel)
    channel.close()
    running.stop(0)


def setup_message(path: str) -> pb.DraftStepRequest:
    return pb.DraftStepRequest(setup=pb.Setup(buffers=[pb.SharedBuffer(
        name="hidden", transport=pb.SHM, shm_path=path, size_bytes=SIZE, dtype="float32")]))


def step_reading_shm(seq_id: int) -> pb.DraftStepRequest:
    prompt = [5, 17, 3, 99, 42, 8, 1]
    return pb.DraftStepRequest(step=pb.StepInput(step=1, hidden=pb.TensorRef(
        transport=pb.SHM, shape=[len(prompt) - 1, 64], dtype="float32", buffer="hidden", offset_bytes=0), seqs=[
        pb.SeqInput(seq_id=seq_id, start_pos=0, token_ids=prompt, num_drafts=3)]))


def run_stream(stub, messages):
    """(answers, the error that ended the stream or None)."""
    answers = []
    try:
        for response in stub.Step(iter(messages), timeout=60):
            answers.append(response)
    except grpc.RpcError as e:
        return answers, e
    return answers, None


@pytest.mark.parametrize("kind", REFUSED)
def test_a_setup_naming_what_is_not_a_verifiers_segment_is_refused(drafter, kind, made, tmp_path):
    genuine = ShmBuffer.create(SIZE)
    try:
        path, words = refused_path(kind, genuine, made, tmp_path)
        answers, error = run_stream(drafter, [setup_message(path), step_reading_shm(900)])
    finally:
        genuine.close()
    assert answers == [] and error is not None, f"{kind}: the drafter mapped {path}"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith("setup: buffer 'hidden': ") and words in error.details()


def test_a_setup_naming_a_genuine_segment_is_mapped(drafter):
    genuine = ShmBuffer.create(SIZE)
    try:
        genuine.view(0, torch.float32, (6, 64)).copy_(torch.randn(6, 64, generator=torch.Generator().manual_seed(1)))
        answers, error = run_stream(drafter, [setup_message(str(genuine.path)), step_reading_shm(901)])
    finally:
        genuine.close()
    assert error is None and len(answers) == 1 and len(answers[0].drafts[0].token_ids) == 3


# ---- the verifier's files -----------------------------------------------------------------------------------

def own_files() -> set[Path]:
    return set(SHM.glob(f"specdec-{os.getpid()}-*"))


def connection_files(remote: RemoteDrafter) -> set[Path]:
    connection = remote.link.connection
    files = {connection.sender.shm.path}
    if connection.exchange is not None:
        files |= {b.path for b in connection.exchange.shm.values()}
    return files


def _wait(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize("step_channel", ["auto", "grpc"])   # the local lane, or the gRPC Step stream
def test_the_verifier_unlinks_its_files_once_the_drafter_answered(tiny_model, tiny_dir, step_channel):
    running = start_drafter(DrafterConfig("mtp", 3, str(tiny_dir)), "127.0.0.1", 0)
    m = tiny_model.model
    before = own_files()
    remote = RemoteDrafter(
        DrafterLinkConfig(f"127.0.0.1:{running.port}", 3, "shm", 30.0, max_backoff_s=0.5, step_channel=step_channel),
        tiny_model.config.hidden_size, tiny_model.config.vocab_size, m.embed_tokens.weight.dtype,
        torch.device("cpu"), 512, {"embed_tokens": m.embed_tokens.weight, "lm_head": m.lm_head.weight},
        tiny_model.config.model_type)
    try:
        prompts = random_prompts([5, 9, 3], tiny_model.config.vocab_size)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        expected = make_engine(tiny_model).generate(prompts, params)
        _wait(lambda: remote.connected)
        first = connection_files(remote)
        assert first <= own_files() - before   # named while the drafter has answered no step
        assert all(oct(p.stat().st_mode & 0o777) == oct(0o600) for p in first)
        engine = make_engine(tiny_model, remote, 3)
        assert engine.generate(prompts, params) == expected and engine.stats.drafted > 0
        assert own_files() - before == set()   # mapped on both sides, named nowhere

        # A reconnect retires the unlinked files (already gone) and names new ones, unlinked in their turn.
        old = remote.link.connection
        remote.disconnect(old)
        _wait(lambda: remote.connected and remote.link.connection is not old)
        second = connection_files(remote)
        assert second and not second & first and second <= own_files()
        engine = make_engine(tiny_model, remote, 3)
        assert engine.generate(prompts, params) == expected and engine.stats.drafted > 0
        assert own_files() - before == set()
    finally:
        remote.close()
        running.stop(0)
    assert own_files() - before == set()


def test_a_handshake_that_fails_leaves_no_file(tiny_model, tiny_dir, monkeypatch):
    """Buffers made for a stream that could not be opened are removed at once, not left for the next attempt."""
    import verifier_service.drafter_link as client
    running = start_drafter(DrafterConfig("mtp", 3, str(tiny_dir)), "127.0.0.1", 0)
    named: list[list[str]] = []

    def no_stream(stub, setup, trace):
        named.append([b.shm_path for b in setup.setup.buffers])
        raise RuntimeError("no stream")
    monkeypatch.setattr(client, "GrpcStepStream", no_stream)
    m = tiny_model.model
    remote = RemoteDrafter(
        DrafterLinkConfig(f"127.0.0.1:{running.port}", 3, "shm", 30.0, max_backoff_s=0.25, step_channel="grpc"),
        tiny_model.config.hidden_size, tiny_model.config.vocab_size, m.embed_tokens.weight.dtype,
        torch.device("cpu"), 512, {"embed_tokens": m.embed_tokens.weight, "lm_head": m.lm_head.weight},
        tiny_model.config.model_type)
    try:
        _wait(lambda: len(named) >= 2)   # the first attempt has ended (its buffers closed or not) by the second
        assert named[0] and not any(Path(p).exists() for p in named[0])
    finally:
        remote.close()
        running.stop(0)


# ---- stale segments -----------------------------------------------------------------------------------------

def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """The shm directory, here a private one: the test never touches other processes' segments."""
    monkeypatch.setattr(shm_buffer, "_shm_dir", lambda: tmp_path)
    return tmp_path


def test_stale_segments_of_dead_processes_are_removed(shm_dir):
    dead = dead_pid()
    stale = [write_file(shm_dir / segment_name(dead), 16) for _ in range(2)]
    live = [write_file(shm_dir / segment_name(), 16), write_file(shm_dir / segment_name(1), 16)]
    other = [write_file(shm_dir / f"specdec-{dead}", 16), write_file(shm_dir / f"other-{dead}-abcd", 16)]
    (shm_dir / segment_name(dead)).symlink_to(live[0])   # a link: not a segment, not removed
    other.append(next(p for p in shm_dir.iterdir() if p.is_symlink()))
    if os.geteuid() == 0:   # another user's file: theirs to remove
        other.append(write_file(shm_dir / segment_name(dead), 16))
        os.chown(other[-1], NOBODY, NOBODY)
    assert sorted(remove_stale_segments()) == sorted(stale)
    assert not any(p.exists() for p in stale) and all(os.path.lexists(p) for p in live + other)
    assert remove_stale_segments() == []


def test_segments_of_a_dead_child_are_removed(shm_dir):
    """The supervisor's call: `pid`'s files go even though `pid` may still exist (a child not yet reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = [write_file(shm_dir / segment_name(child.pid), 16) for _ in range(2)]
        others = [write_file(shm_dir / segment_name(), 16), write_file(shm_dir / segment_name(1), 16)]
        if os.geteuid() == 0:
            others.append(write_file(shm_dir / segment_name(child.pid), 16))
            os.chown(others[-1], NOBODY, NOBODY)
        assert remove_stale_segments() == []   # alive: nothing of its is stale
        assert sorted(remove_segments_of(child.pid)) == sorted(mine)
        assert not any(p.exists() for p in mine) and all(p.exists() for p in others)
    finally:
        child.kill()
        child.wait()


def test_the_verifier_removes_stale_segments_as_it_starts(shm_dir, monkeypatch, caplog):
    import verifier_service.server as server

    class Loading(Exception):
        pass

    def build_engine(config, make_drafter=None):
        raise Loading
    stale = write_file(shm_dir / segment_name(dead_pid()), 16)
    monkeypatch.setattr(server, "build_engine", build_engine)
    with caplog.at_level(logging.WARNING, logger="verifier_service"), pytest.raises(Loading):
        server.serve(server.VerifierConfig(model_dir="unused"), "127.0.0.1", 0)
    assert not stale.exists() and str(stale) in caplog.text
