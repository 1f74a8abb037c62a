"""ForwardBatch / BatchStaging: the vectorised build against a per-token spec, bucket padding, fixed addresses
across steps, errors that name the field, and (GPU) the pinned double buffer under back-to-back steps."""
import numpy as np
import pytest
import torch

from specdec.models.batch_staging import BatchStaging, StepPlan
from specdec.models.forward_batch import CHUNK_LANE_MIN_TOKENS, CHUNK_LANES, ForwardBatch
from specdec.models.graph_bucket import Bucket

BLOCK = 4


def random_step(seed, num_seqs=5, max_len=7):
    g = np.random.default_rng(seed)
    lens = g.integers(1, max_len, num_seqs).tolist()
    starts = g.integers(0, 20, num_seqs).tolist()
    chunks = [g.integers(0, 1000, n).tolist() for n in lens]
    tables = [g.permutation(100)[: (s + n + BLOCK - 1) // BLOCK + int(g.integers(0, 3))].tolist()
              for s, n in zip(starts, lens)]
    drafts = [int(g.integers(0, n)) for n in lens]
    logits = [int(g.integers(0, n + 1)) for n in lens]
    return chunks, starts, tables, drafts, logits


def spec(chunks, starts, tables, logits):
    """Per token, the obvious way."""
    ids, pos, slots, rows, cu = [], [], [], [], [0]
    for chunk, start, table, wanted in zip(chunks, starts, tables, logits):
        for i, tok in enumerate(chunk):
            p = start + i
            ids.append(tok)
            pos.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
        rows += list(range(cu[-1] + len(chunk) - wanted, cu[-1] + len(chunk)))
        cu.append(cu[-1] + len(chunk))
    return ids, pos, slots, rows, cu


@pytest.mark.parametrize("seed", range(4))
def test_build_matches_per_token_spec(seed):
    chunks, starts, tables, drafts, logits = random_step(seed)
    gdn, offsets = list(range(10, 10 + len(chunks))), [d % 2 for d in drafts]
    batch = ForwardBatch.build(chunks, starts, tables, BLOCK, gdn, offsets, drafts, logits)
    ids, pos, slots, rows, cu = spec(chunks, starts, tables, logits)
    assert batch.input_ids.tolist() == ids and batch.positions.tolist() == pos
    assert batch.slot_mapping.tolist() == slots and batch.logits_indices.tolist() == rows
    assert batch.cu_seqlens.tolist() == cu
    assert batch.gdn_slots.tolist() == gdn and batch.gdn_read_offsets.tolist() == offsets
    assert batch.num_drafts.tolist() == drafts
    width = max(map(len, tables))
    assert batch.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert (batch.num_seqs, batch.num_tokens, batch.max_seqlen) == (len(chunks), len(ids), max(map(len, chunks)))
    assert batch.max_num_drafts == max(drafts)
    dtypes = {n: getattr(batch, n).dtype for n in ("input_ids", "positions", "slot_mapping", "logits_indices")}
    assert set(dtypes.values()) == {torch.int64}
    assert {getattr(batch, n).dtype for n in ("cu_seqlens", "block_tables", "gdn_slots", "gdn_read_offsets",
                                              "num_drafts")} == {torch.int32}


def test_logits_modes():
    chunks, starts, tables = [[1, 2, 3], [4]], [0, 5], [[0], [1, 2]]
    assert ForwardBatch.build(chunks, starts, tables, BLOCK, [0, 1]).logits_indices.tolist() == [2, 3]
    assert ForwardBatch.build(chunks, starts, tables, BLOCK, [0, 1], logits="all").logits_indices.tolist() == \
        [0, 1, 2, 3]


def test_bucket_padding_and_fixed_addresses():
    staging = BatchStaging(max_tokens=32, max_seqs=8, max_blocks=6, block_size=BLOCK, scratch_block=99,
                           scratch_gdn_slot=7)
    chunks, starts, tables = [[5, 6], [7], [8, 9, 10]], [3, 0, 9], [[4, 5], [6], [1, 2, 3]]
    plan = StepPlan.from_lists(chunks, starts, tables, [0, 1, 2], [1, 0, 2], [1, 0, 2], [2, 1, 3])
    batch = staging.stage(plan, bucket=Bucket.uniform(4, 4))
    assert (batch.num_seqs, batch.num_tokens, batch.max_seqlen, batch.max_num_drafts) == (4, 16, 4, 3)
    assert batch.cu_seqlens.tolist() == [0, 2, 3, 6, 6]                       # padding sequence: length 0
    assert batch.gdn_slots.tolist() == [0, 1, 2, 7] and batch.num_drafts.tolist()[3] == 0
    assert batch.slot_mapping.tolist()[6:] == [99 * BLOCK] * 10               # padding tokens: scratch row
    assert batch.input_ids.tolist()[6:] == [0] * 10 and batch.positions.tolist()[6:] == [0] * 10
    assert batch.logits_indices.tolist() == [0, 1, 2, 3, 4, 5] + [0] * 10
    assert batch.block_tables.shape == (4, 6)                                  # the graph's fixed tensor
    assert batch.block_tables[:, :3].tolist() == [[4, 5, 0], [6, 0, 0], [1, 2, 3], [99, 99, 99]]  # the step's width
    again = staging.stage(StepPlan.from_lists([[1]], [0], [[3]], [5]), bucket=Bucket.uniform(4, 4))
    for name in ("input_ids", "cu_seqlens", "slot_mapping", "block_tables", "gdn_slots", "logits_indices"):
        assert getattr(again, name).data_ptr() == getattr(batch, name).data_ptr(), name
    assert again.cu_seqlens.tolist() == [0, 1, 1, 1, 1] and again.gdn_slots.tolist() == [5, 7, 7, 7]


def test_a_mixed_bucket_pads_tokens_and_logit_rows_apart():
    """A prompt chunk beside a verify step in a mixed bucket: tokens padded to the bucket's total, logit rows to
    k + 1 per sequence, max_seqlen the bucket's chunk limit; a step past any of its bounds is refused."""
    staging = BatchStaging(max_tokens=64, max_seqs=8, max_blocks=6, block_size=BLOCK, scratch_block=99)
    chunks, starts, tables = [[5, 6, 7, 8, 9, 10], [7, 1]], [0, 9], [[0, 1], [2, 3, 4]]
    plan = StepPlan.from_lists(chunks, starts, tables, [0, 1], None, [0, 1], [1, 2])
    bucket = Bucket.mixed(4, 32, 16, 3)
    batch = staging.stage(plan, bucket=bucket)
    assert (batch.num_seqs, batch.num_tokens, batch.max_seqlen, batch.max_num_drafts) == (4, 32, 16, 3)
    assert batch.logits_indices.tolist() == [5, 6, 7] + [0] * 13
    assert batch.cu_seqlens.tolist() == [0, 6, 8, 8, 8] and batch.slot_mapping.tolist()[8:] == [99 * BLOCK] * 24
    too_big = [([[1] * 17, [2]], [0, 0], [1, 1]),                        # a chunk past 16 tokens
               ([[1] * 5, [2]], [4, 0], [5, 1]),                          # 4 drafts past 3
               ([[1] * 16, [2] * 16, [3]], [0, 0, 0], [1, 1, 1]),         # 33 tokens past 32
               ([[1]] * 5, [0] * 5, [1] * 5),                             # 5 sequences past 4
               ([[1] * 16, [2] * 4], [0, 3], [14, 4])]                    # 18 logit rows past 16
    for chunks_, drafts, logits in too_big:
        n = len(chunks_)
        with pytest.raises(ValueError, match="does not fit"):
            staging.stage(StepPlan.from_lists(chunks_, [0] * n, [[0, 1, 2, 3, 4]] * n, list(range(n)), None, drafts,
                                              logits), bucket=bucket)


def test_chunk_lanes_name_the_longest_prompt_chunks_that_can_run_chunked():
    """A mixed step's chunk lanes (forward_batch.py): the longest chunks of at least CHUNK_LANE_MIN_TOKENS tokens
    with no drafts and nothing to replay, as (sequence, first row, end row, GDN slot); unused lanes point at the
    scratch slot. A mixed bucket always carries them (a graph's static choice); eager steps, decode and prefill
    buckets never."""
    n = CHUNK_LANE_MIN_TOKENS
    staging = BatchStaging(max_tokens=8 * n, max_seqs=8, max_blocks=64, block_size=BLOCK, scratch_gdn_slot=7)
    # a decoder with drafts, a chunk that replays drafts, a short chunk, two long chunks
    lens = [4, n + 5, n - 1, n, n + 2]
    chunks = [[1] * length for length in lens]
    tables = [list(range(64))] * len(lens)
    plan = StepPlan.from_lists(chunks, [0] * len(lens), tables, [3, 4, 5, 6, 2], [0, 2, 0, 0, 0], [3, 0, 0, 0, 0])
    starts = np.cumsum([0] + lens)
    want = [[4, starts[4], starts[5], 2], [3, starts[3], starts[4], 6]][:CHUNK_LANES]
    want += [[-1, 0, 0, 7]] * (CHUNK_LANES - len(want))
    mixed = Bucket.mixed(8, 8 * n, 2 * n, 3)
    assert staging.stage(plan, bucket=mixed).chunk_lanes.tolist() == want
    assert staging.stage(plan).chunk_lanes is None                                 # eager
    decoders = StepPlan.from_lists([[1] * 4, [2]], [0, 0], [[0], [1]], [0, 1], None, [3, 0])
    batch = staging.stage(decoders, bucket=mixed)                                  # a graph's static choice
    assert batch.chunk_lanes.tolist() == [[-1, 0, 0, 7]] * CHUNK_LANES
    assert staging.stage(decoders, bucket=Bucket.uniform(2, 4)).chunk_lanes is None
    alone = StepPlan.from_lists([[1] * 2 * n], [0], [list(range(64))], [0])
    assert staging.stage(alone, bucket=Bucket.prefill(2 * n)).chunk_lanes is None
    # min_context: a bucket's bound in a graph; 0 eagerly (the tiles the warm-ups compile)
    deep = StepPlan.from_lists([[1] * 8, [2]], [40, 56], [list(range(16)), list(range(16, 32))], [0, 1])
    assert staging.stage(deep).min_context == 0
    assert staging.stage(deep, bucket=mixed).min_context == 0
    deep_alone = StepPlan.from_lists([[1] * 8], [40], [list(range(16))], [0])
    assert staging.stage(deep_alone, bucket=Bucket.prefill(32, 40)).min_context == 40
    with pytest.raises(ValueError, match="does not fit"):
        staging.stage(deep_alone, bucket=Bucket.prefill(32, 41))


@pytest.mark.parametrize("bad, message", [
    (dict(logits=[3, 1]), r"logits\[0\] = 3"),
    (dict(num_drafts=[0, 1]), r"num_drafts\[1\] = 1"),
    (dict(gdn_slots=[0]), "gdn_slots: expected 2 values"),
    (dict(tables=[[0], [1]]), r"block_tables\[1\] has 1 blocks"),
])
def test_errors_name_the_field(bad, message):
    args = dict(chunks=[[1, 2], [3]], starts=[0, 4], tables=[[0], [1, 2]], gdn_slots=[0, 1], num_drafts=None,
                logits="last") | bad
    with pytest.raises(ValueError, match=message):
        ForwardBatch.build(args["chunks"], args["starts"], args["tables"], BLOCK, args["gdn_slots"],
                           num_drafts=args["num_drafts"], logits=args["logits"])


def test_capacity_error():
    staging = BatchStaging(max_tokens=4, max_seqs=2, max_blocks=2, block_size=BLOCK)
    with pytest.raises(ValueError, match="5 tokens, the staging area holds 4"):
        staging.stage(StepPlan.from_lists([[1, 2, 3, 4, 5]], [0], [[0, 1]], [0]))


@pytest.mark.gpu
def test_gpu_back_to_back_steps_keep_their_inputs():
    """Steps staged without waiting: each step's device batch (read by a kernel enqueued right after) holds
    its own values, though the two pinned host buffers are reused every other step."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    staging = BatchStaging(max_tokens=64, max_seqs=8, max_blocks=8, block_size=BLOCK, device="cuda")
    assert staging.host[0].is_pinned()
    seen, expected = [], []
    for seed in range(50):
        chunks, starts, tables, drafts, logits = random_step(seed, max_len=5)
        batch = staging.stage(StepPlan.from_lists(chunks, starts, tables, list(range(len(chunks))), None, drafts,
                                                  logits))
        torch.cuda._sleep(1_000_000)                    # keep the GPU behind the host (~1 ms)
        seen.append((batch.input_ids.clone(), batch.slot_mapping.clone(), batch.cu_seqlens.clone()))
        ids, _, slots, _, cu = spec(chunks, starts, tables, logits)
        expected.append((ids, slots, cu))
    torch.cuda.synchronize()
    for (ids, slots, cu), (want_ids, want_slots, want_cu) in zip(seen, expected):
        assert ids.tolist() == want_ids and slots.tolist() == want_slots and cu.tolist() == want_cu


def test_concat_ranges_lists_each_segment_in_order():
    from specdec.models.batch_staging import concat_ranges
    assert concat_ranges([4, 0, 9], [2, 0, 3]).tolist() == [4, 5, 9, 10, 11]
    assert concat_ranges([], []).tolist() == []
