"""Logit parity with transformers (the reference) on tiny random configs, fp32 on CPU."""
import pytest
import torch
from hf_reference import hf_logits, make_hf_model

from specdec.models.caches import ModelCaches
from specdec.models.forward_batch import ForwardBatch
from specdec.models.loader import load_model

TOL = 1e-4
PROMPTS = [[5, 17, 3, 99, 42, 7, 1], [64, 8, 100, 3], list(range(10, 33))]

CASES = {
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5-interval2-odd-vocab": ("qwen3_5", dict(full_attention_interval=2, vocab_size=127)),
    "qwen3_5-hv-eq-hk": ("qwen3_5", dict(linear_num_value_heads=2)),
    "qwen3_5-hv4x-tied": ("qwen3_5", dict(linear_num_key_heads=1, tie_word_embeddings=True)),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    "qwen3_5_moe-interval3": ("qwen3_5_moe", dict(full_attention_interval=3, num_hidden_layers=6)),
    "qwen3_next": ("qwen3_next", {}),
    "qwen3_next-dense-layer": ("qwen3_next", dict(mlp_only_layers=[1], vocab_size=97)),
}


def ragged_logits(loaded, prompts, block_size=4):
    caches = ModelCaches.allocate(loaded.config, num_blocks=32, block_size=block_size, num_gdn_slots=len(prompts))
    tables, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append(list(range(next_block, next_block + n))[::-1])  # non-contiguous, reversed blocks
        next_block += n
    batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, block_size, list(range(len(prompts))),
                               logits="all")
    hidden, logits = loaded.model(batch, caches)
    return hidden, logits


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_logits_match_transformers(tmp_path, case):
    family, overrides = CASES[case]
    hf = make_hf_model(family, tmp_path, seed=3, **overrides)
    loaded = load_model(tmp_path)
    assert loaded.config.family == family
    prompts = [[t % hf.config.vocab_size for t in p] for p in PROMPTS]
    hidden, logits = ragged_logits(loaded, prompts)
    reference = torch.cat([hf_logits(hf, p) for p in prompts])
    assert logits.shape == reference.shape
    assert (logits - reference).abs().max().item() <= TOL
    assert hidden.shape == (sum(map(len, prompts)), hf.config.hidden_size)


def test_hidden_is_after_final_norm(tmp_path):
    """The MTP drafter needs the target hidden state AFTER the final norm (docs/architecture.md, "The model")."""
    hf = make_hf_model("qwen3_5", tmp_path, seed=4)
    loaded = load_model(tmp_path)
    hidden, _ = ragged_logits(loaded, [PROMPTS[0]])
    with torch.no_grad():
        out = hf(torch.tensor([PROMPTS[0]]), output_hidden_states=True)
    assert torch.allclose(hidden, out.hidden_states[-1][0], atol=1e-5)


def test_multimodal_key_layout(tmp_path):
    """Real Qwen3.5 checkpoints: qwen3_5 config with text_config, keys under model.language_model.*, plus
    model.visual.* (ignored) and mtp.* (kept for the drafter)."""
    import json

    from safetensors.torch import load_file, save_file
    hf = make_hf_model("qwen3_5", tmp_path / "text", seed=5)
    tensors = load_file(tmp_path / "text" / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(24, 8)
    renamed["mtp.fc.weight"] = torch.randn(48, 96)
    (tmp_path / "mm").mkdir()
    save_file(renamed, tmp_path / "mm" / "model.safetensors")
    text_config = json.loads((tmp_path / "text" / "config.json").read_text())
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text_config, "vision_config": {"model_type": "qwen3_5_vision"},
              "tie_word_embeddings": False}
    (tmp_path / "mm" / "config.json").write_text(json.dumps(config))
    loaded = load_model(tmp_path / "mm")
    assert loaded.config.model_type == "qwen3_5" and set(loaded.mtp_weights) == {"fc.weight"}
    _, logits = ragged_logits(loaded, PROMPTS)
    reference = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert (logits - reference).abs().max().item() <= TOL


def test_fused_expert_layout(tmp_path):
    """MoE checkpoints that store experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file
    hf = make_hf_model("qwen3_5_moe", tmp_path / "per_expert", seed=6)
    tensors = load_file(tmp_path / "per_expert" / "model.safetensors")
    fused, experts = {}, {}
    for k, v in tensors.items():
        m = re.match(r"(.*\.mlp)\.experts\.(\d+)\.(\w+)\.weight", k)
        if m:
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
        else:
            fused[k] = v
    for mlp, by_e in experts.items():
        n = len(by_e)
        fused[f"{mlp}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]]) for e in range(n)])
        fused[f"{mlp}.experts.down_proj"] = torch.stack([by_e[e]["down_proj"] for e in range(n)])
    (tmp_path / "fused").mkdir()
    shutil.copy(tmp_path / "per_expert" / "config.json", tmp_path / "fused" / "config.json")
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    _, logits = ragged_logits(load_model(tmp_path / "fused"), PROMPTS)
    reference = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert (logits - reference).abs().max().item() <= TOL


def test_sharded_checkpoint_and_bf16(tmp_path):
    hf = make_hf_model("qwen3_next", tmp_path, seed=7)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, logits = ragged_logits(load_model(tmp_path / "sharded"), PROMPTS)
    reference = torch.cat([hf_logits(hf, p) for p in PROMPTS])
    assert (logits - reference).abs().max().item() <= TOL
    bf16 = load_model(tmp_path / "sharded", dtype="bf16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    _, logits16 = ragged_logits(bf16, PROMPTS)
    assert (logits16 - reference).abs().max().item() < 0.5  # bf16 is not exact, but it is the same model
