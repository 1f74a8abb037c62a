"""A drafter that answers later (the remote link) is asked at the end of a step and read at the start of the
next: the step's tokens are out before its drafts are read, and output stays lossless through aborts, drafter
failures and sequences that end while their drafts are in flight."""
import pytest
from engine_factory import make_drafter, make_engine, random_prompts

from specdec.drafting import AnswersLater, DraftBatch, DraftOutput
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)
K = 3
STEP_TIMEOUT_S = 2.0    # the remote link's deadline in these tests
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)


class Later:
    """Wraps an in-process drafter as one that answers later, and logs when each answer is asked and read."""
    needs_hidden = False

    def __init__(self, inner, fail_at: set[int] = frozenset(), raise_at: set[int] = frozenset()):
        self.inner, self.kind, self.max_drafts, self.facts = inner, "later", inner.max_drafts, inner.facts
        self.fail_at, self.raise_at = fail_at, raise_at
        self.log: list[tuple[str, int]] = []
        self.unread = 0                                   # answers asked for and not read yet

    def propose_later(self, batch: DraftBatch):
        assert self.unread == 0, "a new question before the last answer was read"
        self.log.append(("ask", batch.step))
        self.unread += 1
        out = self.inner.propose(batch)

        def answer() -> DraftOutput:
            self.unread -= 1
            self.log.append(("read", batch.step))
            if batch.step in self.raise_at:
                raise RuntimeError("the drafter broke")
            return DraftOutput.failed(len(batch.seqs), "planted failure") if batch.step in self.fail_at else out
        return answer

    def propose(self, batch: DraftBatch) -> DraftOutput:
        return self.propose_later(batch)()

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def clear(self):
        self.inner.clear()


@pytest.fixture
def prompts(tiny_model):
    return random_prompts([5, 9, 3], tiny_model.config.vocab_size, seed=3)


@pytest.fixture
def plain(tiny_model, prompts):
    return make_engine(tiny_model).generate(prompts, GREEDY)


def _later(tiny_model, prompts, plain, **faults):
    references = [p + o for p, o in zip(prompts, plain)]
    return Later(make_drafter("synthetic", tiny_model, K, references), **faults)


def test_a_steps_tokens_are_out_before_its_drafts_are_read(tiny_model, prompts, plain):
    drafter = _later(tiny_model, prompts, plain)
    assert isinstance(drafter, AnswersLater)
    engine = make_engine(tiny_model, drafter, k=K)
    for rid, prompt in enumerate(prompts):
        engine.add_request(str(rid), prompt, GREEDY)
    asked_while_decoding = 0
    while engine.has_work:
        outputs = engine.step()
        if drafter.log and drafter.log[-1][0] == "ask":
            assert drafter.unread == 1 and outputs   # the step returned its tokens with its drafts unread
            asked_while_decoding += 1
    assert asked_while_decoding >= 3
    asks = [step for what, step in drafter.log if what == "ask"]
    reads = [step for what, step in drafter.log if what == "read"]
    assert asks == reads and drafter.unread == 0
    assert engine.stats.accepted > 0


@pytest.mark.parametrize("faults", [{}, {"fail_at": {3, 4, 7}}, {"raise_at": {2, 5}}])
def test_greedy_output_equals_plain_decoding(tiny_model, prompts, plain, faults):
    drafter = _later(tiny_model, prompts, plain, **faults)
    engine = make_engine(tiny_model, drafter, k=K)
    assert engine.generate(prompts, GREEDY) == plain
    assert engine.fallback_steps == len(faults.get("fail_at", faults.get("raise_at", ())))


def test_each_answer_reaches_the_sequences_it_was_asked_about(tiny_model, prompts, plain):
    """The same drafter answering at once and answering later: the same drafts verified, so the same counts
    (drafts read into the wrong sequences would be rejected far more often)."""
    references = [p + o for p, o in zip(prompts, plain)]
    at_once = make_engine(tiny_model, make_drafter("synthetic", tiny_model, K, references), k=K)
    later = make_engine(tiny_model, _later(tiny_model, prompts, plain), k=K)
    assert at_once.generate(prompts, GREEDY) == later.generate(prompts, GREEDY) == plain
    counts = [(e.stats.verify_steps, e.stats.drafted, e.stats.accepted) for e in (at_once, later)]
    assert counts[0] == counts[1] and counts[0][2] > counts[0][1] / 3


def test_abort_and_new_requests_while_an_answer_is_unread(tiny_model, prompts, plain):
    drafter = _later(tiny_model, prompts, plain)
    engine = make_engine(tiny_model, drafter, k=K)
    engine.add_request("gone", prompts[0], GREEDY)
    for _ in range(4):                             # the prefill, then the first verify step asks
        if drafter.unread:
            break
        engine.step()
    assert engine.abort("gone")                    # its drafts are in flight: read later, used by no one
    assert not engine.has_work and drafter.unread == 1
    assert engine.generate(prompts[1:], GREEDY) == plain[1:]
    assert drafter.unread == 0 and engine.fallback_steps == 0


@pytest.fixture(params=["auto", "grpc"])
def gated_link(tiny_model, monkeypatch, request):
    """A RemoteDrafter linked to an ngram drafter service whose steps wait for `gate`; its steps go over the
    drafter's local lane (auto, same host) or the gRPC stream."""
    import threading
    import time

    import torch

    from drafter_service.factory import DrafterConfig
    from drafter_service.ngram import NgramDrafter
    from drafter_service.server import start as start_drafter
    from verifier_service.drafter_client import RemoteDrafter
    from verifier_service.drafter_link import DrafterLinkConfig

    gate, entered, propose = threading.Event(), threading.Event(), NgramDrafter.propose
    monkeypatch.setattr(NgramDrafter, "propose",
                        lambda self, batch: (entered.set(), gate.wait(30), propose(self, batch))[2])
    server = start_drafter(DrafterConfig("ngram", K), "127.0.0.1", 0)
    remote = RemoteDrafter(DrafterLinkConfig(f"127.0.0.1:{server.port}", K, "auto", STEP_TIMEOUT_S,
                                             step_channel=request.param),
                           tiny_model.config.hidden_size, tiny_model.config.vocab_size, torch.float32,
                           torch.device("cpu"), 64, {}, tiny_model.config.model_type)
    deadline = time.monotonic() + 30
    while not remote.connected:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert remote.link.connection.stream.channel == {"auto": "the local lane", "grpc": "gRPC"}[request.param]
    yield remote, server, gate, entered
    gate.set()
    remote.close()
    server.stop(0)


def _repeating_batch(step):
    from specdec.drafting import DraftInput
    return DraftBatch(step, [DraftInput(7, 0, [4, 5, 6, 4, 5, 6, 4, 5], K)])


def test_the_remote_link_sends_at_once_and_reads_the_answer_later(gated_link):
    remote, _, gate, entered = gated_link
    answer = remote.propose_later(_repeating_batch(1))
    assert entered.wait(30) and not gate.is_set()   # the drafter is drafting and propose_later has returned
    gate.set()
    out = answer()
    assert not out.failure and out.drafts == [[6, 4, 5]]


def test_a_drafter_lost_before_its_answer_is_read_is_a_failed_step(gated_link):
    import threading
    import time
    remote, server, _, entered = gated_link
    answer = remote.propose_later(_repeating_batch(1))
    assert entered.wait(30)
    start = time.monotonic()
    # the server stops (its streams and lanes end, the answer unsent); in the background: its last step waits
    threading.Thread(target=server.stop, args=(0,), daemon=True).start()
    out = answer()
    assert time.monotonic() - start < STEP_TIMEOUT_S   # seen as the stream's end, not as a late answer
    assert out.failure and out.drafts == [[]]


def test_an_answer_read_after_the_deadline_counts_if_it_came_in_time(gated_link):
    """The engine may read an answer long after it asked (it idled in between): one that arrived in time is
    used, and the link stays up."""
    import time
    remote, _, gate, entered = gated_link
    gate.set()
    answer = remote.propose_later(_repeating_batch(1))
    assert entered.wait(30)
    time.sleep(STEP_TIMEOUT_S + 0.5)
    out = answer()
    assert not out.failure and out.drafts == [[6, 4, 5]] and remote.connected
    assert remote.propose(_repeating_batch(2)).drafts == [[6, 4, 5]]


def test_a_drafter_that_stops_while_the_engine_idles_is_seen_at_once(gated_link):
    """No step in flight: the link still notices the drafter's end (the gateway reports the drafter away), on the
    local lane as on the gRPC stream."""
    import time
    remote, server, gate, _ = gated_link
    gate.set()
    assert not remote.propose_later(_repeating_batch(1))().failure   # the link works
    server.stop(0)
    deadline = time.monotonic() + 5
    while remote.connected:
        assert time.monotonic() < deadline, "the link still looks connected"
        time.sleep(0.02)
