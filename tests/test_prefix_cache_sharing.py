"""Prefix caching (issue 39): what running sequences share and what they may write. A resumed sequence writes
into a copy of its checkpoint's last block, never into a block the cache or another sequence holds; the cache
keeps serving hits while eviction makes room under pressure; drafters of tokens (n-gram, a draft model) are told
which prefix a sequence resumed from; sixteen requests resume from one prefix at the same time."""
import pytest
from engine_factory import BLOCK, make_drafter, make_engine, random_prompts

from specdec.sampling_params import SamplingParams
from verifier_service.block_manager import BlockManager, PrefixCaching

pytestmark = pytest.mark.timeout(600)
CACHE = PrefixCaching(checkpoint_interval=2 * BLOCK, num_checkpoints=16)
SYSTEM = 24          # shared prompt tokens: 6 whole blocks of 4


def pairs(vocab: int, seed: int):
    """Three system prompts, each asked twice in a row with other user tokens (A A B B C C A A)."""
    systems = random_prompts([SYSTEM] * 3, vocab, seed=seed)
    users = random_prompts([3 + i % 4 for i in range(8)], vocab, seed=seed + 1)
    order = [0, 0, 1, 1, 2, 2, 0, 0]
    return [systems[s] + u for s, u in zip(order, users)]


def test_a_resumed_sequence_writes_its_own_copy_of_the_checkpoints_last_block(tiny_model, monkeypatch):
    """The checkpoint's last block holds the prefix but for its last position, which the resumed sequence computes
    again: it gets a copy of its own (one owner), not the block the checkpoint keeps; the blocks before it are
    shared. Outputs equal those without the cache."""
    resumes = []
    resume = BlockManager.resume

    def spy(self, seq, hit):
        resume(self, seq, hit)
        first_write = seq.block_table[hit.num_blocks - 1]        # holds position num_cached, its next write
        assert seq.num_cached // self.block_size == hit.num_blocks - 1
        assert first_write != hit.last_block and self.kv_blocks.refs(first_write) == 1
        assert self.kv_blocks.lookup(seq.block_hashes[hit.num_blocks - 1]) != first_write
        assert seq.block_table[:hit.num_blocks - 1] == hit.shared
        assert [self.kv_blocks.lookup(h) for h in seq.block_hashes[:hit.num_blocks - 1]] == hit.shared   # read only
        resumes.append(hit.num_blocks)

    monkeypatch.setattr(BlockManager, "resume", spy)
    prompts = pairs(tiny_model.config.vocab_size, seed=20)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = []
    for prefix in (None, CACHE):
        engine = make_engine(tiny_model, make_drafter("mtp", tiny_model, 3), k=3, prefix=prefix)
        outputs.append([engine.generate([p], params)[0] for p in prompts])
    assert outputs[0] == outputs[1]
    assert len(resumes) >= 4 and all(m == SYSTEM // BLOCK for m in resumes)


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_eviction_under_pressure_still_serves_hits_and_keeps_outputs(tiny_model, drafter):
    """Two checkpoints: the second request of each pair resumes from the first's prefix. With few KV blocks as
    well, checkpoints and registered blocks are evicted for room as sequences grow (one later request misses),
    the other pairs still hit, and outputs (greedy and seeded) equal those without the cache every time."""
    vocab = tiny_model.config.vocab_size
    prompts = pairs(vocab, seed=30)
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5)]
    few = PrefixCaching(checkpoint_interval=2 * BLOCK, num_checkpoints=2)
    outputs, hits, registered = [], [], []
    for prefix, num_blocks in ((None, 24), (few, 24), (few, 4000)):
        engine = make_engine(tiny_model, make_drafter(drafter, tiny_model, 3), k=3, num_blocks=num_blocks,
                             max_running=1, prefix=prefix)
        outputs.append([engine.generate([p], params[i % 2])[0] for i, p in enumerate(prompts)])
        blocks = engine.executor.blocks
        assert blocks.kv_blocks.num_free + len(blocks.checkpoints) == blocks.kv_blocks.size
        hits.append(engine.scheduler.prefix_stats.hit_tokens)
        registered.append(blocks.kv_blocks.num_registered)
    assert outputs[0] == outputs[1] == outputs[2]
    assert hits[0] == 0 and hits[2] == 4 * (SYSTEM - 1)      # with room: every second request of a pair resumes
    assert 0 < hits[1] < hits[2]               # 24 blocks: a checkpoint a later request could use went for room,
    assert registered[1] < registered[2]       # and so did registered blocks; the others still served


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_drafters_of_tokens_are_told_which_prefix_was_reused(tiny_model, kind):
    """A drafter of tokens gets a resumed sequence from position 0, all its tokens, with a PrefixBlocks naming the
    checkpoint it resumed from (its block hashes); the first request's calls name the checkpoints its chunks end
    at. Outputs equal those without the cache."""
    prompts = pairs(tiny_model.config.vocab_size, seed=40)[:2]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = []
    for prefix in (None, CACHE):
        drafter = make_drafter(kind, tiny_model, 3, draft_model=tiny_model)
        seen = []
        propose = drafter.propose
        drafter.propose = lambda batch: seen.append(batch) or propose(batch)
        engine = make_engine(tiny_model, drafter, k=3, prefix=prefix, overlap=False)
        outputs.append([engine.generate([p], params)[0] for p in prompts])
    assert outputs[0] == outputs[1]
    told = [(b, p) for b in seen for p in b.prefixes]
    resumed = [(b, p) for b, p in told if p.resumed]
    assert len(resumed) == 1 and told[0][1].checkpoint and not told[0][1].resumed
    batch, blocks = resumed[0]
    assert blocks.resumed == SYSTEM // BLOCK and blocks.block_size == BLOCK and len(blocks.hashes) >= blocks.resumed
    first, = [s for s in batch.seqs if s.seq_id == blocks.seq_id]
    assert first.start_pos == 0 and first.token_ids[:len(prompts[1])] == prompts[1]
    assert engine.scheduler.prefix_stats.hit_tokens == SYSTEM - 1


@pytest.mark.parametrize("overlap", [True, False])
def test_sixteen_requests_resume_from_one_prefix_at_once(tiny_model, overlap):
    """One request computes the shared prefix; sixteen then run at the same time, each resumed from it (its blocks
    shared by all of them), outputs as without the cache, and the pool ends as before: every block free but those
    the checkpoints keep."""
    vocab = tiny_model.config.vocab_size
    system = random_prompts([SYSTEM + 2], vocab, seed=9)[0]
    tails = random_prompts([3 + i % 5 for i in range(16)], vocab, seed=10)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs = []
    for prefix in (None, CACHE):
        engine = make_engine(tiny_model, make_drafter("mtp", tiny_model, 3), k=3, chunk=8, budget=128,
                             max_running=16, prefix=prefix, overlap=overlap)
        engine.generate([system], params)
        shared, running, step = [], [], engine.step

        def counted():
            running.append(len(engine.scheduler.running))
            blocks = engine.executor.blocks.kv_blocks
            shared.append(max((blocks.refs(s.block_table[0]) for s in engine.scheduler.running if s.block_table),
                              default=0))
            return step()
        engine.step = counted
        outputs.append(engine.generate([system + t for t in tails], params))
        blocks = engine.executor.blocks
        assert blocks.kv_blocks.num_free + len(blocks.checkpoints) == blocks.kv_blocks.size
        assert blocks.gdn_slots.num_free == blocks.gdn_slots.size
    assert outputs[0] == outputs[1]
    assert max(running) == 16 and max(shared) >= 16           # all at once, on the same first block
    assert engine.scheduler.prefix_stats.hit_tokens == 16 * (6 * BLOCK - 1)   # the checkpoint at position 23


@pytest.mark.parametrize("flags, on", [([], True), (["--no-prefix-caching"], False)])
def test_the_verifier_cli_turns_the_cache_on_by_default(monkeypatch, tiny_dir, flags, on):
    """`specdec verifier` builds its config with the prefix cache on, off with --no-prefix-caching."""
    import verifier_service.server
    from specdec_tools.cli import main
    seen = []
    monkeypatch.setattr(verifier_service.server, "serve", lambda config, *a, **kw: seen.append(config))
    assert main(["verifier", "--model", str(tiny_dir), "--device", "cpu", *flags]) == 0
    config, = seen
    assert config.prefix_caching is on and config.prefix.enabled is on
