"""Prompt-lookup drafter: find the most recent earlier occurrence of the context's last n tokens and propose
what followed it (longest n first). Needs no model and no hidden states."""
from __future__ import annotations

from specdec.drafting import DraftBatch, DraftOutput, ModelFacts


class NgramDrafter:
    kind = "ngram"
    needs_hidden = False
    facts = ModelFacts()  # no model: proposes tokens it has seen in the sequence itself

    def __init__(self, max_drafts: int, max_ngram: int = 4, min_ngram: int = 1):
        self.max_drafts, self.max_ngram, self.min_ngram = max_drafts, max_ngram, min_ngram
        self.contexts: dict[int, list[int]] = {}

    def propose(self, batch: DraftBatch) -> DraftOutput:
        drafts = []
        for s in batch.seqs:
            context = self.contexts.setdefault(s.seq_id, [])
            del context[s.start_pos:]  # a replayed or restarted sequence overwrites what it sent before
            context.extend(s.token_ids)
            drafts.append(self.lookup(context, min(s.num_drafts, self.max_drafts)))
        return DraftOutput(drafts=drafts)

    def lookup(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # most recent match first
                if context[start:start + n] == tail:
                    return context[start + n:start + n + k]
        return []

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.contexts.pop(i, None)

    def clear(self) -> None:
        self.contexts.clear()
