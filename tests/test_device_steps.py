"""Device steps with a drafter service (drafter.proto DeviceStep; verifier_service/device_exchange.py): the verifier
overlaps steps with a remote MTP drafter too, the step's rows and the drafts going through registered buffers
(shared memory here, on a CPU; CUDA IPC with interprocess events on a GPU). Greedy output must equal plain decoding
with the drafter killed, slow, misbehaving or replaced (seeded sampled output too), and a malformed device step is
refused whole."""
import logging
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from device_reference_drafter import DeviceReferenceDrafter
from engine_factory import make_drafter, make_engine
from test_overlapped_drafts import requests_of, run_added, verify_log
from test_overlapped_steps import run

from drafter_service.factory import DrafterConfig
from drafter_service.server import start as start_drafter
from specdec.demo import demo_model_dir
from specdec.drafting import DeviceDrafts
from verifier_service.drafter_client import RemoteDrafter
from verifier_service.drafter_link import DrafterLinkConfig

pytestmark = pytest.mark.timeout(300)
K = 3


@pytest.fixture(scope="module")
def demo():
    from tokenizers import Tokenizer

    from specdec.models.loader import load_model
    loaded = load_model(demo_model_dir())
    tokenizer = Tokenizer.from_file(demo_model_dir() + "/tokenizer.json")
    texts = ["def fibonacci(n):", "import os\n", "class Foo:\n    def __init__(self", "for i in range(10):",
             "    return self._", "x = ["]
    prompts = [tokenizer.encode(t).ids for t in texts]
    requests = requests_of(prompts, [40, 9, 33, 27, 45, 21])
    return loaded, requests, run(make_engine(loaded, overlap=False), requests)


def link(loaded, port, timeout_s=10.0, transport="auto"):
    m = loaded.model
    remote = RemoteDrafter(DrafterLinkConfig(f"127.0.0.1:{port}", K, transport, timeout_s, max_backoff_s=0.3),
                           loaded.config.hidden_size, loaded.config.vocab_size, m.embed_tokens.weight.dtype,
                           torch.device("cpu"), 64, {"embed_tokens": m.embed_tokens.weight,
                                                     "lm_head": m.lm_head.weight},
                           loaded.config.model_type, max_seqs=8)
    wait(lambda: remote.connected)
    return remote


def wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def serve_mtp(**config):
    return start_drafter(DrafterConfig("mtp", K, demo_model_dir(), block_size=4, **config), "127.0.0.1", 0)


@contextmanager
def linked_service(loaded, timeout_s=10.0, transport="auto", **config):
    """An MTP drafter service in this process (`config`: its DrafterConfig fields) and a RemoteDrafter linked to
    it; both stopped after."""
    server = serve_mtp(**config)
    try:
        remote = link(loaded, server.port, timeout_s, transport)
        try:
            yield remote
        finally:
            remote.close()
    finally:
        server.stop()


def test_sampled_requests_through_a_drafter_service_overlap_and_stay_exact(demo):
    """Temperature / top-k / top-p / min-p requests with the drafter service: device steps and overlapped steps
    only, and the seeded output of plain decoding (the draws are keyed by output position)."""
    from engine_factory import synchronous_launches
    from test_overlapped_drafts import sampled_requests
    loaded, requests, _ = demo
    sampled = sampled_requests([prompt for prompt, _ in requests.values()], [40, 9, 33, 27, 45, 21])
    expected = run(make_engine(loaded, overlap=False), sampled)
    with linked_service(loaded) as remote:
        engine = make_engine(loaded, remote, K)
        synchronous = synchronous_launches(engine)
        assert run(engine, sampled) == expected
        assert synchronous == [] and engine.overlapped_draft_steps > 10 and engine.stats.accepted > 0


def test_a_drafter_service_drafts_on_the_device_like_the_in_process_head(demo):
    loaded, requests, expected = demo
    with linked_service(loaded) as remote:
        assert remote.drafts_on_device and remote.transport_name == "shm"
        engine = make_engine(loaded, remote, K)
        log = verify_log(engine)
        assert run(engine, requests) == expected
        assert engine.overlapped_draft_steps > 10 and engine.fallback_steps == 0
        in_process = make_engine(loaded, make_drafter("mtp", loaded, K), K)
        in_process_log = verify_log(in_process)
        run(in_process, requests)
        assert log == in_process_log   # the same drafts verified at the same points: the same MTP head's
        assert engine.stats.accepted == in_process.stats.accepted > 0
        whole, as_changes = remote.device_steps.sent
        assert whole == 1 and as_changes >= engine.overlapped_draft_steps   # after the first: changes only


def test_device_steps_go_as_changes_around_synchronous_steps(demo):
    """A logprobs request makes the steps synchronous while it runs (their messages carry the rows); the device
    steps before and after it still go as changes from the last device step, and the output stays exact."""
    from specdec.sampling_params import SamplingParams
    from engine_factory import synchronous_launches
    loaded, requests, expected = demo
    prompt = requests["r0"][0]
    asking = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
    alone = run(make_engine(loaded, overlap=False), {"lp": (prompt, asking)})
    with linked_service(loaded) as remote:
        engine = make_engine(loaded, remote, K)
        synchronous = synchronous_launches(engine)
        out = run(engine, requests, add_later={6: ("lp", prompt, asking)})
        assert out.pop("lp")[0] == alone["lp"][0] and out == expected
        assert synchronous and engine.fallback_steps == 0 and engine.stats.accepted > 0
        whole, as_changes = remote.device_steps.sent
        assert whole == 1 and as_changes > 10


def test_a_drafter_killed_and_replaced_mid_stream(demo, caplog):
    """The drafter dies: steps go on without drafts (synchronous while it is away); a new drafter lacks the
    context: the sequences it misses are recomputed, and device steps resume. The output never changes."""
    caplog.set_level(logging.INFO)
    loaded, requests, expected = demo
    server = serve_mtp()
    remote = link(loaded, server.port)
    engine = make_engine(loaded, remote, K)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out = {rid: [] for rid in requests}

    def step():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    try:
        while engine.overlapped_draft_steps < 4:
            step()
        server.stop()
        wait(lambda: not remote.connected)
        for _ in range(3):
            step()
        assert not remote.connected and engine.fallback_steps > 0
        server = start_drafter(DrafterConfig("mtp", K, demo_model_dir(), block_size=4), "127.0.0.1", server.port)
        wait(lambda: remote.connected)
        before = engine.overlapped_draft_steps
        while engine.has_work:
            step()
        assert engine.overlapped_draft_steps > before
        assert "the drafter lost its hidden states" in caplog.text   # recomputed for the new drafter
        assert out == {rid: tokens for rid, (tokens, _) in expected.items()}
    finally:
        remote.close()
        server.stop()


def test_a_slow_drafter_is_a_failed_step_and_the_link_comes_back(demo, monkeypatch):
    from drafter_service.mtp.mtp_drafter import MTPDrafter
    loaded, requests, expected = demo
    calls, real = [], MTPDrafter.draft_on_device

    def slow(self, step):
        calls.append(1)
        if len(calls) == 5:
            time.sleep(0.6)   # past the verifier's step timeout
        return real(self, step)
    monkeypatch.setattr(MTPDrafter, "draft_on_device", slow)
    with linked_service(loaded, timeout_s=0.3) as remote:   # in this process: its MTPDrafter is the patched class
        engine = make_engine(loaded, remote, K)
        assert run(engine, requests) == expected
        assert engine.fallback_steps > 0 and len(calls) > 5 and engine.overlapped_draft_steps > 5


def test_a_drafter_counting_tokens_takes_no_device_steps(demo, tmp_path):
    """Counting the served tokens needs them on the drafter's host: such a drafter offers no device steps, and
    the verifier's steps with it are synchronous."""
    loaded, requests, expected = demo
    with linked_service(loaded, count_tokens=str(tmp_path / "counts.json"), vocab_size=loaded.config.vocab_size) \
            as remote:
        assert not remote.drafts_on_device
        engine = make_engine(loaded, remote, K)
        assert run(engine, requests) == expected
        assert engine.overlapped_draft_steps == 0 and engine.stats.accepted > 0


def test_an_inline_link_takes_no_device_steps(demo):
    loaded, requests, _ = demo
    with linked_service(loaded, transport="inline") as remote:
        assert remote.transport_name == "inline" and not remote.drafts_on_device


class Misbehaving(DeviceReferenceDrafter):
    """Every third call answers in one broken way."""

    def __init__(self, fault, *args):
        super().__init__(*args)
        self.fault = fault

    def draft_on_device(self, step):
        out = super().draft_on_device(step)
        if self.calls % 3:
            return out
        if self.fault == "raises":
            raise RuntimeError("drafter bug")
        if self.fault == "out_of_range":   # ids the host cannot see: clamped on the device
            return DeviceDrafts(out.tokens + 10 * self.vocab, out.counts)
        if self.fault == "negative":
            return DeviceDrafts(out.tokens - 10 * self.vocab, out.counts)
        if self.fault == "surplus":
            return DeviceDrafts(out.tokens, [c + 5 for c in out.counts])
        if self.fault == "too_few":
            return DeviceDrafts(out.tokens[:-1], out.counts[:-1])
        if self.fault == "float":   # would break the next step's index_copy into the input ids
            return DeviceDrafts(out.tokens.float(), out.counts)
        return DeviceDrafts(None, out.counts, failure="timed out")


@pytest.mark.parametrize("fault", ["raises", "out_of_range", "negative", "surplus", "too_few", "float", "failure"])
def test_a_misbehaving_device_drafter_never_changes_the_output(tiny_model, fault):
    from engine_factory import random_prompts
    prompts = random_prompts([3, 11, 6, 20], tiny_model.config.vocab_size, seed=8)
    requests = requests_of(prompts, [30, 25, 33, 18])
    expected = run(make_engine(tiny_model, overlap=False), requests)
    drafter = Misbehaving(fault, K, tiny_model.config.vocab_size)
    engine = make_engine(tiny_model, drafter, K)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        drafter.follow(engine.by_request[rid].seq_id, prompt + expected[rid][0])
    assert run_added(engine, requests) == expected
    if fault in ("out_of_range", "negative"):
        assert engine.fallback_steps == 0       # valid answers of wrong ids: verified (and rejected)
    else:
        assert engine.fallback_steps > 0        # failed steps: no drafts in the step after
    assert engine.overlapped_draft_steps > 0


def test_a_malformed_device_step_is_refused_whole():
    from drafter_service.device_step import DeviceSteps
    from drafter_service.stream_buffers import StreamBuffers
    from specdec.rpc.v1 import drafter_pb2 as pb
    from specdec.drafting import DrafterInfo, ModelFacts
    info = DrafterInfo("mtp", K, True, ModelFacts(256, 4096, "float32", "qwen3_5_text"))
    buffers = StreamBuffers()
    buffers.arrays = {"step_tokens": torch.zeros(2, 16, dtype=torch.long),
                      "step_seqs": torch.zeros(2, 4, dtype=torch.long), "drafts": torch.zeros(4, K, dtype=torch.long)}
    buffers.shm = {"hidden": type("B", (), {"size_bytes": 16 * 256 * 4})()}

    def step(**device):
        fields = dict(seq_ids=[1, 2], start_pos=[0, 5], max_shift=[0, 3], chunk_lens=[4, 4], num_drafts=[3, 3])
        fields.update(device)
        rows = sum(fields["chunk_lens"])
        return pb.StepInput(step=1, device=pb.DeviceStep(**fields), hidden=pb.TensorRef(
            transport=pb.SHM, shape=[rows, 256], dtype="float32", buffer="hidden"))

    def problem(message, stream_buffers=buffers):
        return DeviceSteps(stream_buffers).problem(message, info)

    assert problem(step()) == ""
    for bad, words in [(dict(start_pos=[0]), "start_pos has 1 values"), (dict(seq_ids=[1, 1]), "appears twice"),
                       (dict(chunk_lens=[12, 8]), "do not fit"), (dict(num_drafts=[3, 4]), "more than"),
                       (dict(chunk_lens=[0, 4]), "at least one row"),
                       (dict(seq_ids=[1, 2, 3, 4, 5], start_pos=[0] * 5, max_shift=[0] * 5, chunk_lens=[1] * 5,
                             num_drafts=[0] * 5), "do not fit"),
                       (dict(removed=[0]), "removed or placed is set in a step sent whole"),
                       (dict(changes_only=True), "no device step came before it")]:
        assert words in problem(step(**bad)), bad
    mismatched = step()
    mismatched.hidden.shape[:] = [7, 256]
    assert "expected shape (8, 256)" in problem(mismatched)
    inline = step()
    inline.hidden.transport = pb.INLINE   # rows not behind the verifier's buffer (and, on a GPU, its event)
    assert "registered hidden buffer" in problem(inline)
    assert "registered no step buffers" in problem(step(), StreamBuffers())
    narrow = StreamBuffers()
    narrow.shm = buffers.shm
    narrow.arrays = {**buffers.arrays, "drafts": torch.zeros(4, 2, dtype=torch.long)}   # 2 columns, k = 3
    assert "drafts buffer's width" in problem(step(), narrow)
    narrow.arrays = {**buffers.arrays, "step_seqs": torch.zeros(1, 4, dtype=torch.long)}
    assert "fewer than 2 rows" in problem(step(), narrow)
    assert np.all(buffers.arrays["drafts"].numpy() == 0)   # nothing was applied


class RecordingDrafter:
    """A DraftsOnDevice drafter that keeps the steps it gets and proposes nothing (zeros, counts of 0)."""
    drafts_on_device = True

    def __init__(self):
        self.steps = []

    def draft_on_device(self, step):
        self.steps.append(step)
        return DeviceDrafts(torch.zeros(len(step.seq_ids), K, dtype=torch.long), [0] * len(step.seq_ids))


def test_a_device_step_sent_as_changes_is_read_against_the_last_one_and_refused_whole():
    """After a whole step, the next comes as changes only: nothing for a steady batch (its rows implied), the
    staying sequences predicted; malformed changes are refused and leave nothing to run."""
    from drafter_service.device_step import DeviceSteps
    from drafter_service.stream_buffers import StreamBuffers
    from specdec.drafting import DrafterInfo, ModelFacts
    from specdec.rpc.v1 import drafter_pb2 as pb
    from specdec.transport.shm_buffer import ShmBuffer
    info = DrafterInfo("mtp", K, True, ModelFacts(256, 4096, "float32", "qwen3_5_text"))
    shapes = {"step_tokens": [2, 16], "step_seqs": [2, 4], "drafts": [4, K]}
    shm = {name: ShmBuffer.create(8 * r * c) for name, (r, c) in shapes.items()}
    shm["hidden"] = ShmBuffer.create(16 * 256 * 4)
    buffers = StreamBuffers()
    buffers.register(pb.Setup(buffers=[
        pb.SharedBuffer(name=name, transport=pb.SHM, shm_path=str(b.path), size_bytes=b.size_bytes,
                        dtype="int64" if name in shapes else "", shape=shapes.get(name, []))
        for name, b in shm.items()]))
    steps, drafter = DeviceSteps(buffers), RecordingDrafter()

    def take(message):
        assert steps.problem(message, info) == ""
        steps.run(drafter, message, torch.device("cpu"))
        got = drafter.steps[-1]
        return got.seq_ids, got.start_pos.tolist(), got.chunk_lens.tolist(), tuple(got.hidden.shape)
    try:
        whole = pb.StepInput(step=1, device=pb.DeviceStep(seq_ids=[1, 2], start_pos=[0, 5], max_shift=[0, 3],
                                                          chunk_lens=[4, 4], num_drafts=[3, 3]),
                             hidden=pb.TensorRef(transport=pb.SHM, shape=[8, 256], dtype="float32", buffer="hidden"))
        assert take(whole) == ([1, 2], [0, 5], [4, 4], (8, 256))
        assert take(pb.StepInput(step=2, device=pb.DeviceStep(changes_only=True))) == ([1, 2], [4, 9], [4, 4],
                                                                                        (8, 256))
        joined = pb.StepInput(step=3, device=pb.DeviceStep(changes_only=True, removed=[0], seq_ids=[7, 2],
                                                           start_pos=[0, 12], max_shift=[0, 2], chunk_lens=[5, 3],
                                                           num_drafts=[0, 3], placed=[1]))
        assert take(joined) == ([2, 7], [12, 0], [3, 5], (8, 256))
        for bad, words in [(dict(removed=[2]), "removed: indices"), (dict(removed=[1, 0]), "removed: indices"),
                           (dict(placed=[0]), "placed"), (dict(start_pos=[7, 8]), "start_pos has 2 values"),
                           (dict(seq_ids=[9, 9], start_pos=[0, 0], max_shift=[0, 0], chunk_lens=[1, 1],
                                 num_drafts=[0, 0], placed=[2, 3]), "given twice"),
                           (dict(seq_ids=[9], start_pos=[0], max_shift=[0], chunk_lens=[9], num_drafts=[0],
                                 placed=[2]), "do not fit"),
                           (dict(seq_ids=[9], start_pos=[0], max_shift=[0], chunk_lens=[1], num_drafts=[0]),
                            "placed"),
                           (dict(seq_ids=[1 << 63], start_pos=[0], max_shift=[0], chunk_lens=[1], num_drafts=[0],
                                 placed=[2]), "2^63")]:
            message = pb.StepInput(step=4, device=pb.DeviceStep(changes_only=True, **bad))
            assert words in steps.problem(message, info), bad
            assert steps._checked is None   # nothing for run() to take
        # the refused messages changed nothing: the next steady step follows step 3
        assert take(pb.StepInput(step=5, device=pb.DeviceStep(changes_only=True))) == ([2, 7], [15, 5], [3, 5],
                                                                                        (8, 256))
    finally:
        for b in shm.values():
            b.close()


# ---- GPU: the drafter service in its own process, rows and drafts through CUDA IPC buffers and events ---------
@pytest.mark.gpu
def test_gpu_device_steps_through_cuda_ipc_draft_what_the_in_process_head_drafts(tmp_path, cuda):
    """fp32, CUDA graphs on both sides: the verifier's overlapped steps with the MTP drafter service (its own
    process, CUDA IPC) verify the same drafts at the same points as with the same head in process, and both
    equal plain decoding."""
    import subprocess
    import sys

    from engine_factory import random_prompts

    from specdec_tools.local_stack import free_port
    from specdec.models.loader import load_model
    from specdec.rpc.health_probe import is_serving
    from specdec_tools.tiny import make_tiny
    model_dir = str(make_tiny(tmp_path, overrides={"vocab_size": 400}, progress=False))
    loaded = load_model(model_dir, dtype="float32", device=cuda)
    prompts = random_prompts([3, 7, 12, 20, 5, 9, 30, 1], 400, seed=6)
    requests = requests_of(prompts, [8 + 3 * i for i in range(len(prompts))])
    expected = run(make_engine(loaded, overlap=False), requests)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "drafter", "--kind", "mtp", "--model", model_dir,
                             "--device", "cuda", "--dtype", "float32", "--port", str(port), "-k", str(K)])
    try:
        wait(lambda: is_serving(f"127.0.0.1:{port}") or proc.poll() is not None, timeout=300)
        m = loaded.model
        remote = RemoteDrafter(DrafterLinkConfig(f"127.0.0.1:{port}", K, "cuda_ipc", 60.0),
                               loaded.config.hidden_size, 400, torch.float32, torch.device(cuda), 64,
                               {"embed_tokens": m.embed_tokens.weight, "lm_head": m.lm_head.weight},
                               loaded.config.model_type, max_seqs=8)
        wait(lambda: remote.connected, timeout=120)
        assert remote.drafts_on_device and remote.transport_name == "cuda_ipc"
        engine = make_engine(loaded, remote, K)
        log = verify_log(engine)
        assert run(engine, requests) == expected
        assert engine.overlapped_draft_steps > 10 and engine.fallback_steps == 0
        from drafter_service.mtp.mtp_drafter import MTPDrafter
        in_process = make_engine(loaded, MTPDrafter(loaded, K, num_blocks=256, block_size=16), K)   # as served
        in_process_log = verify_log(in_process)
        assert run(in_process, requests) == expected
        assert log == in_process_log
        remote.close()
    finally:
        proc.terminate()
        proc.wait(30)
