"""Penalties, temperature, top-k, top-p and min-p against transformers' own logits processors."""
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from verifier_service.sampler import Penalties, RowParams, apply_penalties, processed_logits

VOCAB = 50


def rows(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    full = lambda v, dtype: torch.full((n,), v, dtype=dtype)  # noqa: E731
    return RowParams(full(False, torch.bool), full(temperature, torch.float32), full(top_k, torch.long),
                     full(top_p, torch.float32), full(min_p, torch.float32))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.5, 20, 0.9, 0.05)])
def test_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    ours = processed_logits(logits, rows(6, temperature, top_k, top_p, min_p))
    ids = torch.zeros(6, 1, dtype=torch.long)
    hf = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    for warper in ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else []) \
            + ([MinPLogitsWarper(min_p)] if min_p else []):
        hf = warper(ids, hf)
    assert torch.equal(torch.isinf(ours), torch.isinf(hf))
    torch.testing.assert_close(ours.softmax(-1), hf.softmax(-1))


def test_top_p_one_cuts_nothing_even_when_the_mass_saturates():
    """A peaked row sums to 1.0 in fp32 after a few tokens: top_p = 1 must still keep the whole tail."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 40.0
    assert not torch.isinf(processed_logits(logits, rows(1))).any()


def test_per_row_parameters():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    r = rows(2)
    r.top_k[1] = 3
    out = processed_logits(logits, r)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1]).sum() == 3


def test_repetition_penalty_matches_transformers():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, VOCAB, generator=g) * 3
    prompt, output = [3, 7, 7, 9], [11, 3, 20, 20, 20]
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).int()[None]
    mask = torch.zeros(1, VOCAB, dtype=torch.bool)
    mask[0, prompt] = True
    ours = apply_penalties(logits, Penalties(counts, mask, torch.tensor([1.4]), torch.tensor([0.0]),
                                             torch.tensor([0.0])))
    hf = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(ours, hf)


def test_presence_and_frequency_penalties_follow_the_openai_formula():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    output = [5, 5, 5, 8]
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).int()[None]
    ours = apply_penalties(logits, Penalties(counts, torch.zeros(1, VOCAB, dtype=torch.bool), torch.tensor([1.0]),
                                             torch.tensor([0.5]), torch.tensor([0.25])))
    want = logits.clone()
    want[0, 5] -= 3 * 0.25 + 0.5
    want[0, 8] -= 1 * 0.25 + 0.5
    torch.testing.assert_close(ours, want)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_min_p_without_the_sort_equals_the_sorted_path(min_p):
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    r = rows(5, temperature=0.7, min_p=min_p)
    fast, full = processed_logits(logits, r, sort=False), processed_logits(logits, r)
    assert torch.equal(torch.isinf(fast), torch.isinf(full))
    torch.testing.assert_close(fast.softmax(-1), full.softmax(-1))
