"""Statistics for the sampling tests: total variation, a chi-square goodness-of-fit p-value, per-token z-scores
of observed counts against summed probabilities, and a Kolmogorov–Smirnov test of randomised PIT values.

Thresholds are set so a correct sampler fails with probability ~1e-6 per check (z beyond 5, p-values below
1e-6) while the planted defects of tests/test_sampling_distribution.py fail by a wide margin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from verifier_service.sampler import DeviceVerdict, VerifyRows, sample

P_VALUE_FLOOR = 1e-6     # a correct sampler goes below this about once in a million checks
Z_LIMIT = 5.0


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


def chi_square_p_value(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, p-value) of Pearson's chi-square test of samples against probs; cells with expected count
    < 5 are pooled. A sample on a zero-probability token gives p = 0."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    expected = probs.double() * n
    if bool((counts[expected == 0] > 0).any()):
        return math.inf, 0.0
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    dof = max(int(keep.sum().item()) - 1, 1)
    return stat, torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)).item()


def calibration_z(emitted: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per token id: (observed count − Σ_trials p_trial(v)) / sqrt(Σ p(1 − p)). emitted [N], probs [N, V]."""
    observed = torch.bincount(emitted, minlength=probs.shape[1]).double()
    p = probs.double()
    return (observed - p.sum(0)) / (p * (1 - p)).sum(0).clamp_min(1e-12).sqrt()


def randomised_pit(emitted: torch.Tensor, probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """PIT of discrete draws: F(x − 1) + V · p(x) with V ~ U(0, 1) is uniform iff x ~ p. → [N] float64."""
    p = probs.double()
    below = p.cumsum(-1).gather(-1, emitted[:, None])[:, 0] - p.gather(-1, emitted[:, None])[:, 0]
    v = torch.rand(emitted.shape[0], dtype=torch.float64, generator=generator)
    return below + v * p.gather(-1, emitted[:, None])[:, 0]


def ks_uniform_p_value(values: torch.Tensor) -> tuple[float, float]:
    """(D, asymptotic p-value) of the one-sample Kolmogorov–Smirnov test against U(0, 1)."""
    x, _ = values.double().sort()
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max((i / n - x).max().item(), (x - (i - 1) / n).max().item())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return d, min(max(p, 0.0), 1.0)


# ---- the sampler's verdict on the host, as the engine reads it -------------------------------------------------
@dataclass
class Verdict:
    num_accepted: list[int]                # [B] accepted drafts per sequence
    tokens: list[list[int]]                # [B] accepted drafts + one recovered or bonus token
    logprobs: list                         # [B] per emitted token (TokenLogprob), None where not asked


def host_verdict(verdict: DeviceVerdict) -> Verdict:
    tokens = verdict.tokens.tolist()
    accepted = verdict.accepted.tolist() if verdict.accepted is not None else [0] * len(tokens)
    logprobs = verdict.logprobs.read(accepted) if verdict.logprobs is not None else [None] * len(tokens)
    return Verdict(accepted, [row[:j + 1] for row, j in zip(tokens, accepted)], logprobs)


def rows_of(drafts: torch.Tensor, num_drafts: torch.Tensor) -> VerifyRows:
    """k_b + 1 rows per sequence (drafts [B, K] padded with -1, num_drafts [B])."""
    cu_rows = torch.nn.functional.pad(torch.cumsum(num_drafts + 1, 0), (1, 0))
    return VerifyRows(drafts, num_drafts, cu_rows, drafts.shape[1])


def rejection_sample(logits, drafts, num_drafts, sampling, draft_probs=None, forced_accepts=None) -> Verdict:
    """verifier_service.sampler.sample with a sampling state (the rule for every row kind), read on the host."""
    return host_verdict(sample(logits, rows_of(drafts, num_drafts), sampling, draft_probs, forced_accepts))


def greedy_verdict(logits, drafts, num_drafts, cu_rows, forced_accepts=None) -> Verdict:
    """verifier_service.sampler.sample without a sampling state (every row greedy: the argmax path)."""
    rows = VerifyRows(drafts, num_drafts, cu_rows, drafts.shape[1])
    return host_verdict(sample(logits, rows, None, None, forced_accepts))
