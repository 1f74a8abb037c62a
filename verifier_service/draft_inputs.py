"""What the drafter is told of a step's entries: on the device, a DeviceDraftStep built from the unread verdict
(`chained_draft_step`, for a drafter that drafts there); on either path, the prefix blocks of a resumed or
checkpointed entry (`prefix_blocks`)."""
from __future__ import annotations

import numpy as np
import torch

from specdec.drafting import DeviceDraftStep, PrefixBlocks
from specdec.models.batch_staging import concat_ranges
from specdec.models.forward_batch import ForwardBatch
from specdec.models.pinned_upload import PinnedUpload

from .scheduler import ScheduledSeq


def prefix_blocks(p: ScheduledSeq, block_size: int) -> list[PrefixBlocks]:
    """What the drafter is told of an entry's prefix caching: [] or one PrefixBlocks."""
    if not (p.resumed or p.checkpoint):
        return []
    return [PrefixBlocks(p.seq.seq_id, p.seq.block_hashes[:max(p.resumed, p.checkpoint)], block_size, p.resumed,
                         p.checkpoint)]


def chained_draft_step(step: int, plan: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor,
                       emitted: torch.Tensor | None, accepted: torch.Tensor | None, max_drafts: int,
                       upload: PinnedUpload, block_size: int = 16
                       ) -> tuple[DeviceDraftStep, list[int], torch.Tensor]:
    """What an on-device drafter gets for this step: the committed rows of every entry whose sequence is in the
    drafter (its chunk less the drafts it did not accept; gathered when some entries stay out) and the token after
    them (`emitted` [S] by the verdict, or the next prompt token); it is asked for `max_drafts` drafts for each
    sampled one. Also returns each sampled entry's place in that step (-1: out of the drafter), on the host and,
    [S], on the device (0 there for those out). At least one entry must be in the drafter."""
    b = len(plan)
    sampled = np.fromiter((i for i, p in enumerate(plan) if p.samples), np.int64)
    members = np.fromiter((i for i, p in enumerate(plan) if p.seq.in_drafter), np.int64)
    chunk_lens = np.fromiter((len(p.chunk) for p in plan), np.int64, count=b)
    base = chunk_lens - np.fromiter((p.num_drafts for p in plan), np.int64, count=b)   # committed before drafts
    following = np.fromiter((_next_prompt_token(p) for p in plan), np.int64, count=b)
    place = np.full(b, -1, np.int64)
    place[members] = np.arange(members.size)
    places = place[sampled]                                                            # [S]
    subset = members.size < b
    rows = concat_ranges((np.cumsum(chunk_lens) - chunk_lens)[members], chunk_lens[members]) if subset else None
    parts = [base, following, sampled, np.maximum(places, 0)] + ([members, rows] if subset else [])
    base_dev, next_dev, sampled_dev, places_dev, *picked = torch.tensor_split(
        upload(np.concatenate(parts)), np.cumsum([len(a) for a in parts[:-1]]).tolist())
    committed = base_dev if accepted is None else base_dev.index_add(0, sampled_dev, accepted)
    next_token = next_dev if emitted is None else next_dev.index_copy(0, sampled_dev, emitted)
    input_ids, positions = batch.input_ids, batch.positions
    if subset:   # only the drafter's sequences: their rows, committed counts and next tokens
        members_dev, rows_dev = picked
        input_ids, positions, hidden = input_ids[rows_dev], positions[rows_dev], hidden[rows_dev]
        committed, next_token = committed[members_dev], next_token[members_dev]
    kept = [plan[i] for i in members]
    wanted = np.array([max_drafts if p.samples else 0 for p in kept], np.int64)
    return DeviceDraftStep(
        step=step, seq_ids=[p.seq.seq_id for p in kept],
        start_pos=np.fromiter((p.seq.num_cached for p in kept), np.int64, count=len(kept)),
        max_shift=np.fromiter((p.seq.unread_accepts for p in kept), np.int64, count=len(kept)),
        chunk_lens=chunk_lens[members], num_drafts=wanted, input_ids=input_ids, positions=positions,
        hidden=hidden, committed=committed, next_token=next_token,
        prefixes=[blocks for p in kept for blocks in prefix_blocks(p, block_size)]), places.tolist(), places_dev


def _next_prompt_token(p: ScheduledSeq) -> int:
    """The token after a prefill chunk that does not sample (the prompt goes on); 0 where the verdict decides."""
    if p.samples:
        return 0
    return p.seq.token_ids[p.seq.num_cached + len(p.chunk)]
