"""Greedy decoding through our engine equals transformers' generate(do_sample=False), token for token."""
import pytest
import torch
from hf_reference import make_hf_model

from specdec.models.loader import load_model
from verifier_service.executor import Executor
from verifier_service.plain_generate import greedy_generate

PROMPTS = [[5, 17, 3, 99, 42, 7, 1, 64, 2], [64, 8], list(range(10, 41))]
NEW_TOKENS = 64


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, path, seed=11)
    return hf, load_model(path), [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-piece", "chunked-prefill"])
def test_batched_greedy_equals_transformers(models, chunk):
    hf, loaded, expected = models
    executor = Executor.build(loaded, num_blocks=64, block_size=8, max_seqs=4)
    got = greedy_generate(executor, PROMPTS, NEW_TOKENS, prefill_chunk=chunk)
    assert got == expected
    assert executor.blocks.kv_blocks.num_free == 64 and executor.blocks.gdn_slots.num_free == 4  # everything given back


def test_chunked_prefill_equals_one_piece(tmp_path):
    """Prefill in pieces leaves the same caches behind: same logits at every step, not just same argmax."""
    make_hf_model("qwen3_5", tmp_path, seed=12)
    loaded = load_model(tmp_path)
    from verifier_service.sequence import Sequence
    prompt = list(range(3, 40))
    results = []
    for chunk in (len(prompt), 1, 6):
        executor = Executor.build(loaded, num_blocks=16, block_size=4, max_seqs=1)
        seq = Sequence(0, list(prompt), len(prompt))
        while seq.num_cached < len(prompt):
            piece = prompt[seq.num_cached: seq.num_cached + chunk]
            _, logits = executor.forward([seq], [piece])
            seq.num_cached += len(piece)
        results.append(logits)
    assert torch.allclose(results[0], results[1], atol=1e-5)
    assert torch.allclose(results[0], results[2], atol=1e-5)
