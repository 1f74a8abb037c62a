"""The all-greedy fast path of verification (kernels.sampling.greedy, its Triton launch,
verifier_service.sampler.sample without a sampling state) returns exactly what the general speculative rule returns for greedy rows,
forced acceptance included."""
import numpy as np
import pytest
import torch

from kernel_cases import load_interpreted

from kernels.sampling import cu_rows_of, greedy_accept_ref, speculative_sample_ref
from sampling_stats import greedy_verdict


def case(seed: int, num_drafts: list[int], vocab: int = 7):
    """Logits whose argmax often equals the draft (small vocab), drafts padded with -1."""
    g = torch.Generator().manual_seed(seed)
    nd = np.array(num_drafts, np.int64)
    width = int(nd.max(initial=0))
    logits = torch.randn(int((nd + 1).sum()), vocab, generator=g)
    drafts = torch.full((len(nd), width), -1, dtype=torch.long)
    for b, k in enumerate(nd):
        drafts[b, :k] = torch.randint(0, vocab, (int(k),), generator=g)
    cu = cu_rows_of(nd)
    start = 0
    for b, k in enumerate(nd):   # make some leading drafts the argmax, so runs of every length occur
        for j in range(int(torch.randint(0, int(k) + 1, (1,), generator=g))):
            logits[start + j, drafts[b, j]] += 10.0
        start += k + 1
    return logits, drafts, torch.from_numpy(nd), torch.from_numpy(cu)


def reference(logits, drafts, nd, forced=None):
    cu = torch.nn.functional.pad(torch.cumsum(nd + 1, 0), (1, 0))
    b = len(nd)
    tokens, acc, _ = speculative_sample_ref(None, logits.argmax(-1), None, drafts, nd, cu, torch.ones(b, dtype=torch.bool),
                                            torch.zeros(b, dtype=torch.bool), torch.zeros(b, dtype=torch.long),
                                            torch.zeros(b, dtype=torch.long), forced)
    return tokens, acc


def test_cu_rows_of():
    assert cu_rows_of(np.array([2, 0, 1])).tolist() == [0, 3, 4, 6]
    assert cu_rows_of(np.array([0, 0])).tolist() == [0, 1, 2]


def implementations():
    """The torch reference, and the Triton launch where the interpreter runs it (CPU)."""
    yield greedy_accept_ref
    from triton import knobs
    if knobs.runtime.interpret:
        yield load_interpreted("kernels.sampling.speculative_triton").greedy_accept_triton


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("num_drafts", [[3], [0], [3, 0, 2, 3, 1], [0, 0, 0], [4, 4]], ids=str)
def test_matches_the_general_rule(seed, num_drafts):
    logits, drafts, nd, cu = case(seed, num_drafts)
    want_tokens, want_acc = reference(logits, drafts, nd)
    for greedy_accept in implementations():
        tokens, acc = greedy_accept(logits.argmax(-1), drafts, nd, cu)
        assert torch.equal(acc, want_acc) and torch.equal(tokens, want_tokens), greedy_accept.__name__


@pytest.mark.parametrize("seed", range(6))
def test_forced_acceptance_matches_the_general_rule(seed):
    logits, drafts, nd, cu = case(seed, [3, 1, 0, 3])
    forced = torch.tensor([2, 3, 1, 0])
    want_tokens, want_acc = reference(logits, drafts, nd, forced)
    assert want_acc.tolist() == [2, 1, 0, 0]
    for greedy_accept in implementations():
        tokens, acc = greedy_accept(logits.argmax(-1), drafts, nd, cu, forced)
        assert torch.equal(acc, want_acc) and torch.equal(tokens, want_tokens), greedy_accept.__name__


def test_verdict_lists_what_each_sequence_emits():
    logits = torch.full((5, 6), -1.0)
    for row, tok in enumerate([4, 2, 5, 1, 3]):   # seq 0: rows 0-2 (drafts 4, 0), seq 1: rows 3-4 (draft 1)
        logits[row, tok] = 1.0
    drafts = torch.tensor([[4, 0], [1, -1]])
    verdict = greedy_verdict(logits, drafts, torch.tensor([2, 1]), torch.from_numpy(cu_rows_of(np.array([2, 1]))))
    assert verdict.num_accepted == [1, 1]
    assert verdict.tokens == [[4, 2], [1, 3]]
    assert verdict.logprobs == [None, None]


@pytest.mark.parametrize("seed", range(4))
def test_verdict_of_a_plain_step_is_each_rows_argmax(seed):
    """k = 0 for every sequence (plain decoding) takes a one-launch path: the same verdict as the general one."""
    logits, drafts, nd, cu = case(seed, [0, 0, 0, 0, 0])
    assert drafts.shape[1] == 0
    verdict = greedy_verdict(logits, drafts, nd, cu)
    want_tokens, want_acc = reference(logits, drafts, nd)
    assert verdict.num_accepted == want_acc.tolist() == [0] * 5
    assert verdict.tokens == [[t] for t in want_tokens[:, 0].tolist()] and verdict.logprobs == [None] * 5


def test_drafts_past_num_drafts_are_never_accepted():
    """Only the first k_b drafts count, whatever the padding holds (here a token equal to the next row's argmax)."""
    argmax, cu = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2, 4])
    drafts, nd = torch.tensor([[5, 6], [7, 9]]), torch.tensor([1, 1])
    for greedy_accept in implementations():
        tokens, acc = greedy_accept(argmax, drafts, nd, cu)
        assert acc.tolist() == [1, 1] and tokens.tolist() == [[5, 6, -1], [7, 8, -1]], greedy_accept.__name__
