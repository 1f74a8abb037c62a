"""An example specdec drafter plugin (see docs/drafters.md in specdec).

Bigram drafter: for every sequence it remembers, for each token, the token that most recently followed it,
and proposes the chain  last -> next(last) -> next(next(last)) ...  Needs no model and no hidden states.
It shows what every drafter handles: the one-token overlap between steps, a sequence restarted at
position 0, release() and clear().
"""
from __future__ import annotations

from specdec.drafting import DraftBatch, DrafterOptions, DraftOutput, ModelFacts


class BigramDrafter:
    kind = "bigram"
    needs_hidden = False
    facts = ModelFacts()  # no model of its own: it only proposes ids it has been sent

    def __init__(self, max_drafts: int):
        self.max_drafts = max_drafts
        self.contexts: dict[int, list[int]] = {}            # seq id -> committed tokens
        self.successors: dict[int, dict[int, int]] = {}     # seq id -> token -> the token that last followed it

    def propose(self, batch: DraftBatch) -> DraftOutput:
        drafts = []
        for s in batch.seqs:
            context = self.contexts.setdefault(s.seq_id, [])
            if s.start_pos < len(context):   # the overlap token, or a sequence restarted from position 0
                del context[s.start_pos:]
                if s.start_pos == 0:
                    self.successors.pop(s.seq_id, None)
            context.extend(s.token_ids)
            table = self.successors.setdefault(s.seq_id, {})
            start = max(1, s.start_pos)
            table.update(zip(context[start - 1:-1], context[start:]))
            drafts.append(self._chain(table, context[-1], min(s.num_drafts, self.max_drafts)))
        return DraftOutput(drafts=drafts)

    @staticmethod
    def _chain(table: dict[int, int], token: int, k: int) -> list[int]:
        out = []
        while len(out) < k and token in table:
            token = table[token]
            out.append(token)
        return out

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.contexts.pop(i, None)
            self.successors.pop(i, None)

    def clear(self) -> None:
        self.contexts.clear()
        self.successors.clear()


def build(options: DrafterOptions) -> BigramDrafter:
    """The entry point: `specdec drafter --kind bigram [-k 3]`."""
    return BigramDrafter(options.max_drafts)
