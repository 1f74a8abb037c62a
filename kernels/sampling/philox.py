"""Counter-based randomness for sampling: Philox4x32-10 (Salmon et al., SC'11), in torch integer ops.

A uniform is a pure function of (seed, position, stream, index): no generator state, so a seeded request
draws the same numbers whatever else is in the batch, whichever row or slot it occupies, on any device.
  key     = (seed mod 2^32, seed >> 32)              the request's 64-bit seed
  counter = (index, position, stream, 0)             each field a whole 32-bit word: nothing is masked away
Streams keep the draws of different decisions independent (docs/sampling.md): the target's token race (DRAW),
the acceptance test of a drafter that sent q (ACCEPT) and the recovered-token race on its residual (RECOVER).

Integers are held in int64 tensors with values in [0, 2^32); the 32×32 → 64-bit products are split into
16-bit halves so nothing overflows int64. The Triton kernel computes the same words with uint32 arithmetic.
"""
from __future__ import annotations

import torch

DRAW, ACCEPT, RECOVER = 0, 1, 2
_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57     # Philox multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85     # Weyl key increments
ROUNDS = 10
UNIFORM_BITS = 23                     # (b + 0.5) / 2^23 is exact in fp32 and lies in [2^-24, 1 - 2^-24]


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a·m >> 32, a·m mod 2^32) for 0 <= a < 2^32."""
    low = a * (m & 0xFFFF)                       # < 2^48
    high = a * (m >> 16)                         # < 2^48; a·m = high·2^16 + low
    hi = (high + (low >> 16)) >> 16
    lo = (((high & 0xFFFF) << 16) + low) & _MASK32
    return hi, lo


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
               k0: torch.Tensor, k1: torch.Tensor, rounds: int = ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32 on broadcastable int64 tensors holding 32-bit words; returns the four output words."""
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor,
                index: torch.Tensor) -> torch.Tensor:
    """32 random bits per (seed, position, stream, index). seeds, positions: [R] int64 (seeds < 2^63,
    positions < 2^32); stream: int or [R]; index: [R, N] or [N] int64 (< 2^32) → [R, N] int64."""
    seeds, positions = seeds.long(), positions.long()
    k0, k1 = (seeds & _MASK32)[:, None], (seeds >> 32)[:, None]
    stream = torch.as_tensor(stream, dtype=torch.long, device=seeds.device)
    stream = stream[:, None] if stream.dim() else stream
    index = index.long()
    if index.dim() == 1:
        index = index[None, :]
    zero = torch.zeros((), dtype=torch.long, device=seeds.device)
    return philox4x32(index, positions[:, None], stream, zero, k0, k1)[0]


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit words → fp32 uniforms strictly inside (0, 1) by construction: the top 23 bits b give
    (b + 0.5) / 2^23, exactly representable, never 0 and never 1 (fp32 would round (2^32 − 1) / 2^32 to 1)."""
    return ((bits >> (32 - UNIFORM_BITS)).float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int | torch.Tensor,
             index: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1): [R] seeds / positions, [R, N] or [N] index → [R, N] float32."""
    return bits_to_uniform(random_bits(seeds, positions, stream, index))
