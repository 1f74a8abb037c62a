"""A drafter can never take the verifier down or change its output: bad proposals are a drafter failure for
that step (k = 0), and a drafter that lost its context (a swap, a restart) gets it back and drafts again."""
import pytest
from engine_factory import make_drafter, make_engine, random_prompts

from drafter_service.ngram import NgramDrafter
from specdec.drafting import DraftOutput
from specdec.sampling_params import SamplingParams

LENGTHS = [3, 7, 12, 20, 5, 9, 30, 1]
MAX_TOKENS = [20, 33, 17, 40, 25, 30, 12, 28]


@pytest.fixture(scope="module")
def baseline(tiny_model):
    prompts = random_prompts(LENGTHS, tiny_model.config.vocab_size, seed=4)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    return prompts, params, make_engine(tiny_model).generate(prompts, params)


class Misbehaving:
    """Proposes like an all-accept drafter, but every third step answers in one broken way."""
    needs_hidden, kind = False, "misbehaving"

    def __init__(self, inner, fault: str, vocab: int):
        self.inner, self.fault, self.vocab, self.max_drafts, self.facts = inner, fault, vocab, inner.max_drafts, None
        self.calls = self.broken = 0

    def propose(self, batch):
        out = self.inner.propose(batch)
        self.calls += 1
        if self.calls % 3 or not any(out.drafts):
            return out
        self.broken += 1
        i = next(n for n, d in enumerate(out.drafts) if d)
        if self.fault == "raises":
            raise RuntimeError("drafter bug")
        if self.fault == "out_of_range":
            out.drafts[i][-1] = self.vocab + 5
        elif self.fault == "negative":
            out.drafts[i][0] = -1
        elif self.fault == "surplus":
            out.drafts[i] = out.drafts[i] * 3
        elif self.fault == "too_few_lists":
            out.drafts.pop()
        elif self.fault == "failure":
            return DraftOutput.failed(len(batch.seqs), "timed out")
        return out

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def clear(self):
        self.inner.clear()


@pytest.mark.parametrize("fault", ["out_of_range", "negative", "surplus", "too_few_lists", "raises", "failure"])
def test_bad_proposals_are_a_failed_step_never_a_crash(tiny_model, baseline, fault, caplog):
    prompts, params, expected = baseline
    inner = make_drafter("all-accept", tiny_model, 3, [p + e for p, e in zip(prompts, expected)])
    drafter = Misbehaving(inner, fault, tiny_model.config.vocab_size)
    engine = make_engine(tiny_model, drafter, 3)
    assert engine.generate(prompts, params) == expected
    assert drafter.broken > 0 and engine.fallback_steps == drafter.broken
    assert engine.stats.accepted == engine.stats.drafted > 0  # the good steps still drafted, all accepted
    assert "drafter failure" in caplog.text


class SwapAt:
    """A drafter replaced by a fresh instance of its kind at step `at` (what a swap of drafter processes
    looks like to the engine), recording which sequences got drafts at every step."""

    def __init__(self, build, at: int):
        self.build, self.at, self.inner, self.steps = build, at, build(), []
        self.kind, self.needs_hidden, self.max_drafts, self.facts = (self.inner.kind, self.inner.needs_hidden,
                                                                      self.inner.max_drafts, self.inner.facts)

    def propose(self, batch):
        if len(self.steps) == self.at:
            self.inner = self.build()
        out = self.inner.propose(batch)
        asked = {s.seq_id for s in batch.seqs if s.num_drafts > 0}
        self.steps.append((asked, {s.seq_id for s, d in zip(batch.seqs, out.drafts) if d}))
        return out

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def clear(self):
        self.inner.clear()


@pytest.mark.parametrize("kind", ["mtp", "draft_model"])
def test_a_swapped_drafter_gets_the_context_back_and_drafts_again(tiny_model, baseline, kind):
    """After the swap, hidden-state drafters (mtp) get their sequences recomputed, token-only ones (draft_model)
    get all tokens re-sent: output unchanged, and within 3 steps every sequence that asks gets drafts."""
    prompts, params, expected = baseline
    swap_at = 6
    drafter = SwapAt(lambda: make_drafter(kind, tiny_model, 3, draft_model=tiny_model), swap_at)
    engine = make_engine(tiny_model, drafter, 3)
    assert engine.generate(prompts, params) == expected
    before = drafter.steps[swap_at - 2]
    assert before[0] and before[1] == before[0]  # before the swap everybody drafts
    after = drafter.steps[swap_at:]
    assert after[0][1] != after[0][0]  # the new drafter lacked the context at first
    for asked, drafted in after[3:]:
        assert drafted == asked, "a sequence still drafts nothing three steps after the swap"


def test_ngram_gets_whole_context_after_a_swap(tiny_model, baseline):
    """A token-only drafter that reports missing context gets every committed token again, from position 0."""
    prompts, params, expected = baseline

    class ForgetfulNgram(NgramDrafter):
        def propose(self, batch):
            missing = [s.seq_id for s in batch.seqs if s.start_pos > 0 and s.seq_id not in self.contexts]
            self.seen_restarts = getattr(self, "seen_restarts", 0) + sum(
                1 for s in batch.seqs if s.start_pos == 0 and len(s.token_ids) > 1 and s.num_drafts > 0)
            out = super().propose(batch)
            out.missing = missing
            return out

    drafter = SwapAt(lambda: ForgetfulNgram(3), 6)
    engine = make_engine(tiny_model, drafter, 3)
    assert engine.generate(prompts, params) == expected
    assert drafter.inner.seen_restarts > 0  # decoding sequences were re-sent from position 0


def test_missing_context_for_a_sequence_sent_whole_is_a_bad_answer():
    """A drafter given a sequence from position 0 cannot lack its context: believing it would re-prefill that
    sequence every other step."""
    from specdec.drafting import DraftInput
    from specdec.drafting.proposals import proposal_problem
    inputs = [DraftInput(1, 0, [5, 6, 7], 2), DraftInput(2, 9, [8, 9], 2)]
    assert proposal_problem(DraftOutput(drafts=[[], []], missing=[2]), inputs, 100) == ""
    assert "sent from position 0" in proposal_problem(DraftOutput(drafts=[[], []], missing=[1]), inputs, 100)


def test_a_drafters_own_compute_time_reaches_the_step_phases(tiny_model, baseline):
    """A drafter that reports its compute time (the remote link does, from the drafter's answer) shows up in the
    engine's step phases, which the verifier exports as specdec_step_seconds{phase="drafter_compute"}."""
    prompts, params, expected = baseline

    class Timed:
        needs_hidden, kind, max_drafts, facts = False, "timed", 3, None

        def __init__(self):
            self.inner = NgramDrafter(3)

        def propose(self, batch):
            out = self.inner.propose(batch)
            out.compute_seconds = 0.0042
            return out

        def release(self, seq_ids):
            self.inner.release(seq_ids)

        def clear(self):
            self.inner.clear()
    engine = make_engine(tiny_model, Timed(), 3)
    engine.add_request("r", prompts[0], params[0])
    phases = []
    while engine.has_work:
        engine.step()
        phases.append(dict(engine.last_step_seconds))
    assert any(p.get("drafter_compute") == 0.0042 for p in phases)
