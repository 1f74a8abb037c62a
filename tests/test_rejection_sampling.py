"""Rejection sampling keeps the target distribution (DESIGN §3.3).

Fixed target logits for k+1 rows and fixed drafts; many independent seeds in one vectorised call. The first
emitted token must follow p0, and the second, given the first draft was accepted, must follow p1. The
threshold is checked to separate a correct sampler from a wrong one (one that always accepts).
"""
import pytest
import torch

from verifier_service.rejection_sampler import SamplingBatch, rejection_sample
from verifier_service.sampling import target_probs

VOCAB, TRIALS, K = 40, 40000, 3
TV_THRESHOLD = 0.03  # expected TV of 40k samples over ≤ 40 outcomes is ≈ 0.01


def batch(trials, temperature=1.0, top_k=0, top_p=1.0, greedy=False):
    return SamplingBatch(greedy=torch.full((trials,), greedy), temperature=torch.full((trials,), temperature),
                         top_k=torch.full((trials,), top_k), top_p=torch.full((trials,), top_p),
                         seeds=torch.arange(trials) * 7919 + 13, offsets=torch.full((trials,), 5))


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 1, VOCAB, generator=g) * 2.0   # [K+1, V] one sequence's rows
    drafts = logits.argsort(-1, descending=True)[:K, 1]       # the second most likely token: often rejected
    return logits, drafts


def run(logits, drafts, sampling, draft_probs=None, forced=None):
    trials = sampling.seeds.shape[0]
    verdict = rejection_sample(logits.repeat(trials, 1), drafts.repeat(trials), [K] * trials, sampling,
                               None if draft_probs is None else draft_probs.repeat(trials, 1),
                               forced_accepts=forced)
    return verdict


def tv(samples, probs):
    counts = torch.bincount(torch.tensor(samples), minlength=probs.shape[0]).float()
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (8, 0.9)], ids=["temperature-1", "top-k-top-p"])
def test_emitted_tokens_follow_target(top_k, top_p):
    logits, drafts = setup()
    sampling = batch(TRIALS, top_k=top_k, top_p=top_p)
    p = target_probs(logits, torch.ones(K + 1), torch.full((K + 1,), top_k), torch.full((K + 1,), top_p))
    verdict = run(logits, drafts, sampling)
    first = [t[0] for t in verdict.tokens]
    assert tv(first, p[0]) < TV_THRESHOLD
    second = [t[1] for t in verdict.tokens if t[0] == drafts[0].item()]
    assert len(second) > 2000
    assert tv(second, p[1]) < 2.5 * TV_THRESHOLD
    # Acceptance rate of the first draft is p0(d1) for a one-hot (argmax) drafter.
    rate = sum(j > 0 for j in verdict.num_accepted) / TRIALS
    assert abs(rate - p[0, drafts[0]].item()) < 0.01
    if top_k:
        assert all(p[0, t] > 0 for t in first)  # never a token outside top-k / top-p


def test_with_draft_probabilities():
    """A drafter that sends q: accept with min(1, p/q), recover from norm(max(p − q, 0))."""
    logits, _ = setup(1)
    g = torch.Generator().manual_seed(2)
    q = torch.softmax(torch.randn(K, VOCAB, generator=g), -1)        # [K, V]
    trials = TRIALS
    drafts = torch.multinomial(q, trials, replacement=True, generator=g).t()  # [trials, K] drafts ~ q
    sampling = batch(trials)
    verdict = rejection_sample(logits.repeat(trials, 1), drafts.reshape(-1), [K] * trials, sampling,
                               q.repeat(trials, 1))
    p0 = torch.softmax(logits[0], -1)
    assert tv([t[0] for t in verdict.tokens], p0) < TV_THRESHOLD


def test_threshold_rejects_a_wrong_sampler():
    """An always-accept sampler emits the draft every time: the same check must fail on it."""
    logits, drafts = setup()
    p0 = torch.softmax(logits[0], -1)
    wrong = run(logits, drafts, batch(2000), forced=[K] * 2000)
    assert tv([t[0] for t in wrong.tokens], p0) > TV_THRESHOLD * 5


def test_greedy_rows_and_mixed_batch():
    logits, drafts = setup()
    target = logits.argmax(-1)
    drafts = torch.tensor([target[0].item(), target[1].item(), (target[2].item() + 1) % VOCAB])
    sampling = batch(2, greedy=True)
    sampling.greedy[1] = False  # a random row beside a greedy one
    verdict = run(logits, drafts, sampling)
    assert verdict.num_accepted[0] == 2 and verdict.tokens[0] == [target[0].item(), target[1].item(),
                                                                   target[2].item()]


def test_same_seed_same_tokens_whatever_the_batch():
    logits, drafts = setup()
    alone = run(logits, drafts, batch(1))
    many = batch(64)
    many.seeds[37] = batch(1).seeds[0]
    together = run(logits, drafts, many)
    assert together.tokens[37] == alone.tokens[0]
