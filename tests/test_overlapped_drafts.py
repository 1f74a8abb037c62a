"""Overlapped steps with drafts: with an in-process drafter that drafts on the device (MTP), step n + 1 verifies the
drafts made from step n's unread verdict; its input ids come from that verdict and its positions, KV rows and GDN
read offsets move by the accepted counts on the device. Greedy output must equal plain decoding through every
accepted count, admissions, chunked prefill, stops, preemption, aborts, a full context and a switch to
synchronous steps (penalties); seeded sampled requests run overlapped too and must equal plain decoding."""
import pytest
import torch
from device_reference_drafter import DeviceReferenceDrafter
from engine_factory import BLOCK, make_drafter, make_engine, random_prompts, synchronous_launches
from test_overlapped_steps import run

from specdec.drafting import DraftOutput
from specdec.sampling_params import SamplingParams
from verifier_service.in_flight import InFlightStep

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def demo():
    from specdec.demo import demo_model_dir
    from specdec.models.loader import load_model
    from tokenizers import Tokenizer
    loaded = load_model(demo_model_dir())
    tokenizer = Tokenizer.from_file(demo_model_dir() + "/tokenizer.json")
    texts = ["def fibonacci(n):", "import os\n", "class Foo:\n    def __init__(self", "for i in range(10):",
             "    return self._", "def main():\n    args = ", "x = [", "with open(path) as f:\n"]
    return loaded, [tokenizer.encode(t).ids for t in texts]


def requests_of(prompts, max_tokens, **params):
    return {f"r{i}": (p, SamplingParams(max_tokens=n, ignore_eos=True, **params))
            for i, (p, n) in enumerate(zip(prompts, max_tokens))}


def plain(loaded, requests, **engine_kwargs):
    return run(make_engine(loaded, overlap=False, **engine_kwargs), requests)


def accepted_counts(monkeypatch) -> list[int]:
    """Every accepted count an overlapped step read (spied on InFlightStep.read)."""
    seen, read = [], InFlightStep.read

    def spy(self):
        results = read(self)
        seen.extend(r.num_accepted for r in results)
        return results
    monkeypatch.setattr(InFlightStep, "read", spy)
    return seen


def verify_log(engine) -> dict:
    """{(request, tokens before the step): (drafts verified, accepted)} of every verify step `engine` commits."""
    log, commit = {}, engine.requests.commit

    def spy(p, tokens, num_accepted, logprobs, stats):
        if p.decoding:
            log[(p.seq.request_id, len(p.seq.token_ids))] = (p.num_drafts, num_accepted)
        return commit(p, tokens, num_accepted, logprobs, stats)
    engine.requests.commit = spy
    return log


def reference_engine(loaded, requests, expected, k, **engine_kwargs):
    """An overlapping engine whose device drafter follows the plain output (accepting (q // 2) % (k + 1) drafts at next position q)."""
    drafter = DeviceReferenceDrafter(k, loaded.config.vocab_size, loaded.model.embed_tokens.weight.device)
    engine = make_engine(loaded, drafter, k, **engine_kwargs)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        drafter.follow(engine.by_request[rid].seq_id, prompt + expected[rid][0])
    return engine


def run_added(engine, requests, **kwargs):
    """run() over requests already added to the engine; checks the engine's counts agree with what it emitted."""
    out = {rid: ([], None) for rid in requests}
    step = 0
    while engine.has_work:
        if step in kwargs.get("abort_after", {}):
            rid = kwargs["abort_after"][step]
            assert engine.abort(rid)
            out[rid] = (out[rid][0], "abort")
        for o in engine.step():
            tokens, reason = out[o.request_id]
            assert reason is None, f"{o.request_id} got output after it ended"
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
        step += 1
    if all(reason == "length" for _, reason in out.values()):   # (a stop cuts accepted drafts off)
        assert_counts_add_up(engine)
    return out


def assert_counts_add_up(engine):
    """One recovered or bonus token per verify step besides the accepted drafts: no accepted draft is counted
    that the request did not emit (a step near max_tokens verifies no more drafts than tokens it may emit)."""
    s = engine.stats
    assert s.emitted == s.verify_steps + s.accepted and s.accepted <= s.drafted


def test_tokens_and_drafts_are_read_one_step_late(demo):
    loaded, prompts = demo
    engine = make_engine(loaded, make_drafter("mtp", loaded, 3), 3, chunk=64)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=30, ignore_eos=True))
    assert engine.step() == []                   # the prompt ran and sampled; its token and drafts are on the device
    seq = engine.by_request["a"]
    assert seq.unread_steps == 1
    assert [len(o.new_token_ids) for o in engine.step()] == [1]   # read while the first verify step runs
    assert seq.unread_steps == 1 and engine.overlapped_draft_steps == 1 and engine.stats.drafted == 0
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    assert 1 <= len(tokens) <= 4                 # the first verify step: accepted drafts and one more
    assert engine.stats.drafted == 3             # its three drafts came from the device


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_overlapped_mtp_equals_plain_decoding(demo, k, monkeypatch):
    loaded, prompts = demo
    # 8 requests on 3 places, prefill chunks of 8 sharing steps with verifies (budget 20): admissions mid-run
    requests = requests_of(prompts, [40, 9, 33, 27, 45, 21, 14, 30])
    kwargs = dict(max_running=3, chunk=8, budget=20)
    expected = plain(loaded, requests, **kwargs)
    synchronous = make_engine(loaded, make_drafter("mtp", loaded, k), k, overlap=False, **kwargs)
    sync_log = verify_log(synchronous)
    assert run(synchronous, requests) == expected
    seen = accepted_counts(monkeypatch)
    engine = make_engine(loaded, make_drafter("mtp", loaded, k), k, **kwargs)
    log = verify_log(engine)
    assert run(engine, requests) == expected
    assert_counts_add_up(engine)
    assert engine.overlapped_draft_steps > 10 and engine.stats.accepted > 0
    assert max(seen) == k                         # the trained MTP head is accepted all the way at times
    # the drafter chained on the device drafts what it drafts from the host's tokens: wherever both engines
    # verified as many drafts at the same point of a request, as many were accepted (near a request's end the
    # overlapped engine may draft fewer, not knowing yet how far the unread step went)
    same = [key for key in log if key in sync_log and log[key][0] == sync_log[key][0]]
    assert len(same) > 0.8 * len(sync_log)
    assert [log[key] for key in same] == [sync_log[key] for key in same]
    assert engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size and engine.executor.blocks.gdn_slots.num_free == 3
    assert engine.drafter.tables.blocks.num_free == engine.drafter.tables.blocks.size


@pytest.mark.parametrize("k", [3, 4])
def test_every_accepted_count_moves_the_next_step(tiny_model, k, monkeypatch):
    prompts = random_prompts([3, 11, 6, 20, 1], tiny_model.config.vocab_size, seed=4)
    requests = requests_of(prompts, [30, 25, 33, 18, 40])
    expected = plain(tiny_model, requests)
    seen = accepted_counts(monkeypatch)
    engine = reference_engine(tiny_model, requests, expected, k)
    assert run_added(engine, requests) == expected
    assert set(seen) == set(range(k + 1))         # each count, bonus included, was read from an overlapped step
    assert engine.overlapped_draft_steps > 5 and engine.drafter.calls == engine.step_count


def test_overlapped_drafts_through_preemption(tiny_model, monkeypatch):
    # 20 KV blocks of 4 tokens hold 80 tokens; five requests need about 5 x 40: the last admitted are preempted
    prompts = random_prompts([10, 7, 12, 9, 5], tiny_model.config.vocab_size, seed=2)
    requests = requests_of(prompts, [30, 28, 26, 30, 24])
    expected = plain(tiny_model, requests)
    engine = reference_engine(tiny_model, requests, expected, 3, num_blocks=20, max_running=5)
    assert run_added(engine, requests) == expected
    assert engine.scheduler.num_preemptions > 0 and engine.overlapped_draft_steps > 0
    assert engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size


def test_stops_inside_accepted_drafts_drop_the_step_after(tiny_model):
    prompts = random_prompts([4, 11, 6], tiny_model.config.vocab_size, seed=5)
    free = plain(tiny_model, requests_of(prompts, [30, 30, 30]))
    # each stops at the token it emits 7th, usually inside a run of accepted drafts
    stopping = {rid: (prompts[i], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[free[rid][0][6]]))
                for i, rid in enumerate(free)}
    expected = {rid: (tokens[:tokens.index(stopping[rid][1].stop_token_ids[0]) + 1], "stop")
                for rid, (tokens, _) in free.items()}
    engine = reference_engine(tiny_model, stopping, free, 3)
    assert run_added(engine, stopping) == expected
    assert not engine.has_work and engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size


def test_abort_while_a_step_with_drafts_is_running(tiny_model):
    prompts = random_prompts([6, 6, 6], tiny_model.config.vocab_size, seed=6)
    requests = requests_of(prompts, [24, 24, 24])
    expected = plain(tiny_model, requests)
    engine = reference_engine(tiny_model, requests, expected, 3)
    out = run_added(engine, requests, abort_after={4: "r1"})
    assert out["r0"] == expected["r0"] and out["r2"] == expected["r2"]
    assert out["r1"][1] == "abort" and expected["r1"][0][:len(out["r1"][0])] == out["r1"][0]
    assert not engine.has_work and engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size


def test_a_request_that_fills_the_context_exactly(tiny_model):
    # 10 blocks x 4 = 40 tokens: prompt 17 + 23 new tokens. Near the end the unread step may have accepted all
    # its drafts, so a sequence drafts only what fits in any case (and waits a step when nothing does).
    requests = requests_of(random_prompts([17], tiny_model.config.vocab_size, seed=7), [23])
    expected = plain(tiny_model, requests, num_blocks=10, max_running=1)
    engine = reference_engine(tiny_model, requests, expected, 4, num_blocks=10, max_running=1)
    assert engine.max_len == 10 * BLOCK
    assert run_added(engine, requests) == expected


def test_mtp_out_of_blocks_drops_sequences_and_stays_exact(demo, caplog):
    from drafter_service.mtp.mtp_drafter import MTPDrafter
    loaded, prompts = demo
    requests = requests_of(prompts, [40, 9, 33, 27, 45, 21, 14, 30])
    expected = plain(loaded, requests)
    drafter = MTPDrafter(loaded, 3, num_blocks=12, block_size=BLOCK)
    engine = make_engine(loaded, drafter, 3)
    assert run(engine, requests) == expected
    assert "dropped by the mtp drafter" in caplog.text      # the others drafted on in the same steps
    assert drafter.dropped == set() and drafter.tables.blocks.num_free == 12
    assert engine.stats.accepted > 0 and engine.overlapped_draft_steps > 0


SAMPLED = [dict(temperature=0.9), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=20),
           dict(temperature=0.8, min_p=0.05), dict(), dict(temperature=1.2, top_k=50, top_p=0.95)]


def sampled_requests(prompts, max_tokens):
    return {f"r{i}": (p, SamplingParams(max_tokens=n, ignore_eos=True, seed=100 + i, **SAMPLED[i % len(SAMPLED)]))
            for i, (p, n) in enumerate(zip(prompts, max_tokens))}





@pytest.mark.parametrize("k", [1, 3])
def test_sampled_requests_run_overlapped_steps_equal_to_synchronous_and_plain(demo, k):
    """Temperature, top-k, top-p and min-p requests (one greedy among them) draft and verify in overlapped steps
    only; their seeded tokens equal the synchronous engine's and plain decoding's (the coupled draw keyed by
    output position, which the device counts on from the unread verdict)."""
    loaded, prompts = demo
    requests = sampled_requests(prompts[:6], [30, 17, 25, 40, 9, 33])
    expected = plain(loaded, requests)
    assert run(make_engine(loaded, make_drafter("mtp", loaded, k), k, overlap=False), requests) == expected
    engine = make_engine(loaded, make_drafter("mtp", loaded, k), k)
    synchronous = synchronous_launches(engine)
    assert run(engine, requests) == expected
    assert synchronous == [] and engine.overlapped_draft_steps > 0 and engine.stats.accepted > 0


def test_sampled_requests_preempted_with_a_step_unread_stay_exact(demo):
    """Few KV blocks: sequences are preempted while their last step is unread, and prefill again from the
    read tokens; the seeded output still equals plain decoding."""
    loaded, prompts = demo
    requests = sampled_requests(prompts, [40, 9, 33, 27, 45, 21, 14, 30])
    engine = make_engine(loaded, make_drafter("mtp", loaded, 3), 3, num_blocks=24)
    preempted, preempt = [], engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq, *a: preempted.append(seq.unread_steps) or preempt(seq, *a)
    assert run(engine, requests) == plain(loaded, requests)
    assert any(preempted) and engine.overlapped_draft_steps > 0


def test_a_penalised_request_switches_to_synchronous_steps_and_back(demo):
    loaded, prompts = demo
    requests = requests_of(prompts[:3], [30, 30, 30])
    penalised = ("s", prompts[5], SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True,
                                                 repetition_penalty=1.3))
    reference = run(make_engine(loaded, make_drafter("mtp", loaded, 3), 3, overlap=False), requests,
                    add_later={3: penalised})
    engine = make_engine(loaded, make_drafter("mtp", loaded, 3), 3)
    synchronous = synchronous_launches(engine)
    assert run(engine, requests, add_later={3: penalised}) == reference   # seeded sampling: keyed by position
    assert engine.overlapped_draft_steps > 0 and synchronous
    assert {rid: out for rid, out in reference.items() if rid != "s"} == plain(loaded, requests)


# ---- GPU: graphs replayed, the verdict, drafts and shifts written into the graphs' inputs on the device -------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["reference", "mtp"])
def test_gpu_overlapped_drafts_equal_synchronous_steps(tmp_path, cuda, dtype, kind):
    """CUDA graphs on both engines. fp32: both equal plain decoding. bf16: the overlapped engine equals the
    synchronous one (the same kernels, one request at a time so that both run the same graph buckets)."""
    import torch

    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), dtype=getattr(torch, dtype), device=cuda)
    prompts = random_prompts([3, 7, 12, 20, 5, 9, 30, 1, 4, 17, 2, 6], loaded.config.vocab_size, seed=6)
    requests = requests_of(prompts, [8 + 3 * i for i in range(len(prompts))])
    kwargs = dict(max_running=8) if dtype == "float32" else dict(max_running=1)
    expected = plain(loaded, requests, **kwargs)
    results = []
    for overlap in (True, False):
        if kind == "reference":
            engine = reference_engine(loaded, requests, expected, 3, overlap=overlap, **kwargs)
            out = run_added(engine, requests)
        else:
            engine = make_engine(loaded, make_drafter("mtp", loaded, 3), 3, overlap=overlap, **kwargs)
            out = run(engine, requests)
        assert engine.executor.runner.graphs is not None and engine.executor.runner.graphs.graphs
        assert (engine.overlapped_draft_steps > 0) == overlap
        results.append(out)
    assert results[0] == results[1]
    if dtype == "float32":
        assert results[0] == expected


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_sampled_requests_overlapped_equal_synchronous_steps(tmp_path, cuda, dtype):
    """Sampled requests (temperature, top-k, top-p, min-p) with the MTP drafter, CUDA graphs, the one-launch
    sampler: overlapped steps only, the same seeded tokens as synchronous steps (fp32: and as plain decoding)."""
    import torch

    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), dtype=getattr(torch, dtype), device=cuda)
    prompts = random_prompts([3, 7, 12, 20, 5, 9, 30, 1, 4, 17, 2, 6], loaded.config.vocab_size, seed=6)
    requests = sampled_requests(prompts, [8 + 3 * i for i in range(len(prompts))])
    kwargs = dict(max_running=8) if dtype == "float32" else dict(max_running=1)
    results = []
    for overlap in (True, False):
        engine = make_engine(loaded, make_drafter("mtp", loaded, 3), 3, overlap=overlap, **kwargs)
        synchronous = synchronous_launches(engine)
        results.append(run(engine, requests))
        assert engine.executor.runner.graphs is not None and engine.executor.runner.graphs.graphs
        assert (synchronous == []) == overlap and (engine.overlapped_draft_steps > 0) == overlap
    assert results[0] == results[1]
    if dtype == "float32":
        assert results[0] == plain(loaded, requests, **kwargs)


class ReferenceWithQ(DeviceReferenceDrafter):
    """Drafts on the device (one-hot) and, in synchronous steps, also sends its distribution q."""

    def propose(self, batch):
        out = super().propose(batch)
        rows = sum(len(d) for d in out.drafts)
        q = torch.full((rows, self.vocab), 1.0 / self.vocab)
        return DraftOutput(drafts=out.drafts, probs=q)


def test_overlapped_steps_never_verify_with_a_q_from_a_synchronous_step(tiny_model, monkeypatch):
    """A drafter that sends q in synchronous steps and drafts one-hot on the device: once the steps overlap again,
    no verdict takes the min(1, p/q) path with the q of an earlier step (the drafts it verifies are not that q's)."""
    import verifier_service.verify_stage as verify_stage
    k, vocab = 3, tiny_model.config.vocab_size
    prompts = random_prompts([6, 9], vocab, seed=21)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    penalised = SamplingParams(max_tokens=4, temperature=0.8, seed=4, repetition_penalty=1.2, ignore_eos=True)
    expected = make_engine(tiny_model).generate(prompts, [sampled, penalised])
    drafter = ReferenceWithQ(k, vocab)
    engine = make_engine(tiny_model, drafter, k)
    for i, (prompt, params) in enumerate(zip(prompts, [sampled, penalised])):
        engine.add_request(f"r{i}", prompt, params)
        drafter.follow(engine.by_request[f"r{i}"].seq_id, prompt + expected[i])
    seen, launching, real = [], [None], verify_stage.sample

    def spy(logits, rows, sampling, draft_probs=None, forced_accepts=None, token_masks=None):
        seen.append((launching[0], draft_probs is not None))    # (overlapped launch, verified with a q)
        return real(logits, rows, sampling, draft_probs, forced_accepts, token_masks=token_masks)
    monkeypatch.setattr(verify_stage, "sample", spy)
    launch = engine._launch

    def launch_spy(entries, previous, overlap):
        launching[0] = overlap
        return launch(entries, previous, overlap)
    engine._launch = launch_spy
    while engine.has_work:
        engine.step()
    assert any(q for _, q in seen) and any(o for o, _ in seen)   # q in synchronous steps, overlapped ones later
    assert not any(o and q for o, q in seen), seen

