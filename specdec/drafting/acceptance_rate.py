"""Per-token acceptance rate a for a wanted mean acceptance length (tokens per verify step) at k drafts:
Σ_{i=0..k} a^i = (1 − a^{k+1}) / (1 − a) = mean length. Used by the synthetic drafter and forced acceptance."""


def acceptance_rate_for(mean_length: float, k: int) -> float:
    """Per-token acceptance a with 1 + a + ... + a^k = mean_length (bisection)."""
    if not 1.0 <= mean_length <= k + 1:
        raise ValueError(f"mean acceptance length must be in [1, k+1] = [1, {k + 1}], got {mean_length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(k + 1)) < mean_length else (lo, a)
    return (lo + hi) / 2
