"""The replay bound of a step (how many accepted drafts a sequence may fold into its GDN state first): an engine
with a drafter keeps a second CUDA graph of its single-token buckets up to 16 sequences, for steps where no
sequence replays any (the recurrent GDN kernel's single-token launch config); the bound reaches every GDN layer;
an overlapped step counts what the unread verdict moves on the device."""
import pytest
import torch
from engine_factory import random_prompts
from test_graph_runner import plan_of, prefilled_pair
from test_overlapped_drafts import plain, reference_engine, requests_of, run_added

from specdec.models.graph_bucket import Bucket
from verifier_service.executor import Executor

pytestmark = pytest.mark.timeout(300)


def test_single_token_steps_replaying_no_drafts_take_their_own_graphs(tiny_model):
    """An engine with a drafter keeps two graphs of each single-token bucket: one for steps where no sequence
    replays accepted drafts into its GDN state (the recurrent kernel's single-token launch config), one where
    some may; a plain engine, whose steps never replay, keeps one. A batch with replays does not fit the no-replay
    graph, and each graph's batch tells the GDN layers the bound."""
    speculating = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=8, max_drafts=3)
    plain_engine = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=8)
    for executor in (speculating, plain_engine):
        executor.runner.use_graphs(capture=False)
    graphs = speculating.runner.graphs
    replaying = plan_of([1, 1, 1])
    replaying.gdn_read_offsets[1] = 2                                           # accepted 2 drafts last step
    assert graphs.bucket_for(replaying) == Bucket.uniform(4, 1)
    assert graphs.bucket_for(plan_of([1, 1, 1])) == Bucket.uniform(4, 1, 0)
    assert plain_engine.runner.graphs.bucket_for(plan_of([1, 1, 1])) == Bucket.uniform(4, 1)
    single = [b for b in graphs.buckets() if b.max_seqlen == 1 and b.seqs in graphs.batch_buckets]
    assert set(single) == {Bucket.uniform(b, 1, r) for b in (1, 2, 4, 8) for r in (None, 0)} and len(single) == 8
    wide = Executor.build(tiny_model, num_blocks=16, block_size=4, max_seqs=64, max_drafts=3)
    wide.runner.use_graphs(capture=False)       # above 16 sequences the kernel pipelines single tokens either way
    assert sorted(wide.runner.graphs.no_replay_seqs) == [1, 2, 4, 8, 16]
    assert sum(b.max_replays == 0 for b in wide.runner.graphs.buckets()) == 5
    assert [b for b in plain_engine.runner.graphs.buckets() if b.max_replays is not None] == []
    with pytest.raises(ValueError, match="2 replays"):
        graphs.staging.stage(replaying, Bucket.uniform(4, 1, 0))
    staged = {r: graphs.staging.stage(plan, Bucket.uniform(4, 1, r)).max_replays
              for r, plan in ((None, replaying), (0, plan_of([1, 1, 1])))}
    assert staged == {None: None, 0: 0}


def test_the_gdn_layers_see_the_steps_replay_bound(tiny_model, monkeypatch):
    """Each GDN layer hands the recurrent kernel the step's replay bound: eager steps the most accepted drafts a
    sequence replays, padded single-token steps 0 in the no-replay graph and None (whatever the ring holds) in the
    other; the outputs do not depend on it."""
    import specdec.models.gated_deltanet as gdn
    seen = []
    real = gdn.gated_delta_rule
    monkeypatch.setattr(gdn, "gated_delta_rule", lambda *a, **kw: seen.append(kw["max_replays"]) or real(*a, **kw))
    (eager, padded), (seqs_e, seqs_p) = prefilled_pair(tiny_model)
    num_layers = sum(layer_type == "linear_attention" for layer_type in tiny_model.config.layer_types)
    bounds, logits = [], []
    for executor, seqs in ((eager, seqs_e), (padded, seqs_p)):
        for offsets in ([0, 0, 0], [0, 2, 1]):   # the ring rows replayed: alike in both
            for seq, j in zip(seqs, offsets):
                seq.gdn_read_offset = j
            seen.clear()
            logits.append(executor.forward(seqs[:3], [[40], [41], [42]], [0, 0, 0])[1])
            assert len(seen) == num_layers and len(set(seen)) == 1
            bounds.append(seen[0])
            for seq in seqs[:3]:
                seq.num_cached += 1
    assert bounds == [0, 2, 0, None]
    for step in range(2):
        torch.testing.assert_close(logits[2 + step], logits[step], atol=1e-4, rtol=1e-4)


def test_a_single_token_step_after_an_unread_verify_takes_the_graph_that_replays(tiny_model):
    """A single-token step launched over an unread verify step replays that step's accepted drafts, which only the
    device knows: it must not take the no-replay graph of its bucket (the GDN kernel's launch config for steps
    where no sequence replays). Steps near a request's end verify fewer drafts, down to none."""
    prompts = random_prompts([3, 11, 6, 20], tiny_model.config.vocab_size, seed=6)
    requests = requests_of(prompts, [12, 9, 14, 7])
    expected = plain(tiny_model, requests)
    engine = reference_engine(tiny_model, requests, expected, 3)
    engine.executor.runner.use_graphs(capture=False)
    graphs, steps = engine.executor.runner.graphs, []
    run_graph = graphs.run

    def spy(plan, bucket, before=None):
        batch, outputs = run_graph(plan, bucket, before)
        steps.append((bucket, int(batch.gdn_read_offsets.max())))   # after `before` moved them on the device
        return batch, outputs
    graphs.run = spy
    assert run_added(engine, requests) == expected
    single = [(bucket.max_replays, replays) for bucket, replays in steps if bucket.max_seqlen == 1]
    assert any(bound is None and replays > 0 for bound, replays in single)   # the case happened: host offsets 0
    assert all(replays <= bound for bound, replays in single if bound is not None)
