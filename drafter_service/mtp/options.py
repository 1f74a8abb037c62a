"""How an MTP drafter runs: its batch and context bounds, CUDA graphs, and an optional reduced vocabulary."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MTPOptions:
    max_seqs: int = 64                   # sequences drafted together in one CUDA graph (more run eagerly)
    max_context: int = 4096              # longest sequence it drafts for (block-table width); longer: no drafts
    enforce_eager: bool = False          # no CUDA graphs
    draft_vocab: tuple[int, ...] | None = None  # target ids it may propose (a hot subset); None: all
