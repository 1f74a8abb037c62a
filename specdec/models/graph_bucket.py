"""The static shape of one CUDA graph's step (`cuda_graph_runner.py`), and what `BatchStaging` pads a batch to.

Every field is a host int the kernels' grids and the step's tensor shapes are built from, so a batch staged to a
bucket replays the graph captured for it whatever its real lengths, as long as it fits: at most `seqs` sequences,
`tokens` tokens in all, `max_seqlen` tokens in any one sequence, `logit_rows` logit rows and `max_drafts` drafts
in any one sequence. `max_replays` bounds the accepted drafts of the last step a sequence replays into its GDN state
(None: as many as the ring holds); the recurrent GDN kernel picks its launch config by it, so an engine with a
drafter keeps a second graph of the single-token buckets where that changes the config, for steps where no
sequence replays. `min_context` bounds from below the keys every sequence has before its first token (the paged
attention picks wider query tiles by it): a prefill bucket has a second graph for chunks deep into their prompt.
"""
from __future__ import annotations

from typing import NamedTuple


class Bucket(NamedTuple):
    seqs: int
    max_seqlen: int
    tokens: int
    logit_rows: int
    max_drafts: int
    max_replays: int | None = None
    min_context: int = 0

    @staticmethod
    def uniform(seqs: int, tokens_per_seq: int, max_replays: int | None = None) -> "Bucket":
        """Decode / verify: up to tokens_per_seq tokens per sequence (the last token and its drafts), every
        token may be a logit row."""
        tokens = seqs * tokens_per_seq
        return Bucket(seqs, tokens_per_seq, tokens, tokens, tokens_per_seq - 1, max_replays)

    @staticmethod
    def prefill(tokens: int, min_context: int = 0) -> "Bucket":
        """One prompt chunk alone: up to `tokens` tokens, one logit row, no drafts, at least `min_context` tokens
        before it."""
        return Bucket(1, tokens, tokens, 1, 0, min_context=min_context)

    @staticmethod
    def mixed(seqs: int, tokens: int, max_seqlen: int, max_drafts: int) -> "Bucket":
        """Prompt chunks beside decoding sequences, or several prompts at once: `tokens` in all, chunks of up to
        max_seqlen, at most max_drafts + 1 logit rows per sequence (a verify step's; a chunk wants one or none)."""
        return Bucket(seqs, max_seqlen, tokens, seqs * (max_drafts + 1), max_drafts)

    def holds(self, num_seqs: int, num_tokens: int, longest: int, logit_rows: int, most_drafts: int,
              most_replays: int = 0, least_context: int | None = None) -> bool:
        """least_context: the fewest tokens any sequence has before this step's (None: no sequences)."""
        return (num_seqs <= self.seqs and num_tokens <= self.tokens and longest <= self.max_seqlen
                and logit_rows <= self.logit_rows and most_drafts <= self.max_drafts
                and (self.max_replays is None or most_replays <= self.max_replays)
                and (least_context is None or least_context >= self.min_context))
