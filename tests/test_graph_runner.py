"""CUDA-graph runner: bucketing, and the padding it relies on. On CPU the padded batches run eagerly
(`use_graphs(capture=False)`): same logits, hidden states and caches as the unpadded batch, scratch rows only
for the padding, greedy and speculative output unchanged. On a GPU (marked gpu) the captured graphs replay."""
import numpy as np
import pytest
import torch
from engine_factory import make_drafter, make_engine, random_prompts

from specdec.models.batch_staging import StepPlan
from specdec.models.graph_bucket import Bucket
from specdec.sampling_params import SamplingParams
from specdec.models.cuda_graph_runner import buckets_for
from verifier_service.executor import Executor
from verifier_service.plain_generate import greedy_generate
from verifier_service.sequence import Sequence

PROMPTS = [[5, 9, 33, 7, 100, 3], [42, 8], [17, 250, 8, 61, 9, 9, 12, 1, 4], [77]]


def test_bucket_sets():
    assert buckets_for(16) == (1, 2, 4, 8, 16)
    assert buckets_for(3) == (1, 2, 4)
    assert buckets_for(100) == (1, 2, 4, 8, 16, 32, 64)


def plan_of(lens):
    lens = np.array(lens, np.int64)
    b = lens.shape[0]
    zeros = np.zeros(b, np.int32)
    return StepPlan(np.zeros(int(lens.sum()), np.int64), lens, np.zeros(b, np.int64), np.zeros((b, 4), np.int32),
                    np.full(b, 4, np.int64), zeros, zeros, np.maximum(lens - 1, 0).astype(np.int32), lens)


def test_bucket_for_picks_smallest_fitting_bucket(tiny_model):
    executor = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=8, max_drafts=3)
    executor.runner.use_graphs(capture=False)
    graphs = executor.runner.graphs
    assert graphs.bucket_for(plan_of([1, 1, 1])) == Bucket.uniform(4, 1, 0)     # plain decode, nothing to replay
    assert graphs.bucket_for(plan_of([4, 1, 3])) == Bucket.uniform(4, 4)        # ragged verify, k = 3
    assert graphs.bucket_for(plan_of([1] * 8)) == Bucket.uniform(8, 1, 0)
    assert graphs.bucket_for(plan_of([1] * 9)) is None                          # more than the largest bucket


def test_steps_mixing_prompt_chunks_take_the_smallest_mixed_bucket(tiny_model):
    """Mixed buckets: 4 or 8 sequences (MIXED_SEQS capped by the largest batch bucket) x 256 or 512 tokens (the
    runner's token budget, 512), chunks of up to 512 tokens (the largest prefill bucket), k + 1 logit rows a
    sequence; anything past them runs eagerly."""
    executor = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=8, max_drafts=3)
    executor.runner.use_graphs(capture=False)
    graphs = executor.runner.graphs
    assert (graphs.mixed_seqs, graphs.mixed_tokens) == ((4, 8), (256, 512))
    mixed = prefill_plan([5, 1])                                                # a prompt chunk beside a decoder
    assert graphs.bucket_for(mixed) == Bucket(seqs=4, max_seqlen=512, tokens=256, logit_rows=16, max_drafts=3)
    assert graphs.is_mixed(graphs.bucket_for(mixed)) and not graphs.is_prefill(graphs.bucket_for(mixed))
    assert graphs.bucket_for(prefill_plan([200, 100, 4, 4, 1])) == Bucket.mixed(8, 512, 512, 3)
    assert graphs.bucket_for(prefill_plan([40], logits=2)) == Bucket.mixed(4, 256, 512, 3)   # 2 logit rows
    assert graphs.bucket_for(prefill_plan([257, 1])) == Bucket.mixed(4, 512, 512, 3)
    assert graphs.bucket_for(prefill_plan([256, 256, 1])) is None               # past the largest mixed bucket
    assert graphs.bucket_for(plan_of([100, 1])) is None                         # every row's logits: 101 of 16
    assert graphs.bucket_for(prefill_plan([9] * 9)) is None                     # more sequences than any bucket


def test_prefill_and_mixed_buckets_stop_at_the_token_budget(tiny_model):
    executor = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=8, max_drafts=3, max_batched_tokens=100)
    executor.runner.use_graphs(capture=False)
    assert executor.runner.graphs.prefill_tokens == (32, 64, 128) and executor.runner.graphs.mixed_tokens == (256,)
    assert Bucket.prefill(256) not in executor.runner.graphs.buckets()


@pytest.mark.parametrize("max_seqs, k, pairs", [(1, 3, ((1, 256), (1, 512), (1, 576), (1, 1024))),
                                                (2, 0, ((2, 256), (2, 512), (2, 576), (2, 1024))),
                                                (8, 3, ((4, 256), (4, 512), (4, 576), (4, 1024), (8, 256), (8, 512),
                                                        (8, 576), (8, 1024)))])
def test_only_reachable_mixed_buckets_are_captured(tiny_model, max_seqs, k, pairs):
    """b sequences of up to P tokens (P = 1024, the largest prefill bucket the mixed buckets' tokens hold) never fill
    more than b * P tokens; at k = 0 one sequence's mixed bucket of P tokens is the prefill bucket of P, which
    is_mixed does not claim. A 2048-token budget captures a 2048-token prefill bucket (a chunk alone), not 4096."""
    executor = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=max_seqs, max_drafts=k,
                         max_batched_tokens=2048)
    executor.runner.use_graphs(capture=False)
    graphs = executor.runner.graphs
    assert tuple(graphs.mixed_buckets) == pairs
    mixed = [b for b in graphs.buckets() if graphs.is_mixed(b)]
    assert [(b.seqs, b.tokens) for b in mixed] == sorted(pairs, key=lambda p: (p[1], p[0]), reverse=True)
    assert not any(graphs.is_mixed(b) for b in graphs.buckets() if graphs.is_prefill(b))
    assert graphs.prefill_tokens[-2:] == (1024, 2048) and graphs.is_prefill(Bucket.prefill(2048))
    assert {b.max_seqlen for b in graphs.mixed_buckets.values()} == {1024}


def test_a_mixed_step_takes_more_sequences_when_its_logit_rows_need_them(tiny_model):
    executor = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=16, max_drafts=3)
    executor.runner.use_graphs(capture=False)
    plan = prefill_plan([20, 4, 4], logits=4)                        # 12 logit rows fit 4 sequences' 16
    assert executor.runner.graphs.bucket_for(plan).seqs == 4
    plan = prefill_plan([30, 20, 20], logits=14)                      # 42 logit rows: 16 sequences' 64
    assert executor.runner.graphs.bucket_for(plan) == Bucket.mixed(16, 256, 512, 3)


def test_a_mixed_prefill_chunk_beside_fifteen_decoders_does_not_pad_to_the_largest_bucket(tiny_model):
    """A GPU's mixed prefill chunk (512 tokens) beside 15 decoding sequences, or beside 15 verifying 3 drafts,
    takes the 576-token mixed graph: its GEMMs run on 576 rows, not 1024."""
    executor = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=16, max_drafts=3,
                              max_batched_tokens=1024)
    executor.runner.use_graphs(capture=False)
    assert executor.runner.graphs.bucket_for(prefill_plan([512] + [1] * 15)).tokens == 576
    plan = prefill_plan([512] + [4] * 15, logits=4)
    plan.logits_per_seq[0] = 1
    assert executor.runner.graphs.bucket_for(plan).tokens == 576


def prefill_plan(lens, logits=1):
    plan = plan_of(lens)
    plan.num_drafts[:] = 0
    plan.logits_per_seq = np.full(len(lens), logits, np.int64)
    return plan


def test_a_prompt_chunk_alone_takes_the_smallest_prefill_bucket(tiny_model):
    executor = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=8, max_drafts=3)
    executor.runner.use_graphs(capture=False)
    graphs = executor.runner.graphs
    assert graphs.bucket_for(prefill_plan([5])) == Bucket.prefill(32)
    assert graphs.bucket_for(prefill_plan([33])) == Bucket.prefill(64)
    assert graphs.bucket_for(prefill_plan([128], logits=0)) == Bucket.prefill(128)   # a chunk that does not sample
    assert graphs.bucket_for(prefill_plan([256])) == Bucket.prefill(256)
    assert graphs.bucket_for(prefill_plan([257])) == Bucket.prefill(512)        # the largest: the token budget
    assert graphs.bucket_for(prefill_plan([513])) is None                       # longer than the largest
    assert not graphs.is_prefill(graphs.bucket_for(prefill_plan([40, 1])))      # beside another sequence: mixed


def test_a_chunk_deep_into_its_prompt_takes_the_deep_prefill_graph(tiny_model):
    """A chunk alone far enough into its prompt for its length (wide_tile_context: 16384 tokens for 512) takes its
    prefill bucket's second, deep graph (wider attention tiles); a shorter chunk, or one nearer the start, the
    plain one; a step that starts earlier cannot stage into the deep bucket."""
    executor = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=8, max_drafts=3)
    executor.runner.use_graphs(capture=False)
    graphs = executor.runner.graphs
    assert graphs.deep_prefill_tokens == (512,)
    assert Bucket.prefill(512, 16384) in graphs.buckets() and not any(
        b.min_context for b in graphs.buckets() if b.max_seqlen < 512)

    def at(length, start):
        plan = prefill_plan([length])
        plan.start_positions[:] = start
        return graphs.bucket_for(plan)
    assert at(512, 16384) == Bucket.prefill(512, 16384)
    assert graphs.is_prefill(at(512, 16384)) and not graphs.is_mixed(at(512, 16384))
    assert at(512, 16383) == Bucket.prefill(512)
    assert at(300, 10 ** 6) == Bucket.prefill(512)                  # its own length never takes the wide tiles
    assert Bucket.prefill(512, 16384).holds(1, 512, 512, 1, 0, least_context=16384)
    assert not Bucket.prefill(512, 16384).holds(1, 512, 512, 1, 0, least_context=16383)


def test_the_attention_layer_hands_the_batch_s_min_context_to_the_kernel(tiny_model, monkeypatch):
    """The bound a deep graph's batch carries reaches the paged attention (which picks its tiles by it)."""
    import dataclasses

    from specdec.models import gated_attention
    from specdec.models.forward_batch import ForwardBatch
    config = tiny_model.config
    layer = gated_attention.GatedAttention(config)
    seen = []

    def spy(q, *args, min_context=0, **kwargs):
        seen.append(min_context)
        return torch.zeros_like(q)
    monkeypatch.setattr(gated_attention, "paged_attention", spy)
    batch = ForwardBatch.build([[1, 2, 3]], [40], [list(range(11))], 4, [0])
    cache = torch.zeros(12, 4, config.num_key_value_heads, config.head_dim)
    for bound in (0, 40):
        layer(torch.randn(3, config.hidden_size), dataclasses.replace(batch, min_context=bound), cache, cache.clone())
    assert seen == [0, 40]


@pytest.mark.parametrize("length", [1, 5, 32, 37, 130])
def test_padded_prefill_bucket_equals_unpadded(tiny_model, length):
    """A prompt chunk alone, padded to its prefill bucket: the same last-row logits, hidden rows and caches as the
    unpadded chunk; then a decode step from those caches agrees too."""
    prompt = random_prompts([length], tiny_model.config.vocab_size, seed=length)[0]
    runners, seqs = [], []
    for padded in (False, True):
        executor = Executor.build(tiny_model, num_blocks=64, block_size=4, max_seqs=2, max_drafts=3)
        if padded:
            executor.runner.use_graphs(capture=False)
        seq = Sequence(0, list(prompt), length)
        hidden, logits = executor.forward([seq], [list(prompt)])
        runners.append((executor, seq, hidden, logits))
    (eager, seq_e, hidden_e, logits_e), (padded, seq_p, hidden_p, logits_p) = runners
    bucket = padded.runner.graphs.bucket_for(padded.plan([seq_p], [prompt], None, "last"))
    assert padded.runner.last_outputs[0].shape[0] == bucket.tokens >= length    # it ran in its bucket, padded
    assert padded.runner.graphs.is_prefill(bucket) == (length > 4)
    torch.testing.assert_close(hidden_p, hidden_e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_p, logits_e, atol=1e-4, rtol=1e-4)
    assert_caches_equal(eager, padded, [seq_e.gdn_slot])
    for executor, seq in ((eager, seq_e), (padded, seq_p)):
        seq.num_cached = length
    _, next_e = eager.forward([seq_e], [[7]])
    _, next_p = padded.forward([seq_p], [[7]])
    torch.testing.assert_close(next_p, next_e, atol=1e-4, rtol=1e-4)


def test_later_prompt_chunks_in_prefill_buckets_equal_unpadded(tiny_model):
    """A prompt fed in chunks (40, 67, 43 tokens; the first two sample nothing): each later chunk starts from the
    KV, GDN and conv state the earlier ones left and runs in its own prefill bucket, padded; the logits, the caches
    and the next decode step equal the unpadded run."""
    prompt = random_prompts([150], tiny_model.config.vocab_size, seed=11)[0]
    chunks, results = [prompt[:40], prompt[40:107], prompt[107:]], []
    for padded in (False, True):
        executor = Executor.build(tiny_model, num_blocks=64, block_size=4, max_seqs=2, max_drafts=3)
        if padded:
            executor.runner.use_graphs(capture=False)
        seq, buckets = Sequence(0, list(prompt), len(prompt)), []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            _, logits = executor.forward([seq], [chunk], logits="last" if last else [0])
            buckets.append(executor.runner.last_outputs[0].shape[0])
            seq.num_cached += len(chunk)
        _, decoded = executor.forward([seq], [[7]])
        results.append((executor, seq, logits.clone(), decoded.clone(), buckets))
    (eager, seq_e, logits_e, next_e, _), (padded, seq_p, logits_p, next_p, buckets) = results
    assert buckets == [64, 128, 64]                                         # every chunk ran padded
    torch.testing.assert_close(logits_p, logits_e, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(next_p, next_e, atol=1e-4, rtol=1e-4)
    assert_caches_equal(eager, padded, [seq_e.gdn_slot])


def prefilled_pair(loaded, max_drafts=3):
    """Two runners with the same prompts prefilled eagerly; the second runs decode steps in padded buckets."""
    runners, seqs = [], []
    for padded in (False, True):
        executor = Executor.build(loaded, num_blocks=32, block_size=4, max_seqs=6, max_drafts=max_drafts)
        group = [Sequence(i, list(p), len(p)) for i, p in enumerate(PROMPTS)]
        executor.forward(group, [list(p) for p in PROMPTS])
        for s in group:
            s.num_cached = len(s.token_ids)
        if padded:
            executor.runner.use_graphs(capture=False)
        runners.append(executor)
        seqs.append(group)
    return runners, seqs


def assert_caches_equal(a: Executor, b: Executor, slots: list[int]):
    ga, gb = a.runner.caches.gdn, b.runner.caches.gdn
    for ra, rb, pa, pb, ca, cb in zip(ga.recurrent, gb.recurrent, ga.pending, gb.pending, ga.conv, gb.conv):
        torch.testing.assert_close(ra[slots], rb[slots], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pa[slots], pb[slots], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ca[slots], cb[slots], atol=1e-5, rtol=1e-5)
    blocks = a.runner.caches.kv.num_blocks  # the scratch block (the last) is where padding writes
    for ka, kb in zip(a.runner.caches.kv.k + a.runner.caches.kv.v, b.runner.caches.kv.k + b.runner.caches.kv.v):
        torch.testing.assert_close(ka[:blocks], kb[:blocks], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafts", [[3, 0, 2], [0, 0, 0], [1, 3, 3, 0]], ids=["ragged-3", "decode-3", "verify-4"])
def test_padded_bucket_equals_unpadded(tiny_model, drafts):
    (eager, padded), (seqs_e, seqs_p) = prefilled_pair(tiny_model)
    n = len(drafts)
    chunks = [[40 + i] + list(range(60 + 7 * i, 60 + 7 * i + d)) for i, d in enumerate(drafts)]
    want = [d + 1 for d in drafts]
    assert padded.runner.graphs.bucket_for(padded.plan(seqs_p[:n], chunks, drafts, want)) is not None
    hidden_e, logits_e = eager.forward(seqs_e[:n], chunks, drafts, logits=want)
    hidden_p, logits_p = padded.forward(seqs_p[:n], chunks, drafts, logits=want)
    assert padded.runner.last_outputs[0].shape[0] > hidden_p.shape[0]   # it really ran padded
    assert logits_p.shape == logits_e.shape and hidden_p.shape == hidden_e.shape
    torch.testing.assert_close(logits_p, logits_e, atol=1e-4, rtol=1e-4)  # GEMMs of other M: fp32 noise
    torch.testing.assert_close(hidden_p, hidden_e, atol=1e-5, rtol=1e-5)
    assert_caches_equal(eager, padded, [s.gdn_slot for s in seqs_e])


def test_mixed_steps_in_a_padded_bucket_equal_unpadded(tiny_model):
    """Two new prompts beside decoding sequences, the second prompt in two chunks (the first samples nothing):
    both mixed steps run padded to a mixed bucket and give the logits, hidden rows and caches of the unpadded
    steps; so does the decode step after them. Two drafts of the first step are accepted: the second step replays
    them (GDN read offset 2) beside a prompt chunk."""
    (eager, padded), (seqs_e, seqs_p) = prefilled_pair(tiny_model)
    prompts = random_prompts([13, 30], tiny_model.config.vocab_size, seed=12)
    steps = [([[40, 61, 62, 63], [41], prompts[0], prompts[1][:18]], [3, 0, 0, 0], [4, 1, 1, 0], [2, 0, 0, 0]),
             ([[42, 64], [43], [44], prompts[1][18:]], [1, 0, 0, 0], [2, 1, 1, 1], [0, 0, 0, 0]),
             ([[45], [46], [47], [48]], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0])]
    outputs = []
    for executor, seqs in ((eager, seqs_e), (padded, seqs_p)):
        group = seqs[:2] + [Sequence(10, list(prompts[0]), 13), Sequence(11, list(prompts[1]), 30)]
        results = []
        for chunks, drafts, want, accepted in steps:
            hidden, logits = executor.forward(group, chunks, drafts, logits=want)
            bucket = executor.runner.graphs.bucket_for(executor.plan(group, chunks, drafts, want)) if executor.runner.graphs else None
            results.append((hidden.clone(), logits.clone(), bucket, executor.runner.last_outputs[0].shape[0]))
            for seq, chunk, d, a in zip(group, chunks, drafts, accepted):
                seq.num_cached += len(chunk) - d + a                # the rejected drafts' rows roll back
                seq.gdn_read_offset = a                             # the next step replays the accepted ones
        outputs.append((results, [s.gdn_slot for s in group]))
    (results_e, slots), (results_p, _) = outputs
    assert all(padded.runner.graphs.is_mixed(bucket) for _, _, bucket, _ in results_p[:2])
    assert [rows for *_, rows in results_p] == [256, 256, 4]              # it really ran padded
    for (h_e, l_e, _, _), (h_p, l_p, _, _) in zip(results_e, results_p):
        torch.testing.assert_close(l_p, l_e, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h_p, h_e, atol=1e-5, rtol=1e-5)
    assert_caches_equal(eager, padded, slots)


def test_padding_touches_only_scratch_rows(tiny_model):
    (_, padded), (_, seqs) = prefilled_pair(tiny_model)
    idle = seqs[3].gdn_slot
    before_rec = [r[idle].clone() for r in padded.runner.caches.gdn.recurrent + padded.runner.caches.gdn.pending]
    before_kv = [k.clone() for k in padded.runner.caches.kv.k]
    padded.forward(seqs[:3], [[1, 2], [3], [4, 5, 6]], [1, 0, 2], logits=[2, 1, 3])    # bucket of 4 sequences
    for r, before in zip(padded.runner.caches.gdn.recurrent + padded.runner.caches.gdn.pending, before_rec):
        assert torch.equal(r[idle], before)
    used = {b for s in seqs[:3] for b in s.block_table} | {padded.runner.caches.kv.scratch_block}
    untouched = [b for b in range(padded.runner.caches.kv.num_blocks + 1) if b not in used]
    for k, before in zip(padded.runner.caches.kv.k, before_kv):
        assert torch.equal(k[untouched], before[untouched])


@pytest.mark.parametrize("max_seqs", [5, 1], ids=["batch", "one-at-a-time"])
def test_greedy_with_padded_buckets_equals_eager(tiny_model, max_seqs):
    """One at a time, every prompt is prefilled in a prefill bucket."""
    prompts = random_prompts([3, 7, 1, 12, 5, 40], tiny_model.config.vocab_size, seed=4)
    eager = Executor.build(tiny_model, num_blocks=64, block_size=4, max_seqs=max_seqs)
    padded = Executor.build(tiny_model, num_blocks=64, block_size=4, max_seqs=max_seqs)
    padded.runner.use_graphs(capture=False)
    expected = [greedy_generate(eager, prompts[i:i + max_seqs], 12) for i in range(0, len(prompts), max_seqs)]
    assert [greedy_generate(padded, prompts[i:i + max_seqs], 12) for i in range(0, len(prompts), max_seqs)] == \
        expected


@pytest.mark.parametrize("kind", ["mtp", "all-reject"])
def test_speculative_with_padded_buckets_equals_plain(tiny_model, kind):
    prompts = random_prompts([3, 7, 12, 5, 9], tiny_model.config.vocab_size, seed=5)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (14, 9, 17, 11, 6)]
    expected = make_engine(tiny_model).generate(prompts, params)
    drafter = make_drafter(kind, tiny_model, 3, [p + e for p, e in zip(prompts, expected)])
    engine = make_engine(tiny_model, drafter, 3)
    engine.executor.runner.use_graphs(capture=False)
    assert engine.generate(prompts, params) == expected
    assert engine.stats.drafted > 0


def test_prompts_entering_beside_decoding_sequences_run_in_mixed_buckets(tiny_model):
    """More requests than running slots: later prompts enter in chunks of 8 beside sequences that verify MTP
    drafts, in mixed buckets (padded, no capture), and the output equals plain decoding."""
    prompts = random_prompts([3, 7, 12, 5, 9, 20, 4, 15], tiny_model.config.vocab_size, seed=9)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (14, 9, 17, 11, 6, 10, 8, 12)]
    expected = make_engine(tiny_model).generate(prompts, params)
    engine = make_engine(tiny_model, make_drafter("mtp", tiny_model, 3), 3, max_running=3)
    engine.executor.runner.use_graphs(capture=False)
    graphs, buckets = engine.executor.runner.graphs, []
    run = graphs.run
    graphs.run = lambda plan, bucket, before=None: buckets.append(bucket) or run(plan, bucket, before)
    assert engine.generate(prompts, params) == expected
    assert sum(map(graphs.is_mixed, buckets)) >= 5 and engine.stats.drafted > 0


# ---- GPU: captured graphs replayed ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mtp", "all-accept", "all-reject"])
def test_gpu_graphs_speculative_equals_eager_plain(tmp_path, kind):
    """fp32 on CUDA: spec decoding with CUDA graphs equals plain decoding with graphs off (same kernels)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), device="cuda")
    prompts = random_prompts([3, 7, 12, 20, 5, 9, 30, 1, 4], loaded.config.vocab_size, seed=6)
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * len(prompts)
    plain = make_engine(loaded, max_running=16)
    plain.executor.runner.graphs = None                                  # eager reference
    expected = plain.generate(prompts, params)
    drafter = make_drafter(kind, loaded, 3, [p + e for p, e in zip(prompts, expected)])
    engine = make_engine(loaded, drafter, 3, max_running=16)
    assert engine.executor.runner.graphs is not None and engine.executor.runner.graphs.graphs
    assert engine.generate(prompts, params) == expected


@pytest.mark.gpu
def test_gpu_prompts_alone_replay_prefill_graphs_and_decode_as_eager(tmp_path):
    """fp32 on CUDA, requests one at a time: each prompt chunk replays a prefill graph in the verifier (and, with
    the MTP head, in its catch-up), and the output equals plain decoding with graphs off. Both engines are built
    before either runs: a runner built after another must leave the first one's graphs valid (it once fused the
    shared weights again, and the first runner's graphs read freed memory)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), device="cuda")
    prompts = random_prompts([5, 40, 130, 200, 3], loaded.config.vocab_size, seed=7)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    plain = make_engine(loaded, max_running=1, chunk=256, budget=512)
    plain.executor.runner.graphs = None                                  # eager reference
    expected = plain.generate(prompts, params)
    drafter = make_drafter("mtp", loaded, 3)
    engines = (make_engine(loaded, max_running=1, chunk=256, budget=512),
               make_engine(loaded, drafter, 3, max_running=1, chunk=256, budget=512))
    for engine in engines:
        replayed = []
        for graphs in (engine.executor.runner.graphs, drafter.loop.graphs if engine.drafter else None):
            if graphs is not None:
                run = graphs.run
                graphs.run = lambda plan, bucket, before=None, g=graphs, run=run: (
                    replayed.append((g is engine.executor.runner.graphs, g.is_prefill(bucket))) or run(plan, bucket, before))
        assert engine.generate(prompts, params) == expected
        longer = sum(len(p) > engine.executor.runner.graphs.tokens_per_seq[-1] for p in prompts)   # 3 tokens: a verify bucket
        assert sum(verifier and prefill for verifier, prefill in replayed) == longer
        if engine.drafter:
            assert sum(not verifier and prefill for verifier, prefill in replayed) >= 3     # 40, 130, 200 at least


@pytest.mark.gpu
def test_gpu_prompts_beside_decoding_sequences_replay_mixed_graphs(tmp_path):
    """fp32 on CUDA, more requests than running slots: prompts enter several at once and beside sequences that
    decode or verify MTP drafts, each such step replays a mixed graph, and the output equals plain decoding with
    graphs off. Both engines are built before either runs (a later runner must leave the first one's graphs
    valid)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), device="cuda")
    prompts = random_prompts([5, 40, 130, 200, 3, 70, 90, 17, 250, 33], loaded.config.vocab_size, seed=8)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 20, 8, 16, 24, 10, 14, 9, 11, 18)]
    plain = make_engine(loaded, max_running=4, chunk=256, budget=512)
    plain.executor.runner.graphs = None                                  # eager reference
    expected = plain.generate(prompts, params)
    engines = (make_engine(loaded, max_running=4, chunk=256, budget=512),
               make_engine(loaded, make_drafter("mtp", loaded, 3), 3, max_running=4, chunk=256, budget=512))
    for engine in engines:
        graphs, mixed = engine.executor.runner.graphs, []
        assert graphs is not None and any(map(graphs.is_mixed, graphs.graphs))
        run = graphs.run
        graphs.run = lambda plan, bucket, before=None, g=graphs, run=run: (
            mixed.append(g.is_mixed(bucket)) or run(plan, bucket, before))
        assert engine.generate(prompts, params) == expected
        assert sum(mixed) >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_gpu_fast_path_greedy_equals_cpu_torch_path(tmp_path, family):
    """fp32: Triton kernels + CUDA graphs on the GPU give the greedy tokens of the torch path on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    path = make_tiny(tmp_path, family=family, seed=1, progress=False)
    prompts = random_prompts([3, 17, 1, 70, 9], 200, seed=7)   # 70: the chunked prefill path
    cpu = Executor.build(load_model(path), num_blocks=128, block_size=4, max_seqs=8)
    gpu = Executor.build(load_model(path, device="cuda"), num_blocks=128, block_size=4, max_seqs=8, device="cuda")
    assert gpu.runner.graphs is not None
    assert greedy_generate(gpu, prompts, 24) == greedy_generate(cpu, prompts, 24)


def test_enforce_eager_reaches_the_model_runner(tiny_dir, monkeypatch):
    """`specdec serve --enforce-eager` → verifier argv → VerifierConfig → ModelRunner(enforce_eager=True)."""
    from specdec_tools.cli import build_parser
    from specdec_tools.commands.serve_cmd import stack_config
    from verifier_service import server
    stack = stack_config(build_parser().parse_args(["serve", "--model", str(tiny_dir), "--enforce-eager"]), 0)
    verifier_args = build_parser().parse_args(["verifier", "--model", str(tiny_dir), *stack.verifier_args])
    seen = {}
    monkeypatch.setattr(server, "serve", lambda config, host, port, make_drafter=None: seen.update(config=config))
    verifier_args.run(verifier_args)
    assert seen["config"].enforce_eager
    runner = server.build_engine(seen["config"]).executor.runner
    assert runner.graphs is None
    plain = stack_config(build_parser().parse_args(["serve", "--model", str(tiny_dir)]), 0)
    assert "--enforce-eager" not in plain.verifier_args
