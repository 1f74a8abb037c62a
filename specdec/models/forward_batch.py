"""One model step over a ragged batch, resident on the model's device: flat tokens + cu_seqlens, plus where each
sequence's cache lives.

The tensors are views into one int32 device buffer that `BatchStaging` fills from pinned host memory with a
single non-blocking copy per step; the host ints are known when the batch is built and never read back from
the device. A batch stays valid until its staging area stages the next one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


# A step that mixes prompt chunks with decoding sequences in a mixed bucket's CUDA graph names up to CHUNK_LANES of
# its prompt chunks, the longest first, in `chunk_lanes`: one row (sequence, first row, end row, GDN slot) each; an
# unused lane is (-1, 0, 0, the scratch slot). GDN runs those through the chunked kernel and every other sequence
# through the recurrent one, which walks a sequence's tokens one by one (a 1024-token chunk beside 15 decoders made
# the whole step wait on that walk). A lane takes a chunk of at least CHUNK_LANE_MIN_TOKENS tokens with no drafts
# and nothing to replay: its state is state[slot] as it stands. The graph runs the lane's call whether a chunk
# qualifies or not (its shape is static). Eager steps have none: fla-core's call costs milliseconds of host time
# a layer there, and a step past the buckets with long chunks and no drafts runs them all chunked anyway.
CHUNK_LANES = 1
CHUNK_LANE_MIN_TOKENS = 64


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor         # [T] int64 token ids, sequences back to back
    positions: torch.Tensor         # [T] int64 absolute position of each token in its sequence
    cu_seqlens: torch.Tensor        # [B + 1] int32 token offsets of each sequence in the flat batch
    block_tables: torch.Tensor      # [B, W] int32 padded KV block ids
    slot_mapping: torch.Tensor      # [T] int64 flat KV row (block * block_size + offset); padding → a scratch row
    gdn_slots: torch.Tensor         # [B] int32 GDN state group of each sequence
    gdn_read_offsets: torch.Tensor  # [B] int32 accepted drafts of the last step: GDN replays them, conv column
    num_drafts: torch.Tensor        # [B] int32 trailing draft tokens in this step (stashed for the next one)
    logits_indices: torch.Tensor    # [N] int64 flat token indices whose logits are wanted
    num_seqs: int                   # B, padding sequences included
    num_tokens: int                 # T, padding tokens included
    max_seqlen: int                 # longest sequence in tokens (a graph bucket's static value when padded)
    max_num_drafts: int = 0         # largest num_drafts (0: no per-draft states, prefill may run chunked)
    max_replays: int | None = None  # most accepted drafts a sequence replays into its GDN state: eager steps the
    # host's read offsets plus what the device adds (an unread verdict), graph steps the bucket's bound; None: up to
    # what the GDN ring holds
    cu_seqlens_host: np.ndarray | None = None  # [B + 1] cu_seqlens on the host (eager steps; None in graphs)
    seq_of_token: torch.Tensor | None = None   # [T] int64 each token's sequence (0 for padding); staged batches
    chunk_lanes: torch.Tensor | None = None    # [CHUNK_LANES, 4] int32 prompt chunks GDN runs chunked (see above)
    min_context: int = 0            # tokens every sequence has before its first one here: a deep prefill graph's
    # bound (cuda_graph_runner.py), else 0. It picks the attention's query tiles, never a result; eager steps keep 0,
    # whose tiles the warm-ups compile (the deep graphs compile theirs when captured)

    @staticmethod
    def build(token_chunks: list[list[int]], start_positions: list[int], block_tables: list[list[int]],
              block_size: int, gdn_slots: list[int], gdn_read_offsets: list[int] | None = None,
              num_drafts: list[int] | None = None, logits: str | list[int] = "last",
              device: torch.device | str = "cpu") -> "ForwardBatch":
        """One-off batch from host lists (a fresh staging area sized to it). `logits`: "last" (one row per
        non-empty sequence), "all" (every token), or per sequence the number of trailing tokens whose logits
        are wanted. Steps in a loop should reuse a `BatchStaging` instead."""
        from .batch_staging import BatchStaging, StepPlan
        plan = StepPlan.from_lists(token_chunks, start_positions, block_tables, gdn_slots, gdn_read_offsets,
                                   num_drafts, logits)
        width = max(1, plan.block_tables.shape[1])
        staging = BatchStaging(max(1, plan.num_tokens), max(1, plan.num_seqs), width, block_size, device)
        return staging.stage(plan)


def as_array(values, name: str, length: int | None = None, dtype=np.int64) -> np.ndarray:
    """A 1-D host array from a list or array, with an error naming the field when its length is wrong."""
    array = np.asarray(values, dtype=dtype)
    if array.ndim != 1 or (length is not None and array.shape[0] != length):
        raise ValueError(f"{name}: expected {length} values (one per sequence), got shape {array.shape}")
    return array
