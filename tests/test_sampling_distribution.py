"""Speculative sampling keeps the target's distribution (docs/sampling.md), checked statistically over many seeds.

Each fixture verifies the same target rows against the same drafts for N seeds in one vectorised call. The
first emitted token must follow p0 (the processed distribution of row 0); given the first draft was accepted,
the second must follow p1; after a rejection at row 0 the emitted token must follow the residual. Checks use
chi-square p-values (and report TV); an aggregate test draws every trial from its own random distribution and
checks per-token calibration and a randomised-PIT KS test. Every check is also run on planted defects (the old
aliased acceptance uniform, a 3% bias towards token 0, a rare leak outside top-k) and must fail on them.
"""
from dataclasses import dataclass

import pytest
import torch
from sampling_stats import (P_VALUE_FLOOR, Z_LIMIT, calibration_z, chi_square_p_value, ks_uniform_p_value,
                            randomised_pit, total_variation)

import kernels.sampling.reference as sampling_reference
from kernels.sampling import ACCEPT, DRAW, exponential_race, uniforms
from verifier_service.sampler import RowParams, processed_probs
from sampling_stats import rejection_sample
from verifier_service.sampler import SamplingBatch

N = 20000


def make_batch(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, greedy=False, uses_q=False, seed0=13):
    full = lambda v, dtype: torch.full((n,), v, dtype=dtype)  # noqa: E731
    return SamplingBatch(
        greedy=full(greedy, torch.bool), temperature=full(temperature, torch.float32), top_k=full(top_k, torch.long),
        top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
        seeds=torch.arange(n, dtype=torch.long) * 7919 + seed0, offsets=torch.full((n,), 5, dtype=torch.long),
        uses_q=full(uses_q, torch.bool), repetition=full(1.0, torch.float32), presence=full(0.0, torch.float32),
        frequency=full(0.0, torch.float32), output_counts=None, prompt_mask=None, all_greedy=greedy,
        penalised=False, truncates=top_k > 0 or top_p < 1.0, logprobs=[None] * n, max_logprobs=None)


def target(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    rows = logits.shape[0]
    full = lambda v, dtype: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    return processed_probs(logits, RowParams(full(False, torch.bool), full(temperature, torch.float32),
                                             full(top_k, torch.long), full(top_p, torch.float32),
                                             full(min_p, torch.float32)))


@dataclass
class Outcome:
    first: torch.Tensor          # [N] first emitted token
    second: torch.Tensor         # [M] second token of the trials whose first draft was accepted
    rejected_first: torch.Tensor  # [M'] first token of the trials that rejected draft 0
    accepted: torch.Tensor       # [N] accepted counts


def run(sample, logits, drafts, batch, draft_probs=None):
    """One sequence's rows (logits [K+1, V], drafts [K] or [N, K]) verified for every seed in batch."""
    n, k = batch.seeds.shape[0], logits.shape[0] - 1
    drafts = drafts.expand(n, k) if drafts.dim() == 1 else drafts
    q = None if draft_probs is None else draft_probs.repeat(n, 1)
    verdict = sample(logits.repeat(n, 1), drafts, torch.full((n,), k), batch, q)
    first = torch.tensor([t[0] for t in verdict.tokens])
    accepted = torch.tensor(verdict.num_accepted)
    return Outcome(first, torch.tensor([t[1] for t, j in zip(verdict.tokens, verdict.num_accepted) if j > 0]),
                   first[accepted == 0], accepted)


# ---- planted defects ----------------------------------------------------------------------------------------
def aliased_sampler(logits, drafts, num_drafts, batch, q):
    """The rule as it was (defect 1): accept d with u < p(d), u being the uniform row 0 draws for token id j
    (the masked ACCEPT index), then a race over the residual with those same draw uniforms."""
    n, k = drafts.shape
    probs = target(logits)
    tokens, accepted = [], []
    u_draw = uniforms(batch.seeds, batch.offsets, DRAW, torch.arange(logits.shape[1]))         # row 0's draws
    for j in range(k + 1):
        rows = probs[j::k + 1]                                                                  # [n, V]
        if j < k:
            u = u_draw[:, j]
            acc = u < rows.gather(-1, drafts[:, j:j + 1])[:, 0]
        residual = rows.scatter(-1, drafts[:, j:j + 1], 0.0) if j < k else rows
        emit = (residual / -torch.log(uniforms(batch.seeds, batch.offsets + j, DRAW,
                                               torch.arange(logits.shape[1])))).argmax(-1)
        tokens.append(torch.where(acc, drafts[:, j], emit) if j < k else emit)
        accepted.append(acc if j < k else torch.zeros(n, dtype=torch.bool))
    acc = torch.stack(accepted, 1).long().cumprod(1).sum(1)
    toks = torch.stack(tokens, 1)
    return _verdict(toks, acc)


def _verdict(toks, acc):
    from sampling_stats import Verdict
    rows = toks.tolist()
    return Verdict(num_accepted=acc.tolist(), tokens=[r[:j + 1] for r, j in zip(rows, acc.tolist())],
                   logprobs=[None] * len(rows))


def biased_to_zero(logits, drafts, num_drafts, batch, q, rate=0.03):
    """A 3% bias: the first emitted token becomes token 0 for some seeds."""
    verdict = rejection_sample(logits, drafts, num_drafts, batch, q)
    hit = uniforms(batch.seeds, batch.offsets, 7, torch.zeros(1, dtype=torch.long))[:, 0] < rate
    for i in hit.nonzero()[:, 0].tolist():
        verdict.tokens[i] = [0]
        verdict.num_accepted[i] = 0
    return verdict


def leaky(logits, drafts, num_drafts, batch, q, rate=0.005):
    """Emits a uniformly random token instead, now and then: sometimes one that top-k cut."""
    verdict = rejection_sample(logits, drafts, num_drafts, batch, q)
    u = uniforms(batch.seeds, batch.offsets, 8, torch.arange(2))
    for i in (u[:, 0] < rate).nonzero()[:, 0].tolist():
        verdict.tokens[i] = [int(u[i, 1] * logits.shape[1])]
        verdict.num_accepted[i] = 0
    return verdict


# ---- fixtures -----------------------------------------------------------------------------------------------
def token0_fixture():
    """Vocab 8, the draft has p = 0.7, token 0 has real mass (the issue's repro)."""
    p = torch.tensor([0.15, 0.05, 0.03, 0.7, 0.02, 0.02, 0.02, 0.01])
    return torch.stack([p.log()] * 3), torch.tensor([3, 3])


def random_fixture(vocab=40, k=3, seed=0, draft_rank=1, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab, generator=g) * scale                                      # [K+1, V]
    return logits, logits.argsort(-1, descending=True)[:k, draft_rank]


FIXTURES = {  # name: (logits, drafts, processing)
    "token0-mass-p(d)=0.7": (*token0_fixture(), {}),
    "often-accepted": (*random_fixture(draft_rank=0, scale=2.5), {}),
    "rarely-accepted": (*random_fixture(draft_rank=12, seed=1), {}),
    "temperature-0.3": (*random_fixture(seed=2), {"temperature": 0.3}),
    "temperature-1.5": (*random_fixture(seed=3), {"temperature": 1.5}),
    "top-k-5": (*random_fixture(seed=4), {"top_k": 5}),
    "top-p-0.8": (*random_fixture(seed=5), {"top_p": 0.8}),
    "min-p-0.1": (*random_fixture(seed=6, scale=1.0), {"min_p": 0.1}),
    "all-cuts-t0.7": (*random_fixture(seed=7), {"temperature": 0.7, "top_k": 12, "top_p": 0.9, "min_p": 0.02}),
}


def check_fixture(sample, logits, drafts, processing, n=N):
    p = target(logits, **processing)
    out = run(sample, logits, drafts, make_batch(n, **processing))
    stats = {}
    stats["first"] = chi_square_p_value(out.first, p[0])[1], total_variation(out.first, p[0])
    residual = p[0].clone()
    residual[drafts[0]] = 0
    stats["after-rejection"] = chi_square_p_value(out.rejected_first, residual / residual.sum())[1], None
    if out.second.numel() > 200:
        stats["second"] = chi_square_p_value(out.second, p[1])[1], total_variation(out.second, p[1])
    rate = (out.accepted > 0).double().mean().item()
    z_accept = (rate - p[0, drafts[0]].item()) / max((p[0, drafts[0]].item() * (1 - p[0, drafts[0]].item()) / n) ** 0.5, 1e-9)
    for name, (pv, _) in stats.items():
        assert pv > P_VALUE_FLOOR, (name, stats)
    assert abs(z_accept) < Z_LIMIT, z_accept
    return stats, z_accept


@pytest.mark.parametrize("name", list(FIXTURES))
def test_emitted_tokens_follow_the_target(name, capsys):
    logits, drafts, processing = FIXTURES[name]
    stats, z = check_fixture(rejection_sample, logits, drafts, processing)
    with capsys.disabled():
        print(f"\n  {name}: " + ", ".join(f"{k} p={v[0]:.3g}" + (f" TV={v[1]:.4f}" if v[1] is not None else "")
                                        for k, v in stats.items()) + f", acceptance z={z:+.2f}")


def test_check_catches_the_aliased_acceptance_uniform():
    logits, drafts, processing = FIXTURES["token0-mass-p(d)=0.7"]
    with pytest.raises(AssertionError):
        check_fixture(aliased_sampler, logits, drafts, processing)


def test_check_catches_a_three_percent_bias():
    logits, drafts, processing = FIXTURES["often-accepted"]
    with pytest.raises(AssertionError):
        check_fixture(biased_to_zero, logits, drafts, processing)


def test_check_catches_a_leak_outside_top_k():
    logits, drafts, processing = FIXTURES["top-k-5"]
    with pytest.raises(AssertionError):
        check_fixture(leaky, logits, drafts, processing)


# ---- drafters that send q -----------------------------------------------------------------------------------
def q_fixture(k=3, vocab=12):
    """Token 0 carries real mass in p and little in q, so it is a likely recovered token."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    logits[:, 0] = logits.max(-1).values - 0.5
    q_logits = torch.randn(k, vocab, generator=g) * 1.5
    q_logits[:, 0] -= 3
    q = torch.softmax(q_logits, -1)                                                          # [K, V]
    q_rows = torch.cat([q, torch.zeros(1, vocab)])                                           # [K+1, V]
    drafts = torch.multinomial(q, N, replacement=True, generator=g).t()                       # [N, K] d ~ q
    return logits, q, q_rows, drafts


def check_q_path(sample):
    logits, q, q_rows, drafts = q_fixture()
    p = target(logits)
    out = run(sample, logits, drafts, make_batch(N, uses_q=True), draft_probs=q_rows)
    pv_first = chi_square_p_value(out.first, p[0])[1]
    assert pv_first > P_VALUE_FLOOR, pv_first
    expected_rate = torch.minimum(p[0], q[0]).sum().item()                      # P(accept) = Σ min(p, q)
    rate = (out.accepted > 0).double().mean().item()
    assert abs(rate - expected_rate) < Z_LIMIT * (expected_rate * (1 - expected_rate) / N) ** 0.5
    residual = (p[0] - q[0]).clamp_min(0)
    pv_rejected = chi_square_p_value(out.rejected_first, residual / residual.sum())[1]
    assert pv_rejected > P_VALUE_FLOOR, pv_rejected
    return pv_first, pv_rejected, total_variation(out.first, p[0])


def test_q_path_follows_the_target(capsys):
    pv_first, pv_rejected, tv = check_q_path(rejection_sample)
    with capsys.disabled():
        print(f"\n  q path: first p={pv_first:.3g} TV={tv:.4f}, after rejection p={pv_rejected:.3g}")


def test_q_check_catches_an_acceptance_uniform_shared_with_the_recovery_race(monkeypatch):
    """Defect 1 on the q path: the recovered race reuses the acceptance uniform (same stream)."""
    monkeypatch.setattr(sampling_reference, "RECOVER", ACCEPT)
    with pytest.raises(AssertionError):
        check_q_path(rejection_sample)


# ---- aggregate calibration over many distributions ---------------------------------------------------------
def check_calibration(sample, n=N, vocab=16, k=2):
    """Every trial its own logits (temperature, drafts at random ranks): per token id, observed count vs
    Σ p over trials (z-scores), and the randomised PIT of the first emitted token (KS)."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(n, k + 1, vocab, generator=g) * torch.rand(n, 1, 1, generator=g) * 4   # [n, K+1, V]
    drafts = torch.randint(0, vocab, (n, k), generator=g)
    drafts[: n // 2] = logits[: n // 2, :k].argmax(-1)                                    # half: argmax drafts
    batch = make_batch(n)
    verdict = sample(logits.reshape(-1, vocab), drafts, torch.full((n,), k), batch, None)
    first = torch.tensor([t[0] for t in verdict.tokens])
    p0 = target(logits[:, 0])                                                             # [n, V]
    z = calibration_z(first, p0)
    _, ks_p = ks_uniform_p_value(randomised_pit(first, p0, torch.Generator().manual_seed(5)))
    assert z.abs().max().item() < Z_LIMIT, z.tolist()
    assert ks_p > P_VALUE_FLOOR, ks_p
    return z.abs().max().item(), ks_p


def test_calibration_across_many_distributions(capsys):
    z, ks_p = check_calibration(rejection_sample)
    with capsys.disabled():
        print(f"\n  calibration: max |z| over token ids = {z:.2f}, PIT KS p = {ks_p:.3g}")


def test_calibration_catches_a_biased_token():
    with pytest.raises(AssertionError):
        check_calibration(biased_to_zero)


def test_race_draws_follow_probabilities_with_zeros():
    """The race alone, one row per seed: exact frequencies; zero-probability tokens never drawn."""
    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3])
    draws = exponential_race(probs.log().expand(N, 5), torch.arange(N), torch.zeros(N, dtype=torch.long), DRAW)
    assert chi_square_p_value(draws, probs)[1] > P_VALUE_FLOOR
    assert not bool(((draws == 0) | (draws == 2)).any())
