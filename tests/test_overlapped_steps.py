"""Overlapped steps: without drafts and with argmax-only requests, step n + 1 is launched before step n's tokens
are read, and its sequences take their last token from the device. Output must equal the synchronous engine's
through admissions, chunked prefill, stops, preemption, aborts, a full context and a switch to sampling."""
import pytest
from engine_factory import BLOCK, make_engine, random_prompts, synchronous_launches

from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)


def run(engine, requests, abort_after=None, add_later=None):
    """Step `engine` to the end. requests: {rid: (prompt, params)}; abort_after: {step: rid};
    add_later: {step: (rid, prompt, params)}. Returns {rid: (tokens, finish_reason)}."""
    out = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        out[rid] = ([], None)
    step = 0
    while engine.has_work or step in (add_later or {}):
        if step in (add_later or {}):
            rid, prompt, params = add_later[step]
            engine.add_request(rid, prompt, params)
            out[rid] = ([], None)
        if step in (abort_after or {}):
            assert engine.abort(abort_after[step])
            out[abort_after[step]] = (out[abort_after[step]][0], "abort")
        for o in engine.step():
            tokens, reason = out[o.request_id]
            assert reason is None, f"{o.request_id} got output after it ended"
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason)
        step += 1
    return out


def both(tiny_model, requests, **kwargs):
    """The same run on an overlapping and a synchronous engine (same runner options)."""
    engine_kwargs = {k: kwargs.pop(k) for k in ("num_blocks", "max_running", "chunk", "budget") if k in kwargs}
    results = []
    for overlap in (True, False):
        engine = make_engine(tiny_model, overlap=overlap, **engine_kwargs)
        results.append((run(engine, requests, **kwargs), engine))
    return results


def greedy_requests(tiny_model, lengths, max_tokens, **params):
    prompts = random_prompts(lengths, tiny_model.config.vocab_size, seed=3)
    return {f"r{i}": (p, SamplingParams(max_tokens=n, ignore_eos=True, **params))
            for i, (p, n) in enumerate(zip(prompts, max_tokens))}


def test_tokens_are_read_one_step_late(tiny_model):
    prompt = random_prompts([5], tiny_model.config.vocab_size)[0]
    for overlap, first_tokens in ((True, []), (False, 1)):
        engine = make_engine(tiny_model, overlap=overlap)
        engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        first = engine.step()   # the whole prompt in one chunk: it samples the first token
        if overlap:
            assert first == [] and engine.by_request["a"].unread_steps == 1
            assert [len(o.new_token_ids) for o in engine.step()] == [1]   # read while the second step runs
        else:
            assert [len(o.new_token_ids) for o in first] == [first_tokens]


def test_overlapped_greedy_equals_synchronous_with_admissions_and_chunked_prefill(tiny_model):
    # 7 requests on 3 running places, prompts of 1 to 4 chunks of 8 tokens (budget 20: prefill shares steps)
    requests = greedy_requests(tiny_model, [3, 30, 9, 17, 1, 24, 8], [9, 4, 13, 1, 7, 5, 11])
    (overlapped, engine), (synchronous, _) = both(tiny_model, requests, max_running=3, budget=20)
    assert overlapped == synchronous
    assert all(reason == "length" and len(tokens) == requests[rid][1].max_tokens
               for rid, (tokens, reason) in overlapped.items())
    assert engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size and engine.executor.blocks.gdn_slots.num_free == 3


def test_overlapped_stops_match_and_drop_the_step_after_the_stop(tiny_model):
    requests = greedy_requests(tiny_model, [4, 11, 6], [20, 20, 20])
    free_run = run(make_engine(tiny_model, overlap=False), requests)
    # each request stops at the token it emits fifth (a stop token id): the overlapped engine has already
    # launched the step after it, whose token must be dropped
    stopped = {rid: (prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[free_run[rid][0][4]]))
               for rid, (prompt, _) in requests.items()}
    (overlapped, engine), (synchronous, _) = both(tiny_model, stopped)
    assert overlapped == synchronous
    assert all(reason == "stop" and len(tokens) <= 5 for tokens, reason in overlapped.values())
    assert engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size


def test_overlapped_preemption_equals_synchronous(tiny_model):
    # 16 KV blocks of 4 tokens hold 64 tokens; four requests need 4 x 26: the last admitted is preempted
    requests = greedy_requests(tiny_model, [10, 7, 12, 9], [16, 16, 14, 16])
    (overlapped, engine), (synchronous, reference) = both(tiny_model, requests, num_blocks=16, max_running=4)
    assert engine.scheduler.num_preemptions > 0 and reference.scheduler.num_preemptions > 0
    assert overlapped == synchronous


def test_abort_while_a_step_is_running(tiny_model):
    requests = greedy_requests(tiny_model, [6, 6, 6], [12, 12, 12])
    (overlapped, engine), (synchronous, _) = both(tiny_model, requests, abort_after={4: "r1"})
    assert overlapped["r0"] == synchronous["r0"] and overlapped["r2"] == synchronous["r2"]
    assert overlapped["r1"][1] == "abort" and len(overlapped["r1"][0]) < 12
    assert not engine.has_work and engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size


def test_a_request_that_fills_the_context_exactly_takes_no_extra_step(tiny_model):
    # 8 blocks x 4 = 32 tokens: prompt 20 + 12 new tokens. Once the last token is pending, nothing is launched
    # for the sequence: the same steps as the synchronous engine (3 prefill chunks, 11 decodes).
    engine, reference = (make_engine(tiny_model, num_blocks=8, max_running=1, overlap=o) for o in (True, False))
    assert engine.max_len == 8 * BLOCK
    requests = greedy_requests(tiny_model, [20], [12])
    assert run(engine, requests) == run(reference, requests)
    assert engine.step_count == reference.step_count == 14


def test_a_preempted_sequence_waits_for_its_pending_token_before_it_prefills_again(tiny_model):
    engine = make_engine(tiny_model, max_running=2)
    prompt = random_prompts([6], tiny_model.config.vocab_size)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()                                   # its prompt ran; the first token is pending
    seq = engine.by_request["a"]
    engine.scheduler.preempt(seq, "test")           # as when KV blocks run out
    assert seq.unread_steps == 1 and seq.num_cached == 0
    # its token is not on the host: no prefill of a stale prompt
    assert engine.scheduler.schedule(engine.num_drafts).entries == []
    tokens = [t for o in engine.step() for t in o.new_token_ids]   # the token is read ...
    assert len(tokens) == 1 and seq.unread_steps == 0
    engine.step()
    assert engine.scheduler.running == [seq] and seq.num_cached > 0   # ... and then it prefills prompt + token
    while engine.has_work:
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == make_engine(tiny_model, overlap=False).generate([prompt], seq.params)[0]


def test_a_penalised_request_switches_to_synchronous_steps_and_back(tiny_model):
    requests = greedy_requests(tiny_model, [5, 9], [16, 16])
    penalised = ("s", random_prompts([7], tiny_model.config.vocab_size, seed=9)[0],
                 SamplingParams(max_tokens=4, temperature=0.9, seed=5, ignore_eos=True, presence_penalty=0.5))
    (overlapped, engine), (synchronous, _) = both(tiny_model, requests, add_later={3: penalised})
    assert overlapped == synchronous   # seeded sampling is keyed by position, not by step or batch
    assert len(overlapped["s"][0]) == 4 and engine.executor.blocks.kv_blocks.num_free == engine.executor.blocks.kv_blocks.size


def test_a_logprobs_request_takes_synchronous_steps_and_gets_every_logprob(tiny_model):
    """logprobs are read per token on the host: while such a request runs, steps are synchronous; its tokens and
    logprobs equal a synchronous engine's, and the sampled requests beside it keep their seeded tokens."""
    requests = greedy_requests(tiny_model, [5, 9], [16, 16], temperature=0.8, seed=3)
    asking = random_prompts([7], tiny_model.config.vocab_size, seed=9)[0]
    outputs = []
    for overlap in (True, False):
        engine = make_engine(tiny_model, overlap=overlap)
        calls = synchronous_launches(engine)
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        engine.add_request("lp", asking, SamplingParams(max_tokens=5, temperature=0.9, seed=5, logprobs=2,
                                                        ignore_eos=True))
        got = {}
        while engine.has_work:
            for o in engine.step():
                tokens, logprobs = got.get(o.request_id, ([], []))
                got[o.request_id] = (tokens + o.new_token_ids, logprobs + (o.logprobs or []))
        outputs.append(got)
        assert calls
    assert outputs[0] == outputs[1]
    tokens, logprobs = outputs[0]["lp"]
    assert len(tokens) == len(logprobs) == 5 and [lp.token_id for lp in logprobs] == tokens


def test_sampled_requests_decode_in_overlapped_steps(tiny_model):
    """Temperature / top-k / top-p / min-p requests without penalties or logprobs never take a synchronous
    step; their seeded tokens equal the synchronous engine's (added mid-run, so offsets come from unread steps)."""
    requests = greedy_requests(tiny_model, [5, 9, 3], [16, 11, 20], temperature=0.8, top_p=0.9, seed=7)
    later = ("s", random_prompts([7], tiny_model.config.vocab_size, seed=9)[0],
             SamplingParams(max_tokens=9, temperature=1.1, top_k=30, min_p=0.02, seed=5, ignore_eos=True))
    engine = make_engine(tiny_model)
    calls = synchronous_launches(engine)
    overlapped = run(engine, requests, add_later={3: later})
    assert overlapped == run(make_engine(tiny_model, overlap=False), requests, add_later={3: later})
    assert calls == [] and len(overlapped["s"][0]) == 9


# ---- GPU: CUDA graphs replayed, the pending tokens written into the graph's input on the device ---------------
@pytest.mark.gpu
def test_gpu_overlapped_steps_equal_synchronous_steps(tmp_path, cuda):
    """bf16 with CUDA graphs: the same kernels in both engines, so the tokens must be identical."""
    import torch

    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    loaded = load_model(make_tiny(tmp_path, seed=0, progress=False), dtype=torch.bfloat16, device=cuda)
    prompts = random_prompts([3, 7, 12, 20, 5, 9, 30, 1, 4, 17, 2, 6], loaded.config.vocab_size, seed=6)
    requests = {f"r{i}": (p, SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts)}
    results = []
    for overlap in (True, False):
        engine = make_engine(loaded, max_running=8, overlap=overlap)   # 12 requests on 8 places: admissions
        assert engine.executor.runner.graphs is not None and engine.executor.runner.graphs.graphs
        results.append(run(engine, requests))
    assert results[0] == results[1]
