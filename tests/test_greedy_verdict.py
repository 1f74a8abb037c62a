"""The all-greedy fast path of verification (kernels.sampling.greedy, rejection_sampler.greedy_verdict) returns
exactly what the general speculative rule returns for greedy rows, forced acceptance included."""
import numpy as np
import pytest
import torch

from kernels.sampling import greedy_accept, row_index, speculative_sample_ref
from verifier_service.rejection_sampler import greedy_verdict


def case(seed: int, num_drafts: list[int], vocab: int = 7):
    """Logits whose argmax often equals the draft (small vocab), drafts padded with -1."""
    g = torch.Generator().manual_seed(seed)
    nd = np.array(num_drafts, np.int64)
    width = int(nd.max(initial=0))
    logits = torch.randn(int((nd + 1).sum()), vocab, generator=g)
    drafts = torch.full((len(nd), width), -1, dtype=torch.long)
    for b, k in enumerate(nd):
        drafts[b, :k] = torch.randint(0, vocab, (int(k),), generator=g)
    rows = row_index(nd)
    start = 0
    for b, k in enumerate(nd):   # make some leading drafts the argmax, so runs of every length occur
        for j in range(int(torch.randint(0, int(k) + 1, (1,), generator=g))):
            logits[start + j, drafts[b, j]] += 10.0
        start += k + 1
    return logits, drafts, torch.from_numpy(nd), torch.from_numpy(rows)


def reference(logits, drafts, nd, forced=None):
    cu = torch.nn.functional.pad(torch.cumsum(nd + 1, 0), (1, 0))
    b = len(nd)
    tokens, acc, _ = speculative_sample_ref(None, logits.argmax(-1), None, drafts, nd, cu, torch.ones(b, dtype=torch.bool),
                                            torch.zeros(b, dtype=torch.bool), torch.zeros(b, dtype=torch.long),
                                            torch.zeros(b, dtype=torch.long), forced)
    return tokens, acc


def test_row_index():
    assert row_index(np.array([2, 0, 1])).tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]
    assert row_index(np.array([0, 0])).tolist() == [[0], [1]]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("num_drafts", [[3], [0], [3, 0, 2, 3, 1], [0, 0, 0], [4, 4]], ids=str)
def test_matches_the_general_rule(seed, num_drafts):
    logits, drafts, nd, rows = case(seed, num_drafts)
    tokens, acc = greedy_accept(logits.argmax(-1), rows, drafts)
    want_tokens, want_acc = reference(logits, drafts, nd)
    assert torch.equal(acc, want_acc) and torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("seed", range(6))
def test_forced_acceptance_matches_the_general_rule(seed):
    logits, drafts, nd, rows = case(seed, [3, 1, 0, 3])
    forced = torch.tensor([2, 3, 1, 0])
    tokens, acc = greedy_accept(logits.argmax(-1), rows, drafts, forced)
    want_tokens, want_acc = reference(logits, drafts, nd, forced)
    assert acc.tolist() == [2, 1, 0, 0]
    assert torch.equal(acc, want_acc) and torch.equal(tokens, want_tokens)


def test_verdict_lists_what_each_sequence_emits():
    logits = torch.full((5, 6), -1.0)
    for row, tok in enumerate([4, 2, 5, 1, 3]):   # seq 0: rows 0-2 (drafts 4, 0), seq 1: rows 3-4 (draft 1)
        logits[row, tok] = 1.0
    drafts = torch.tensor([[4, 0], [1, -1]])
    verdict = greedy_verdict(logits, torch.from_numpy(row_index(np.array([2, 1]))), drafts)
    assert verdict.num_accepted == [1, 1]
    assert verdict.tokens == [[4, 2], [1, 3]]
    assert verdict.logprobs == [None, None]


@pytest.mark.parametrize("seed", range(4))
def test_verdict_of_a_plain_step_is_each_rows_argmax(seed):
    """k = 0 for every sequence (plain decoding) takes a one-launch path: the same verdict as the general one."""
    logits, drafts, nd, rows = case(seed, [0, 0, 0, 0, 0])
    assert drafts.shape[1] == 0
    verdict = greedy_verdict(logits, rows, drafts)
    want_tokens, want_acc = reference(logits, drafts, nd)
    assert verdict.num_accepted == want_acc.tolist() == [0] * 5
    assert verdict.tokens == [[t] for t in want_tokens[:, 0].tolist()] and verdict.logprobs == [None] * 5
