"""Benchmark drafter: proposes a recorded plain-decoding continuation of the same request, corrupting each
proposed token with probability 1 − a, where a is chosen so that the expected tokens per verify step,
Σ_{i=0..k} a^i = (1 − a^{k+1}) / (1 − a), equals the requested mean acceptance length (greedy requests).
Verification stays real: the target still checks every token. Where no reference covers a context (or past its
end) it still proposes as many drafts as asked, random tokens the target rejects, so that every verify step has
the shape (and the cost) of k drafts."""
from __future__ import annotations

import random

from specdec.drafting import DraftBatch, DraftOutput, ModelFacts


class SyntheticDrafter:
    kind = "synthetic"
    needs_hidden = False

    def __init__(self, references: list[list[int]], max_drafts: int, vocab_size: int,
                 accept_rate: float = 1.0, seed: int = 0):
        """references: full token sequences (prompt + recorded continuation) this drafter may be asked about."""
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        self.references = [list(r) for r in references]
        self.max_drafts, self.vocab_size, self.accept_rate, self.seed = max_drafts, vocab_size, accept_rate, seed
        self.facts = ModelFacts(vocab_size=vocab_size)  # corrupted tokens are drawn from [0, vocab_size)
        self.contexts: dict[int, list[int]] = {}
        self.rngs: dict[int, random.Random] = {}
        self.bound: dict[int, list[int]] = {}  # the reference each sequence is following

    def reference_for(self, context: list[int]) -> list[int] | None:
        matches = [r for r in self.references if r[:len(context)] == context]
        return max(matches, key=len) if matches else None

    def propose(self, batch: DraftBatch) -> DraftOutput:
        drafts = []
        for s in batch.seqs:
            context = self.contexts.setdefault(s.seq_id, [])
            del context[s.start_pos:]
            context.extend(s.token_ids)
            rng = self.rngs.setdefault(s.seq_id, random.Random(self.seed * 1_000_003 + s.seq_id))
            reference = self.bound.get(s.seq_id)
            if reference is None or reference[s.start_pos:len(context)] != s.token_ids:  # only new tokens checked
                reference = self.bound[s.seq_id] = self.reference_for(context) or []
            want = min(s.num_drafts, self.max_drafts)
            upcoming = reference[len(context):len(context) + want]
            drafts.append([t if rng.random() < self.accept_rate else self.corrupt(t, rng) for t in upcoming]
                          + [rng.randrange(self.vocab_size) for _ in range(want - len(upcoming))])
        return DraftOutput(drafts=drafts)

    def corrupt(self, token: int, rng: random.Random) -> int:
        return (token + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.contexts.pop(i, None)
            self.rngs.pop(i, None)
            self.bound.pop(i, None)

    def clear(self) -> None:
        self.contexts.clear()
        self.rngs.clear()
        self.bound.clear()
