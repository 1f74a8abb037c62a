"""One model step over a ragged batch: flat tokens + cu_seqlens, plus where each sequence's cache lives."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor       # [T] token ids, sequences back to back
    positions: torch.Tensor       # [T] absolute position of each token in its sequence
    cu_seqlens: torch.Tensor      # [B + 1] int32 token offsets of each sequence in the flat batch
    context_lens: list[int]       # [B] tokens in the KV cache after this step (last position + 1)
    block_tables: torch.Tensor    # [B, max_blocks] int32 KV block ids per sequence
    slot_mapping: torch.Tensor    # [T] flat KV row (block * block_size + offset) each token writes
    gdn_slots: list[int]          # [B] GDN state group of each sequence
    gdn_read_offsets: list[int]   # [B] state slot / conv column to start from (accepted drafts of last step)
    num_drafts: list[int]         # [B] trailing draft tokens in this step (their states are all kept)
    logits_indices: torch.Tensor  # [N] flat token indices whose logits are wanted
    max_seqlen: int = 0           # longest sequence of this step (host int)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @staticmethod
    def build(token_chunks: list[list[int]], start_positions: list[int], block_tables: list[list[int]],
              block_size: int, gdn_slots: list[int], gdn_read_offsets: list[int] | None = None,
              num_drafts: list[int] | None = None, logits: str | list[int] = "last",
              device: torch.device | str = "cpu") -> "ForwardBatch":
        """Assemble a batch on the host. `logits`: "last" (one row per sequence), "all" (every token), or per
        sequence the number of trailing tokens whose logits are wanted."""
        num_seqs = len(token_chunks)
        if logits == "last":
            logits = [1 if c else 0 for c in token_chunks]
        elif logits == "all":
            logits = [len(c) for c in token_chunks]
        cu, ids, pos, slot_map, logit_rows = [0], [], [], [], []
        for chunk, start, table, wanted in zip(token_chunks, start_positions, block_tables, logits):
            for i, tok in enumerate(chunk):
                p = start + i
                ids.append(tok)
                pos.append(p)
                slot_map.append(table[p // block_size] * block_size + p % block_size)
            logit_rows.extend(range(cu[-1] + len(chunk) - wanted, cu[-1] + len(chunk)))
            cu.append(cu[-1] + len(chunk))
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return ForwardBatch(
            input_ids=as_long(ids), positions=as_long(pos),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=[s + len(c) for s, c in zip(start_positions, token_chunks)],
            block_tables=tables.to(device), slot_mapping=as_long(slot_map),
            gdn_slots=list(gdn_slots), gdn_read_offsets=list(gdn_read_offsets or [0] * num_seqs),
            num_drafts=list(num_drafts or [0] * num_seqs), logits_indices=as_long(logit_rows),
            max_seqlen=max((len(c) for c in token_chunks), default=0))
