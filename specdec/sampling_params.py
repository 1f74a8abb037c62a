"""Per-request sampling parameters, validated once where the request enters."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0                # 1: off
    top_k: int = 0                    # 0: off
    seed: int | None = None           # None: a fresh seed per request
    stop: tuple[str, ...] = ()        # stop strings (the gateway applies them to text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise ValueError naming the bad field."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
        return self
