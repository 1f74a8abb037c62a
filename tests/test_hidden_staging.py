"""The drafter's hidden rows placed on the device before the step's sync are the rows the host would gather after
it: the same for every layout (prefill chunks, drafts, accepted counts) and through whole engine runs."""
import numpy as np
import pytest
import torch
from engine_factory import make_drafter, make_engine, random_prompts

from specdec.sampling_params import SamplingParams
from verifier_service.drafting_stage import DraftingStage
from verifier_service.hidden_staging import HiddenStaging

pytestmark = pytest.mark.timeout(300)
K = 3


@pytest.mark.parametrize("seed", range(6))
def test_placed_rows_are_the_committed_rows_in_batch_order(seed):
    rng = np.random.default_rng(seed)
    b = int(rng.integers(1, 7))
    drafts = rng.integers(0, K + 1, b)
    sampled = rng.random(b) < 0.7                                # the rest are prefill chunks mid-prompt
    drafts[~sampled] = 0
    lens = np.where(sampled & (drafts > 0), drafts + 1, rng.integers(1, 9, b))
    accepted = np.where(sampled, [rng.integers(0, d + 1) for d in drafts], 0)
    hidden = torch.randn(int(lens.sum()), 5)
    staging = HiddenStaging(int(lens.sum()) + 3, 5, torch.float32, torch.device("cpu"))
    staging.buffer.fill_(float("nan"))
    staging.layout(lens.tolist(), drafts.tolist(), np.flatnonzero(sampled).tolist())
    staging.gather(hidden, torch.as_tensor(accepted[sampled]))
    first = np.cumsum(lens) - lens
    commit = lens - drafts + accepted
    expected = torch.cat([hidden[f:f + c] for f, c in zip(first, commit)])
    assert staging.staged and torch.equal(staging.rows(int(commit.sum())), expected)


def test_no_accepted_counts_commit_each_chunk_less_its_drafts():
    staging = HiddenStaging(8, 2, torch.float32, torch.device("cpu"))
    hidden = torch.arange(12.0).view(6, 2)
    staging.layout([2, 4], [0, 3], [1])
    staging.gather(hidden, None)
    assert torch.equal(staging.rows(3), hidden[[0, 1, 2]])


class Recording:
    """An in-process drafter that keeps a copy of every hidden tensor it is given."""
    needs_hidden = True

    def __init__(self, inner):
        self.inner, self.max_drafts, self.seen = inner, inner.max_drafts, []

    def propose(self, batch):
        self.seen.append(None if batch.hidden is None else batch.hidden.clone())
        return self.inner.propose(batch)

    def release(self, seq_ids):
        self.inner.release(seq_ids)

    def clear(self):
        self.inner.clear()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_engine_gives_the_drafter_the_same_rows_staged_or_gathered(tiny_model, monkeypatch, temperature):
    prompts = random_prompts([5, 13, 9], tiny_model.config.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=12, temperature=temperature, seed=i, ignore_eos=True) for i in range(3)]

    def run():
        drafter = Recording(make_drafter("mtp", tiny_model, K))
        out = make_engine(tiny_model, drafter, k=K, chunk=4, budget=16).generate(prompts, params)
        return out, drafter.seen
    staged_out, staged = run()
    monkeypatch.setattr(DraftingStage, "layout_hidden", lambda self, entries, hidden: None)   # the gather after the sync
    gathered_out, gathered = run()
    assert staged_out == gathered_out and len(staged) == len(gathered) > 5
    for a, b in zip(staged, gathered):
        assert torch.equal(a, b)
