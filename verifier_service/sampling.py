"""Target distributions and batch-independent randomness for sampling.

Randomness is counter based: uniform(seed, offset, index) is a hash, so a seeded request draws the same
numbers whatever else is in the batch and whatever device runs it, with no per-request generator objects and
no host sync. `offset` advances per verify step (the number of tokens emitted so far).
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow: split c into 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32): well spread outputs for consecutive inputs."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1). seeds, offsets: [R] int64; index: [R, N] or [N] int64 → [R, N] float32."""
    key = hash32(hash32(seeds & _MASK32) ^ hash32((seeds >> 32) ^ _MASK32) ^ offsets)   # [R]
    bits = hash32(key[:, None] ^ hash32(index + 0x9E3779B9))                          # [R, N]
    return (bits.float() + 0.5) / 4294967296.0


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor) -> torch.Tensor:
    """Distribution to sample from, per row. logits [R, V] fp32; temperature [R] (> 0), top_k [R] (0 = off),
    top_p [R] (1 = off) → probs [R, V]. Greedy rows are handled by the caller (argmax)."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)                 # [R, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = rank >= k                                                             # top-k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= mass_before >= top_p[:, None]                                        # top-p: keep the smallest prefix
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(-1))


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Exponential-race sampling: argmax p / E with E = -log u ~ Exp(1) picks index i with probability p_i.
    probs, uniforms: [R, V] → [R] int64."""
    return (probs / -torch.log(uniforms)).argmax(-1)
