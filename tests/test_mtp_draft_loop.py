"""The MTP draft loop on the device: bucket-padded steps (what a CUDA graph replays) draft exactly what unpadded
steps draft, over a whole served workload, and a reduced draft vocabulary drafts the argmax over its ids."""
import copy

import pytest
import torch
from engine_factory import BLOCK, make_engine, random_prompts

from drafter_service.mtp.mtp_drafter import MTPDrafter
from drafter_service.mtp.options import MTPOptions
from specdec.drafting import DraftBatch
from specdec.sampling_params import SamplingParams


class Recorder:
    """Wraps a drafter: keeps a copy of every DraftBatch it is given and every answer."""

    def __init__(self, drafter):
        self.drafter, self.calls = drafter, []
        self.kind, self.needs_hidden, self.max_drafts = drafter.kind, drafter.needs_hidden, drafter.max_drafts
        self.facts, self.release, self.clear = drafter.facts, drafter.release, drafter.clear

    def propose(self, batch):
        out = self.drafter.propose(batch)
        self.calls.append((DraftBatch(batch.step, copy.deepcopy(batch.seqs), batch.hidden.clone()), out.drafts))
        return out


def served_calls(loaded, options=None, k=3):
    """Serve 6 prompts of mixed lengths, 5 running at once, through an MTP drafter; its calls and answers."""
    drafter = Recorder(MTPDrafter(loaded, k, num_blocks=128, block_size=BLOCK, options=options))
    engine = make_engine(loaded, drafter, k, max_running=5)
    prompts = random_prompts([3, 9, 1, 14, 6, 11], loaded.config.vocab_size, seed=4)
    engine.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True))
    assert engine.stats.drafted > 0
    return drafter.calls


def replay(drafter, calls):
    for batch, drafts in calls:
        yield drafter.propose(batch).drafts, drafts


def test_bucket_padded_steps_draft_what_unpadded_steps_draft(tiny_model):
    calls = served_calls(tiny_model)
    padded = MTPDrafter(tiny_model, 3, num_blocks=128, block_size=BLOCK, options=MTPOptions(max_seqs=5))
    padded.loop.use_graphs(capture=False)   # buckets 1, 2, 4, 8 x 4 tokens, replayed eagerly on a CPU
    bucketed = 0
    for got, want in replay(padded, calls):
        assert got == want
        bucketed += max(len(d) for d in want) > 0
    assert bucketed > 5
    assert any(len(batch.seqs) in (3, 5) for batch, _ in calls)  # batches padded to buckets of 4 and 8


def test_a_prompt_alone_drafts_the_same_from_its_prefill_bucket(tiny_model):
    """Requests one at a time (as at batch 1): each prompt's catch-up runs in a prefill bucket (one sequence of up
    to 32 / 64 / ... pairs, padded) and drafts what the unpadded catch-up drafts."""
    drafter = Recorder(MTPDrafter(tiny_model, 3, num_blocks=128, block_size=BLOCK))
    engine = make_engine(tiny_model, drafter, 3, max_running=1, chunk=64)
    prompts = random_prompts([3, 9, 30, 40], tiny_model.config.vocab_size, seed=6)
    engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    padded = MTPDrafter(tiny_model, 3, num_blocks=128, block_size=BLOCK, options=MTPOptions(max_seqs=1))
    padded.loop.use_graphs(capture=False)
    prefill_buckets, run = [], padded.loop.graphs.run

    def spy(plan, bucket, before=None):
        prefill_buckets.append(padded.loop.graphs.is_prefill(bucket))
        return run(plan, bucket, before)
    padded.loop.graphs.run = spy
    for got, want in replay(padded, drafter.calls):
        assert got == want
    assert sum(prefill_buckets) == 3   # the prompts of 9, 30 and 40 tokens (3: a verify bucket)


def test_reduced_vocabulary_drafts_the_argmax_over_its_ids(tiny_model):
    vocab = tiny_model.config.vocab_size
    hot = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 3].sort().values
    calls = served_calls(tiny_model)
    full = MTPDrafter(tiny_model, 3, num_blocks=128, block_size=BLOCK)
    reduced = MTPDrafter(tiny_model, 3, num_blocks=128, block_size=BLOCK,
                         options=MTPOptions(draft_vocab=tuple(hot.tolist())))
    # The full-vocabulary head with the cold rows of lm_head pushed to -inf drafts the same tokens.
    masked = MTPDrafter(tiny_model, 3, num_blocks=128, block_size=BLOCK)
    logits = masked.head.logits
    cold = torch.ones(vocab, dtype=torch.bool)
    cold[hot] = False
    masked.head.logits = lambda out: logits(out).masked_fill(cold, float("-inf"))
    differs = 0
    for batch, _ in calls:
        got, want, unrestricted = reduced.propose(batch).drafts, masked.propose(batch).drafts, full.propose(batch).drafts
        assert got == want
        assert all(t in set(hot.tolist()) for d in got for t in d)
        differs += got != unrestricted
    assert differs > 0  # the restriction changed something: the test can tell a no-op apart


def test_draft_vocab_ids_are_checked(tiny_model):
    vocab = tiny_model.config.vocab_size
    for bad, message in (((5, 5, 7), "repeats"), ((1, vocab), "outside"), ((), "empty")):
        with pytest.raises(ValueError, match=message):
            MTPDrafter(tiny_model, 3, num_blocks=16, block_size=BLOCK, options=MTPOptions(draft_vocab=bad))


def test_sequences_past_max_context_get_no_drafts_and_nothing_fails(tiny_model, caplog):
    drafter = MTPDrafter(tiny_model, 3, num_blocks=128, block_size=BLOCK, options=MTPOptions(max_context=16))
    engine = make_engine(tiny_model, drafter, 3)
    plain = make_engine(tiny_model)
    prompts = random_prompts([5, 12], tiny_model.config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert engine.generate(prompts, params) == plain.generate(prompts, params)
    assert engine.stats.drafted > 0
    assert "exceed max_context" in caplog.text


class DeviceRecorder(MTPDrafter):
    """An in-process MTP drafter that keeps what every device step asked and answered."""

    def draft_on_device(self, step):
        out = super().draft_on_device(step)
        self.calls.append((list(step.seq_ids), step.chunk_lens.copy(), list(out.counts), out.tokens.clone()))
        return out


def device_steps(loaded, padded: bool, options=None, num_blocks: int = 256, splits: list | None = None):
    """Overlapped steps through an in-process MTP drafter (device steps): 8 prompts of 5 to 30 tokens on 5
    places, prefill chunks of 8 beside decoding sequences. `padded`: batch buckets 1..8 x 4 rows and prefill
    buckets, padded and run eagerly (a CPU's stand-in for the CUDA graphs a drafter on CUDA captures);
    `num_blocks`: the drafter's KV blocks (few: it drops sequences). Returns the outputs, the drafter's calls and
    how many of them ingested prompt rows first; `splits` gets the held mask of each of those."""
    drafter = DeviceRecorder(loaded, 3, num_blocks=num_blocks, block_size=BLOCK,
                             options=options or MTPOptions(max_seqs=5))
    drafter.calls, splits = [], [] if splits is None else splits
    if padded:
        drafter.loop.use_graphs(capture=False)
    skip = drafter.loop.prompt_skip

    def spy(lens, held):
        rows = skip(lens, held)
        if rows is not None:
            splits.append(held.copy())
        return rows
    drafter.loop.prompt_skip = spy
    engine = make_engine(loaded, drafter, 3, max_running=5, chunk=8, budget=24)
    prompts = random_prompts([5, 30, 9, 14, 22, 6, 17, 11], loaded.config.vocab_size, seed=8)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 7, 20, 9, 15, 11, 6, 13)]
    outputs = engine.generate(prompts, params)
    assert engine.overlapped_draft_steps > 10
    return outputs, drafter.calls, len(splits)


def test_prompt_chunks_beside_decoding_sequences_replay_a_batch_bucket_and_draft_the_same(tiny_model):
    """A device step that admits prompt chunks beside decoding sequences ingests the chunks' front rows first and
    replays a batch bucket with one row of each chunk: every call drafts what the unpadded, eager catch-up of
    whole chunks drafts."""
    want_out, want, _ = device_steps(tiny_model, padded=False)
    got_out, got, split = device_steps(tiny_model, padded=True)
    assert got_out == want_out
    assert_same_drafts(got, want)
    mixed = sum(1 for _, lens, _, _ in want if (lens > 4).any() and len(lens) > 1)
    assert split == mixed >= 5


def assert_same_drafts(got, want):
    """Two recordings of device steps: the same calls, counts and drafts (the proposed ones)."""
    assert len(got) == len(want)
    for (seqs, lens, counts, tokens), (seqs2, lens2, counts2, tokens2) in zip(got, want):
        assert (seqs, lens.tolist(), counts) == (seqs2, lens2.tolist(), counts2)
        for row, n in enumerate(counts):
            assert tokens[row, :n].tolist() == tokens2[row, :n].tolist()


def test_prompt_rows_beside_sequences_the_drafter_dropped_draft_the_same(tiny_model, caplog):
    """With too few KV blocks the drafter drops sequences (they decode without drafts): a step that ingests
    prompt rows first then leaves some of its sequences out of both parts, and still drafts what the eager
    catch-up drafts for the others."""
    want_out, want, _ = device_steps(tiny_model, padded=False, num_blocks=24)
    splits = []
    got_out, got, _ = device_steps(tiny_model, padded=True, num_blocks=24, splits=splits)
    assert got_out == want_out
    assert_same_drafts(got, want)
    assert "dropped by the mtp drafter" in caplog.text
    assert any(not held.all() for held in splits) and any(held.all() for held in splits)


def test_warm_up_leaves_no_trace(tiny_model):
    """The drafter's warm-up (drafter_service/mtp/warm_up.py: every eager shape before serving) gives back every
    block and sequence row it took, and a warmed-up drafter drafts exactly what a fresh one drafts: the KV rows it
    wrote into blocks that real sequences take later are never read."""
    from drafter_service.mtp.warm_up import warm_up
    calls = served_calls(tiny_model)
    warmed = MTPDrafter(tiny_model, 3, num_blocks=128, block_size=BLOCK, options=MTPOptions(max_seqs=5))
    free = warmed.tables.blocks.num_free
    report = warm_up(warmed, max_tokens=64)
    assert report.num_runs > 20 and report.max_seqs == 5
    assert warmed.tables.blocks.num_free == free and warmed.tables.seq_ids() == []
    for got, want in replay(warmed, calls):
        assert got == want
