"""Handshake: each side reports its OWN facts and the verifier refuses a drafter that does not fit its target
(logged with the reason), decoding without drafts meanwhile and picking up a fitting drafter later."""
import json
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from engine_factory import make_engine, random_prompts

from drafter_service.factory import DrafterConfig
from drafter_service.server import start as start_drafter
from specdec.demo import demo_model_dir
from specdec.drafting import DrafterInfo, ModelFacts, refusal_reason, vocabulary_fingerprint
from specdec.sampling_params import SamplingParams
from verifier_service.drafter_client import RemoteDrafter
from verifier_service.drafter_link import DrafterLinkConfig

TARGET = ModelFacts(hidden_size=64, vocab_size=257, dtype="bfloat16", model_type="qwen3_5_text", vocab_fingerprint="ab")
MTP = DrafterInfo("mtp", 3, True, TARGET)


@pytest.mark.parametrize("drafter,words", [
    (DrafterInfo("ngram", 0, False), "no drafts"),
    (DrafterInfo("dm", 3, False, ModelFacts(vocab_size=300)), "larger than the target's 257"),
    (DrafterInfo("dm", 3, False, ModelFacts(vocab_size=257, vocab_fingerprint="cd")), "another tokenizer"),
    (DrafterInfo("mtp", 3, True, ModelFacts(128, 257, "bfloat16", "qwen3_5_text")), "hidden states of size 128"),
    (DrafterInfo("mtp", 3, True, ModelFacts(64, 257, "bfloat16", "qwen3_next")), "model_type 'qwen3_next'"),
    (DrafterInfo("mtp", 3, True, ModelFacts(64, 200, "bfloat16", "qwen3_5_text")), "drafts over 200 ids"),
    (DrafterInfo("plugin", 3, True, ModelFacts()), "hidden states of size 0"),
    (DrafterInfo("mtp", 3, True, ModelFacts(64, 257, "float32", "qwen3_5_text"), needs_shared_weights=True),
     "--dtype bfloat16"),
])
def test_misfits_are_refused_with_the_reason(drafter, words):
    assert words in refusal_reason(TARGET, drafter)


@pytest.mark.parametrize("drafter", [
    MTP, DrafterInfo("ngram", 3, False), DrafterInfo("dm", 4, False, ModelFacts(32, 200, "float32", "qwen3_next")),
    DrafterInfo("mtp", 3, True, ModelFacts(64, 257, "bfloat16", "qwen3_5_text"), needs_shared_weights=True),
])
def test_fitting_drafters_pass(drafter):
    assert refusal_reason(TARGET, drafter) == ""


def test_vocabulary_fingerprint(tmp_path):
    spec = {"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2, "content": "<eos>"}]}
    for name, s in [("x", spec), ("y", spec)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(json.dumps(s))
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "tokenizer.json").write_text(json.dumps({**spec, "model": {"vocab": {"a": 1, "b": 0}}}))
    x, y, z = (vocabulary_fingerprint(tmp_path / n) for n in "xyz")
    assert x == y and x != z and len(x) == 16
    assert vocabulary_fingerprint(tmp_path) == "" and vocabulary_fingerprint(None) == ""


def _remote(loaded, address, k=3):
    m = loaded.model
    return RemoteDrafter(DrafterLinkConfig(address, k, "auto", 10.0, max_backoff_s=0.5), loaded.config.hidden_size,
                         loaded.config.vocab_size, m.embed_tokens.weight.dtype, torch.device("cpu"), 512,
                         {"embed_tokens": m.embed_tokens.weight, "lm_head": m.lm_head.weight},
                         loaded.config.model_type)


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_mtp_of_another_model_is_refused_and_decoding_goes_on(tiny_model, tiny_dir, caplog):
    """The demo model's MTP head (hidden 256, vocab 4096) offered to a tiny target (hidden 64, vocab 257): it
    would propose ids the target cannot score. Refused at the handshake; the output is plain decoding's."""
    caplog.set_level(logging.INFO)
    wrong = start_drafter(DrafterConfig("mtp", 3, demo_model_dir()), "127.0.0.1", 0)
    right = start_drafter(DrafterConfig("mtp", 3, str(tiny_dir)), "127.0.0.1", 0)
    remote = _remote(tiny_model, f"127.0.0.1:{wrong.port}")
    try:
        prompts = random_prompts([5, 9, 3], tiny_model.config.vocab_size)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        expected = make_engine(tiny_model).generate(prompts, params)
        _wait(lambda: "refused" in caplog.text)
        engine = make_engine(tiny_model, remote, 3)
        assert engine.generate(prompts, params) == expected
        assert not remote.connected and engine.stats.drafted == 0 and engine.fallback_steps > 0
        reason = "vocabulary of 4096 ids, larger than the target's 257"
        assert reason in caplog.text and caplog.text.count(reason) == 1  # said once, not at every retry

        # A fitting drafter on the address the verifier retries is picked up, no restart.
        good = _remote(tiny_model, f"127.0.0.1:{right.port}")
        _wait(lambda: good.connected)
        engine = make_engine(tiny_model, good, 3)
        assert engine.generate(prompts, params) == expected and engine.stats.drafted > 0
        good.close()
    finally:
        remote.close()
        wrong.stop(0)
        right.stop(0)


def test_drafter_dropping_the_stream_after_the_handshake_is_retried_ever_later(tiny_model, monkeypatch):
    """A drafter that answers Info but ends every Step stream at once (e.g. it cannot map the buffers) must
    not make the verifier reconnect in a spin: the waits between attempts grow."""
    import grpc

    import verifier_service.drafter_link as client
    from drafter_service.factory import DrafterHolder
    from drafter_service.servicer import DrafterServicer
    from specdec.rpc import serving
    from specdec.rpc.v1 import drafter_pb2_grpc

    class DropsStreams(DrafterServicer):
        def Step(self, request_iterator, context):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "setup: cannot map the buffer")
            yield  # pragma: no cover

    waits, real_sleep = [], time.sleep
    monkeypatch.setattr(client, "time", SimpleNamespace(perf_counter=time.perf_counter,
                                                        sleep=lambda s: (waits.append(s), real_sleep(0.01))))
    servicer = DropsStreams(DrafterHolder(DrafterConfig("ngram", 3)))
    server = serving.start_server(lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s), [],
                                  "127.0.0.1", 0)
    remote = _remote(tiny_model, f"127.0.0.1:{server.port}")
    try:
        _wait(lambda: len(waits) >= 3)
        assert waits[:3] == [0.25, 0.5, min(1.0, remote.config.max_backoff_s)]
    finally:
        remote.close()
        server.stop(0)


def test_a_stale_streams_end_leaves_the_current_connection(tiny_model):
    """Reconnects race with steps: the engine takes one connection per step, and each stream answers into its own
    queue. A replaced stream that ends (its reader still running) must not end the connection now current."""
    from verifier_service.drafter_link import LinkConnection
    remote = _remote(tiny_model, "127.0.0.1:1")   # nothing listens: the link thread only retries
    closed = []
    stream = SimpleNamespace(close=lambda: closed.append(True), channel="test")
    old, current = LinkConnection(stream, None), LinkConnection(stream, None)
    try:
        remote.link.connection = current
        remote.stream_ended(old, "the old drafter went away")
        assert remote.connected and remote.link.connection is current and not closed
        remote.stream_ended(current, "this one went away")
        assert not remote.connected and closed == [True]
    finally:
        remote.close()


def test_grpc_stream_answers_into_its_own_queue():
    from specdec.rpc.v1 import drafter_pb2 as pb
    from specdec.step_trace import OFF
    from verifier_service.step_streams import GrpcStepStream
    answers = [pb.DraftStepResponse(step=1), pb.DraftStepResponse(step=2)]
    stub = SimpleNamespace(Step=lambda requests, timeout: iter(answers))
    ended = []
    stream = GrpcStepStream(stub, pb.DraftStepRequest(setup=pb.Setup()), OFF)
    stream.start(ended.append)
    assert [stream.receive(5.0).step, stream.receive(5.0).step] == [1, 2]
    assert stream.receive(5.0) is None and ended == ["the drafter ended the stream"]


def test_the_local_lane_is_offered_on_this_host_only_and_unreachable_lanes_fall_back_to_grpc(tiny_model):
    import grpc

    from specdec.rpc.v1 import drafter_pb2 as pb
    from specdec.rpc.v1 import drafter_pb2_grpc
    from specdec.transport.host import host_id
    from verifier_service.step_streams import GrpcStepStream
    server = start_drafter(DrafterConfig("ngram", 3), "127.0.0.1", 0)
    remote = _remote(tiny_model, "127.0.0.1:1")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            here = stub.Info(pb.DrafterInfoRequest(host_id=host_id()), timeout=10).local_lane
            elsewhere = stub.Info(pb.DrafterInfoRequest(host_id="another-host"), timeout=10).local_lane
        assert here.startswith("specdec-drafter-") and elsewhere == ""
        fake = SimpleNamespace(Step=lambda requests, timeout: SimpleNamespace(cancel=lambda: None))
        stream = remote.link.open_stream(fake, "specdec-drafter-no-such-lane", [])
        assert isinstance(stream, GrpcStepStream)
        stream.close()
    finally:
        remote.close()
        server.stop(0)


def test_cuda_ipc_is_accepted_from_any_gpu_this_drafter_can_map(monkeypatch):
    """A drafter on a GPU of its own (cuda:1) still takes the verifier's CUDA-IPC buffers when it can see the
    verifier's GPU (then copies over peer-to-peer); a GPU it cannot see, or another host, gets SHM / INLINE."""
    from drafter_service.servicer import DrafterServicer
    from specdec.rpc.v1 import drafter_pb2 as pb
    from specdec.transport import cuda_ipc
    from specdec.transport.host import host_id
    monkeypatch.setattr(cuda_ipc, "visible_device_index", {"GPU-verifier": 0, "GPU-drafter": 1}.get)
    holder = SimpleNamespace(info=MTP, takes_device_steps=True)
    offer = [pb.CUDA_IPC, pb.SHM, pb.INLINE]

    def accepted(drafter_gpu: str, verifier_gpu: str, host: str = host_id()) -> list:
        servicer = DrafterServicer(holder, drafter_gpu)
        return list(servicer.Info(pb.DrafterInfoRequest(transports=offer, host_id=host, gpu_uuid=verifier_gpu),
                                  None).transports)
    assert accepted("GPU-drafter", "GPU-drafter") == offer             # the same GPU
    assert accepted("GPU-drafter", "GPU-verifier") == offer            # another GPU it sees: mapped, then copied
    assert accepted("GPU-drafter", "GPU-elsewhere") == [pb.SHM, pb.INLINE]
    assert accepted("", "GPU-verifier") == [pb.SHM, pb.INLINE]         # a drafter on the CPU
    assert accepted("GPU-drafter", "GPU-verifier", "another-host") == [pb.INLINE]
