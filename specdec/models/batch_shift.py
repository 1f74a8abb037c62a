"""Moving a staged batch's sequences forward, on the device, by counts the host has not read yet.

A step launched before the last one's verdict is read (verifier_service/in_flight.py) is staged with each
sequence where the host last knew it. How many drafts each sequence accepted in the unread step, `shift[b]`,
is only on the device. Token t of sequence b then sits at positions[t] + shift[b], its KV row follows from its
block table, its GDN state replays shift[b] accepted drafts and its conv window starts from column shift[b]:

    positions[t]         += shift[b]                                    b = seq_of_token[t], t < num_tokens
    slot_mapping[t]       = block_tables[b, positions[t] // bs] * bs + positions[t] % bs
    gdn_read_offsets[b]  += shift[b]

The host reserved KV blocks for the largest possible shift, so every shifted position lands in a block the
sequence owns. Padding tokens and sequences (past num_tokens / num_seqs) are left as staged.
"""
from __future__ import annotations

import torch

from .forward_batch import ForwardBatch


def shift_batch(batch: ForwardBatch, shift: torch.Tensor, num_tokens: int, num_seqs: int, block_size: int) -> None:
    """shift [num_seqs] int64 on the batch's device (0 for sequences the host knows). In place, no sync."""
    seq = batch.seq_of_token[:num_tokens]                                               # [T]
    batch.positions[:num_tokens] += shift[seq]
    place_slots(batch, num_tokens, block_size)
    batch.gdn_read_offsets[:num_seqs] += shift.to(batch.gdn_read_offsets.dtype)


def place_slots(batch: ForwardBatch, num_tokens: int, block_size: int) -> None:
    """slot_mapping[:num_tokens] from the batch's positions and block tables (after positions moved)."""
    seq = batch.seq_of_token[:num_tokens]                                               # [T]
    pos = batch.positions[:num_tokens]                                                  # [T]
    blocks = batch.block_tables[seq, pos // block_size]                                 # [T] int32
    batch.slot_mapping[:num_tokens] = blocks.to(torch.int64) * block_size + pos % block_size
