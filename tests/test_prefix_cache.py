"""Prefix caching on hybrid models stays exact with speculation (issue 39). Each peer bug has a test here:
outputs differ or come out empty with MTP + prefix caching + recurrent state (vllm #43559, #43650), MTP drops the
hits to 0 (vllm #54360) or lowers the hit rate (vllm #38182), the first repeat of a prompt misses (vllm #53504).
Outputs with the cache equal those without it (greedy and seeded sampling, the three families, mtp and ngram
drafters, overlapped and synchronous steps), and so do the MTP drafter's acceptance counts."""
import hashlib

import numpy as np
import pytest
from engine_factory import BLOCK, make_drafter, make_engine, random_prompts

from specdec.id_pool import PoolExhausted
from specdec.models.loader import load_model
from specdec.prefix_cache import BlockPool, Checkpoints, chain_hashes, next_checkpoint
from specdec.sampling_params import SamplingParams
from specdec_tools.tiny import make_tiny
from verifier_service.block_manager import PrefixCaching

pytestmark = pytest.mark.timeout(600)
CACHE = PrefixCaching(checkpoint_interval=4 * BLOCK, num_checkpoints=16)
SYSTEM = 30          # shared prompt tokens (7 blocks of 4 and 2 tokens)


# ---- the parts ---------------------------------------------------------------------------------
def test_a_block_hash_names_everything_before_it():
    tokens = list(range(1, 21))
    hashes = chain_hashes(tokens, 4, 5)
    assert len(set(hashes)) == 5
    assert chain_hashes(tokens, 4, 5, hashes[:2]) == hashes           # extended, not recomputed
    changed = chain_hashes([99] + tokens[1:], 4, 5)
    assert all(a != b for a, b in zip(hashes, changed))                # a change in block 0 renames every block
    assert chain_hashes(tokens[:8] + [0] * 12, 4, 5)[:2] == hashes[:2]
    parent = 0                                                         # h_j = H(h_{j-1}, block j), block by block
    for j, h in enumerate(hashes):
        block = np.asarray(tokens[4 * j:4 * j + 4], np.int64).tobytes()
        parent = int.from_bytes(hashlib.blake2b(parent.to_bytes(8, "little") + block, digest_size=8).digest(),
                                "little") >> 1
        assert h == parent


def test_checkpoints_fall_every_interval_and_at_the_last_whole_block():
    assert [next_checkpoint(s, 70, 4, 16) for s in (0, 15, 16, 47, 63, 67)] == [15, 31, 31, 63, 67, None]
    assert next_checkpoint(0, 3, 4, 16) is None                         # no whole block
    assert next_checkpoint(0, 8, 4, 16) == 7                            # a repeat still runs its last token


def test_pool_shares_registered_blocks_and_evicts_idle_ones_least_recently_used_first():
    pool = BlockPool(4, "kv")
    a, b, c = pool.take(3)
    pool.register(a, 11)
    pool.register(b, 12)
    pool.register(c, 11)                                 # another block of the same content stays unregistered
    assert (pool.lookup(11), pool.matched([11, 12, 13])) == (a, 2)
    pool.share(a)
    pool.give_back([a, b, c])                            # b idle (registered), c free, a still held once
    assert pool.num_free == 3 and pool.refs(a) == 1
    pool.give_back([a])                                  # a idle now: the most recently used
    assert sorted(pool.take(2)) == sorted([c, 3])       # free ones first
    assert pool.take(1) == [b] and pool.lookup(12) is None   # then the least recently used idle one
    pool.share(a)                                        # an idle block shared again is no longer free
    assert pool.num_free == 0
    with pytest.raises(PoolExhausted):
        pool.take(1)


def test_a_prompt_is_hashed_only_as_far_as_its_cached_prefix_reaches():
    """Matching hashes a prompt's blocks a batch at a time and stops past the last cached one (a new long prompt
    would otherwise be hashed whole on the engine's thread before its first chunk runs); the rest are hashed as
    its chunks reach checkpoints. Hits past the first batch still resume at the longest checkpoint."""
    from verifier_service.block_manager import HASH_BATCH, BlockManager
    from verifier_service.sequence import Sequence
    manager = BlockManager(1000, 4, 4, 500, PrefixCaching(checkpoint_interval=400, num_checkpoints=4))
    first = Sequence(0, list(range(1, 1201)), 1200)                      # 300 blocks
    manager.reserve(first, 1200)
    manager.checkpoint(first, 799)                                       # blocks 0-198 kept, 199 the checkpoint's
    shared = Sequence(1, list(range(1, 1001)) + [7] * 200, 1200)
    hit = manager.match(shared)
    assert hit is not None and hit.num_blocks == 200
    assert 200 <= len(shared.block_hashes) < 300
    assert shared.block_hashes == chain_hashes(shared.token_ids, 4, len(shared.block_hashes))
    fresh = Sequence(2, [9] + list(range(2, 1201)), 1200)
    assert manager.match(fresh) is None and len(fresh.block_hashes) == HASH_BATCH < 300
    manager.reserve(fresh, 1200)
    manager.checkpoint(fresh, 1199)                                      # its launch hashes the rest
    assert fresh.block_hashes == chain_hashes(fresh.token_ids, 4, 300)


def test_checkpoints_hold_their_block_until_dropped():
    pool = BlockPool(4, "kv")
    blocks = pool.take(3)
    kept = Checkpoints(pool, 2, first_row=8)
    rows = [kept.add(h, b) for h, b in zip((1, 2, 3), blocks)]
    assert rows[:2] == [8, 9] and rows[2] in (8, 9)      # the third took the first one's row
    assert kept.add(2, blocks[1]) is None                # kept already
    pool.give_back(blocks)
    assert 1 not in kept and pool.num_free == 2          # the first's block went back; two are held


# ---- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def families(tiny_model, tmp_path_factory):
    moe = {f: load_model(make_tiny(tmp_path_factory.mktemp(f), family=f, progress=False))
           for f in ("qwen3_5_moe", "qwen3_next")}
    return {"qwen3_5": tiny_model, **moe}


def conversation(vocab: int, seed: int = 3):
    """A shared system prompt, three users after it, and the requests of two rounds: the first asks each user,
    the second repeats them and adds a second turn of the first user (prompt + its answer + more)."""
    system, *users = random_prompts([SYSTEM, 5, 9, 6, 7], vocab, seed=seed)
    params = [SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7)]
    return system, users, params


def run_rounds(engine, vocab, seed=3):
    """Round 1 then round 2 (each round's requests at once): the tokens and cached prompt tokens of each."""
    system, users, params = conversation(vocab, seed)
    first = [system + u for u in users[:3]]
    rounds, outputs = [], {}
    for r, prompts in enumerate((first, None)):
        if prompts is None:   # round 2: the repeats and a second turn
            prompts = first + [first[0] + outputs[0][0] + users[3]]
        tokens, cached = {}, {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{r}-{i}", p, params[i % 2])
            tokens[i] = []
        while engine.has_work:
            for o in engine.step():
                i = int(o.request_id.split("-")[1])
                tokens[i] += o.new_token_ids
                cached[i] = o.cached_tokens
        outputs = {i: (tokens[i], cached[i]) for i in tokens}
        rounds.append(outputs)
    return rounds


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("drafter", [None, "ngram", "mtp"])
def test_outputs_and_acceptance_equal_with_and_without_the_cache(families, family, drafter):
    loaded, k = families[family], 3 if drafter else 0
    results = []
    for prefix in (None, CACHE):
        engine = make_engine(loaded, make_drafter(drafter, loaded, k) if drafter else None, k=k, chunk=8,
                             prefix=prefix)
        results.append((run_rounds(engine, loaded.config.vocab_size), engine.stats.drafted, engine.stats.accepted,
                        engine.scheduler.prefix_stats.hit_tokens))
    (plain, drafted, accepted, no_hits), (cached, drafted_c, accepted_c, hits) = results
    strip = [{i: t for i, (t, _) in r.items()} for r in plain], [{i: t for i, (t, _) in r.items()} for r in cached]
    assert strip[0] == strip[1] and all(len(t) == 10 for r in strip[1] for t in r.values())
    assert (drafted, accepted) == (drafted_c, accepted_c)                # the drafter saw the same contexts
    assert no_hits == 0 and all(c == 0 for _, c in plain[1].values())
    # round 2: every repeat resumes one token short of its last whole block; the second turn beyond its first
    rep = cached[1]
    whole = [((SYSTEM + n) // BLOCK) * BLOCK - 1 for n in (5, 9, 6)]
    assert [rep[i][1] for i in range(3)] == whole                        # the first repeat hits, with any drafter
    assert rep[3][1] >= whole[0]
    assert hits == sum(c for _, c in cached[0].values()) + sum(c for _, c in rep.values())


def test_mtp_keeps_the_hit_rate_of_plain_decoding(tiny_model):
    """The same requests hit the same prompt tokens with the MTP drafter as without a drafter."""
    hits = []
    for drafter in (None, "mtp"):
        k = 3 if drafter else 0
        engine = make_engine(tiny_model, make_drafter(drafter, tiny_model, k) if drafter else None, k=k, chunk=8,
                             prefix=CACHE)
        run_rounds(engine, tiny_model.config.vocab_size, seed=4)
        stats = engine.scheduler.prefix_stats
        hits.append((stats.queried_tokens, stats.hit_tokens))
    assert hits[0] == hits[1] and hits[0][1] > 0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_a_request_cancelled_mid_prefill_leaves_only_what_it_finished(families, family, drafter):
    """A prompt aborted after a few chunks keeps the checkpoints its launched chunks reached, no further; the same
    prompt sent again resumes there and decodes what it would have without the cache."""
    loaded = families[family]
    vocab = loaded.config.vocab_size
    prompt = random_prompts([64], vocab, seed=14)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = make_engine(loaded, chunk=8).generate([prompt], params)[0]
    engine = make_engine(loaded, make_drafter(drafter, loaded, 3), k=3, chunk=8, prefix=CACHE)
    engine.add_request("cut", prompt, params)
    for _ in range(3):   # chunks of 8 ending at 8, 15 (checkpoint), 23
        engine.step()
    assert engine.abort("cut")
    engine.add_request("again", prompt, params)
    tokens, cached = [], None
    while engine.has_work:
        for o in engine.step():
            tokens += o.new_token_ids
            cached = o.cached_tokens
    assert tokens == expected and cached == 4 * BLOCK - 1
    blocks = engine.executor.blocks
    assert blocks.kv_blocks.num_free + len(blocks.checkpoints) == blocks.kv_blocks.size


def test_a_drafter_that_lacks_the_prefix_gets_the_sequence_from_its_start(tiny_model):
    """The MTP drafter is cleared between rounds (its kept blocks gone): it reports resumed sequences missing, the
    verifier recomputes them from position 0 without the cache (their first decode steps may go without drafts):
    outputs stay those of a run without the cache, and the drafter drafts for them again."""
    results = []
    for prefix in (None, CACHE):
        drafter = make_drafter("mtp", tiny_model, 3)
        engine = make_engine(tiny_model, drafter, k=3, chunk=8, prefix=prefix)
        system, users, params = conversation(tiny_model.config.vocab_size)
        first = engine.generate([system + users[0]], params[0])
        drafter.tables.checkpoints = type(drafter.tables.checkpoints)(drafter.tables.blocks, 8)   # forgets them
        drafted, queried = engine.stats.drafted, engine.scheduler.prefix_stats.queried_tokens
        engine.add_request("again", system + users[0], params[0])
        second, cached = [], []
        while engine.has_work:
            for o in engine.step():
                second += o.new_token_ids
                cached.append(o.cached_tokens)
        results.append((first, [second]))
        assert engine.stats.drafted > drafted
        # with the cache: admitted at its checkpoint, reported missing, admitted again from position 0
        assert engine.scheduler.prefix_stats.queried_tokens - queried == (2 if prefix else 1) * (SYSTEM + 5)
        assert cached[-1] == 0                        # usage (final on the last output): nothing came from the cache
    assert results[0] == results[1]
    assert engine.scheduler.prefix_stats.hit_tokens > 0


def test_no_prefix_caching_keeps_nothing(tiny_model):
    engine = make_engine(tiny_model, chunk=8, prefix=PrefixCaching(enabled=False))
    prompt = random_prompts([40], tiny_model.config.vocab_size, seed=2)[0]
    engine.generate([prompt, prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.scheduler.prefix_stats.hit_tokens == 0 and not len(engine.executor.blocks.checkpoints)
    assert np.all(engine.executor.blocks.kv_blocks._refs == 0)


@pytest.mark.parametrize("overlap", [True, False])
def test_demo_model_acceptance_is_the_same_with_a_cached_prefix(overlap):
    """On the trained demo model the MTP head accepts drafts: resumed from a cached prefix (its own KV blocks
    shared), it drafts and accepts exactly what it does after a full prefill."""
    from specdec.demo import demo_model_dir
    from tokenizers import Tokenizer
    loaded = load_model(demo_model_dir())
    tokenizer = Tokenizer.from_file(f"{demo_model_dir()}/tokenizer.json")
    system = tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
                              "fibonacci(n - 2)\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n").ids
    users = [tokenizer.encode(u).ids for u in ("def push(self, x):", "def pop(self):", "def factorial(n):")]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results = []
    for prefix in (None, CACHE):
        engine = make_engine(loaded, make_drafter("mtp", loaded, 3), k=3, prefix=prefix, overlap=overlap)
        outputs = [engine.generate([system + u], params)[0] for u in users + users]
        results.append((outputs, engine.stats.drafted, engine.stats.accepted))
        hits = engine.scheduler.prefix_stats.hit_tokens
    assert results[0] == results[1] and results[0][2] > results[0][1] / 3   # (it does accept)
    assert hits >= 5 * (len(system) - BLOCK)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_the_mtp_drafter_service_resumes_a_cached_prefix(tmp_path, transport):
    """Through the three services on the demo model: a prompt's first repeat is served from the prefix cache, the
    MTP drafter service resumes it from its own kept blocks (device steps over shared memory, or host steps with
    inline hidden states) and drafts and accepts exactly what it did the first time."""
    import grpc
    from tokenizers import Tokenizer

    from specdec.demo import demo_model_dir
    from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc
    from specdec_tools.local_stack import LocalStack, StackConfig
    prompt = Tokenizer.from_file(f"{demo_model_dir()}/tokenizer.json").encode(
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n").ids
    stack = LocalStack(StackConfig(model=demo_model_dir(), drafter="mtp", num_drafts=3, port=0, transport=transport,
                                   log_dir=str(tmp_path), startup_timeout_s=120))
    stack.start()
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            runs = []
            for _ in range(2):
                replies = list(stub.Generate(gateway_pb2.GenerateRequest(
                    prompt_token_ids=prompt, sampling=gateway_pb2.SamplingParams(max_tokens=24, ignore_eos=True)),
                    timeout=120))
                u = replies[-1].usage
                runs.append(([t for r in replies for t in r.token_ids], u.draft_tokens, u.accepted_tokens,
                             u.cached_tokens))
    finally:
        stack.stop()
    (tokens, drafted, accepted, cached), repeat = runs
    assert cached == 0 and repeat == (tokens, drafted, accepted, (len(prompt) // 16) * 16 - 1)
    assert accepted > 0
    assert "the drafter lost its hidden states" not in (tmp_path / "verifier.log").read_text()


def test_a_constrained_request_resumed_from_the_cache_drafts_inside_its_grammar():
    """The MTP drafter's grammar masks follow a sequence first seen past position 0 (resumed from a cached prefix):
    it accepts what it does after a full prefill. (Its draft count may differ by a step or two: a grammar's matcher
    compiles in the background, and until it is ready the drafts go unmasked. Without masks on the resumed
    sequence the counts were 68 drafted / 8 accepted against 46 / 16.)"""
    from tokenizers import Tokenizer

    from drafter_service.mtp.mtp_drafter import MTPDrafter
    from specdec.demo import demo_model_dir
    from specdec.drafting.draft_masks import DraftMasks
    from specdec.grammar import Grammars
    from specdec.sampling_params import GrammarSpec
    from verifier_service.engine import EngineConfig, SpecEngine
    from verifier_service.executor import Executor
    from verifier_service.scheduler import SchedulerConfig
    loaded = load_model(demo_model_dir())
    tokenizer = Tokenizer.from_file(f"{demo_model_dir()}/tokenizer.json")
    prompt = tokenizer.encode("You answer with JSON only. " * 8 + "Give me a number:").ids
    params = SamplingParams(max_tokens=24, grammar=GrammarSpec("regex", "[0-9]{20,30}"))
    results = []
    for prefix in (PrefixCaching(enabled=False), PrefixCaching(checkpoint_interval=64, num_checkpoints=8)):
        grammars = Grammars.from_folder(demo_model_dir(), loaded.config.vocab_size, list(loaded.config.eos_token_id))
        drafter = MTPDrafter(loaded, 3, num_blocks=512, block_size=16, draft_masks=DraftMasks(grammars))
        executor = Executor.build(loaded, num_blocks=512, block_size=16, max_seqs=4, max_drafts=3,
                                  max_batched_tokens=256, prefix=prefix)
        engine = SpecEngine(executor, drafter, EngineConfig(num_drafts=3, scheduler=SchedulerConfig(4, 256, 256)),
                            grammars=grammars)
        results.append(([engine.generate([prompt], params)[0] for _ in range(2)], engine.stats.drafted,
                         engine.stats.accepted))
    (plain, drafted, accepted), (cached, drafted_c, accepted_c) = results
    assert plain == cached and accepted == accepted_c and abs(drafted - drafted_c) <= 4
    assert engine.scheduler.prefix_stats.hit_tokens > 0


def test_the_drafter_service_refuses_malformed_prefix_messages():
    """Checked before anything is applied: a PrefixBlocks with too few hashes, of a sequence not in the step, or
    whose checkpoint its rows do not reach, refuses the whole step."""
    from drafter_service.step_check import step_problem
    from specdec.drafting import DrafterInfo
    from specdec.rpc.v1 import drafter_pb2 as pb
    info = DrafterInfo("ngram", 3, needs_hidden=False)

    def problem(**fields):
        step = pb.StepInput(step=2, seqs=[pb.SeqInput(seq_id=7, start_pos=0, token_ids=list(range(1, 33)))],
                            prefixes=[pb.PrefixBlocks(**{"seq_id": 7, "hashes": [1, 2], "block_size": 16, **fields})])
        return step_problem(step, 1, info, None)
    assert problem(checkpoint=2) == ""                       # its rows reach position 31
    assert "hashes" in problem(checkpoint=3)
    assert "not a sequence of this step" in problem(seq_id=8, checkpoint=1)
    assert "past the rows" in problem(hashes=[1, 2, 3], checkpoint=3)
    assert "block_size" in problem(block_size=0, resumed=1)
