"""The accept / emit rule on ragged batches: greedy rows, the coupled draw, forced acceptance, batch independence.
Distributions are checked in test_sampling_distribution.py."""
import torch
from test_sampling_distribution import make_batch, random_fixture, target

from kernels.sampling import DRAW, exponential_race, speculative_sample_ref
from sampling_stats import rejection_sample

VOCAB = 40


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    logits, _ = random_fixture(k=3)
    top = logits.argmax(-1)
    drafts = torch.tensor([[top[0], top[1], (top[2] + 1) % VOCAB]])
    verdict = rejection_sample(logits, drafts, torch.tensor([3]), make_batch(1, greedy=True))
    assert verdict.num_accepted == [2] and verdict.tokens == [[top[0].item(), top[1].item(), top[2].item()]]


def test_coupled_draw_accepts_exactly_when_the_draft_is_the_targets_own_token():
    """Row j's target token is the race x_t at position offset + j; accepted drafts are those x_t, the first
    mismatch emits x_t, and with all accepted the bonus is x at the last row: plain decoding's tokens."""
    logits, _ = random_fixture(k=4, seed=3)
    batch = make_batch(1)
    p = target(logits)
    x = [exponential_race(p[j:j + 1].log(), batch.seeds, batch.offsets + j, DRAW).item() for j in range(5)]
    for agree in range(5):
        drafts = torch.tensor([x[:agree] + [(x[agree] + 1) % VOCAB if agree < 4 else x[3]] * (4 - agree)])[:, :4]
        verdict = rejection_sample(logits, drafts, torch.tensor([4]), batch)
        assert verdict.num_accepted == [min(agree, 4)]
        assert verdict.tokens == [x[:min(agree, 4) + 1]]


def test_ragged_batch_with_zero_drafts_greedy_and_random_rows():
    logits_a, drafts_a = random_fixture(k=3, seed=1)
    logits_b, _ = random_fixture(k=0, seed=2)
    logits_c, drafts_c = random_fixture(k=2, seed=3)
    logits = torch.cat([logits_a, logits_b, logits_c])                     # rows 4 + 1 + 3
    drafts = torch.tensor([drafts_a.tolist(), [-1, -1, -1], drafts_c.tolist() + [-1]])
    batch = make_batch(3)
    batch.greedy[1] = True
    verdict = rejection_sample(logits, drafts, torch.tensor([3, 0, 2]), batch)
    assert verdict.num_accepted[1] == 0 and verdict.tokens[1] == [logits_b.argmax(-1).item()]
    for b, (lg, d, k) in enumerate([(logits_a, drafts_a, 3), (logits_c, drafts_c, 2)]):
        one = make_batch(1)
        one.seeds[0] = batch.seeds[2 * b]
        alone = rejection_sample(lg, d[None], torch.tensor([k]), one)
        assert verdict.tokens[2 * b] == alone.tokens[0]                    # batch mates change nothing


def test_forced_acceptance_imposes_the_count_and_emits_the_targets_token():
    logits, drafts = random_fixture(k=3, seed=4)
    batch = make_batch(1)
    verdict = rejection_sample(logits, drafts[None], torch.tensor([3]), batch, forced_accepts=torch.tensor([2]))
    x2 = exponential_race(target(logits)[2:3].log(), batch.seeds, batch.offsets + 2, DRAW).item()
    assert verdict.num_accepted == [2] and verdict.tokens == [drafts[:2].tolist() + [x2]]


def test_reference_outputs_padded_tokens_and_row_tokens():
    logits, drafts = random_fixture(k=2, seed=5)
    greedy = logits.argmax(-1)
    drafts = torch.tensor([[greedy[0].item(), (greedy[1].item() + 1) % VOCAB]])
    tokens, accepted, row_tokens = speculative_sample_ref(
        None, greedy, None, drafts, torch.tensor([2]), torch.tensor([0, 3]), torch.tensor([True]),
        torch.tensor([False]), torch.tensor([1]), torch.tensor([0]))
    assert accepted.tolist() == [1]
    assert tokens.tolist() == [[greedy[0].item(), greedy[1].item(), -1]]
    assert row_tokens.tolist() == [greedy[0].item(), greedy[1].item(), -1]


def test_same_seed_same_tokens_whatever_the_batch_and_row():
    logits, drafts = random_fixture(k=3, seed=6)
    alone = rejection_sample(logits, drafts[None], torch.tensor([3]), make_batch(1))
    many = make_batch(64)
    many.seeds[37] = make_batch(1).seeds[0]
    together = rejection_sample(logits.repeat(64, 1), drafts.expand(64, 3), torch.full((64,), 3), many)
    assert together.tokens[37] == alone.tokens[0]


def test_greedy_rows_ignore_the_drafters_q_in_a_mixed_batch():
    """A greedy request whose drafter sent q, batched with a sampled one: it still accepts exactly while the
    draft is the argmax and emits the argmax (never a min(1, p/q) draw)."""
    logits = torch.zeros(4, 6)
    logits[:2, 0], logits[:2, 1] = 3.0, 2.9                     # sequence 0 (greedy): argmax 0, draft 1
    q = torch.zeros(4, 6)
    q[0, 1] = 1.0                                               # its drafter is sure of token 1
    batch = make_batch(2, uses_q=True)
    batch.greedy[0] = True
    for seed in range(50):
        batch.seeds[0] = seed
        verdict = rejection_sample(logits, torch.tensor([[1], [2]]), torch.tensor([1, 1]), batch, q)
        assert verdict.tokens[0] == [0] and verdict.num_accepted[0] == 0


def test_an_invalid_q_falls_back_to_the_coupled_draw():
    """q(d) = 0 (or NaN, or not a distribution) must not turn into an always-accept: the row is decided by the
    coupled draw, which is exact for any proposal."""
    from sampling_stats import P_VALUE_FLOOR, chi_square_p_value
    p = torch.tensor([0.7, 0.1, 0.1, 0.1])
    n = 4000
    logits = torch.stack([p.log(), p.log()]).repeat(n, 1)      # one draft row + bonus row per trial
    for bad in (torch.tensor([0.5, 0.0, 0.25, 0.25]), torch.tensor([float("nan"), 1.0, 0.0, 0.0]),
                torch.tensor([0.2, 0.2, 0.2, 0.2])):
        q = torch.stack([bad, torch.zeros(4)]).repeat(n, 1)
        verdict = rejection_sample(logits, torch.ones(n, 1, dtype=torch.long), torch.ones(n, dtype=torch.long),
                                   make_batch(n, uses_q=True), q)
        first = torch.tensor([t[0] for t in verdict.tokens])
        assert chi_square_p_value(first, p)[1] > P_VALUE_FLOOR, bad
