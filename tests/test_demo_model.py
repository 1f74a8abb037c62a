"""The shipped demo model: loads with our loader and with transformers, and both decode it the same way."""
import json
from pathlib import Path

import pytest
import torch

from specdec.demo import DEMO_DIR, demo_model_dir
from specdec.models.loader import has_mtp_weights, load_model
from verifier_service.executor import Executor
from verifier_service.plain_generate import greedy_generate

PROMPTS = ["def fibonacci(n):\n", "import os\n\nclass Config:\n    def __init__(self", "for i in range("]


@pytest.fixture(scope="module")
def demo():
    return demo_model_dir()


def test_folder_is_complete_and_small(demo):
    files = {p.name: p.stat().st_size for p in Path(demo).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files)
    assert sum(files.values()) <= 30_000_000
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["tie_word_embeddings"]
    assert config["layer_types"].count("full_attention") * 4 == len(config["layer_types"])  # the 3:1 pattern
    assert has_mtp_weights(demo)
    assert "held-out loss" in (DEMO_DIR / "README.md").read_text()


def test_transformers_greedy_equals_ours(demo):
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(demo)
    hf = Qwen3_5ForCausalLM.from_pretrained(demo, dtype=torch.float32).eval()
    ours = load_model(demo, dtype="float32")
    assert set(ours.mtp_weights) >= {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                                     "norm.weight"}
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    executor = Executor.build(ours, num_blocks=64, block_size=16, max_seqs=4)
    got = greedy_generate(executor, prompts, 32)
    for ids, tokens in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert tokens == want


def test_gateway_tokenizer_matches_transformers(demo):
    from transformers import AutoTokenizer

    from gateway.tokenizer import TextTokenizer
    ours, theirs = TextTokenizer.from_folder(demo), AutoTokenizer.from_pretrained(demo)
    text = "def main() -> None:\n    print('héllo, wörld ✓')\n"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == text
