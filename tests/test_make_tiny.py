"""specdec_tools.tiny.make_tiny: random checkpoints in the Hugging Face layout (tiny presets only)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specdec_tools import tiny
from specdec_tools.tiny import PRESETS, make_tiny

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

TEXT_CLASSES = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


def _read_all(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def text_ckpts(tmp_path_factory):
    """(family, expert_layout) -> folder, written once for the module."""
    root = tmp_path_factory.mktemp("tiny")
    combos = [("qwen3_5", "per_expert"), ("qwen3_5_moe", "per_expert"), ("qwen3_5_moe", "fused"),
              ("qwen3_next", "per_expert"), ("qwen3_next", "fused")]
    return {c: make_tiny(root / f"{c[0]}_{c[1]}", family=c[0], expert_layout=c[1], seed=3) for c in combos}


def test_presets_shape():
    assert {"tiny", "small", "qwen3.5-4b"} <= set(PRESETS)
    t = PRESETS["tiny"]
    assert t["vocab_size"] == 257 and t["hidden_size"] == 64 and t["tie_word_embeddings"] is True
    assert t["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    big = PRESETS["qwen3.5-4b"]
    assert big["layer_types"].count("full_attention") == 8 and len(big["layer_types"]) == 32


def test_deterministic(tmp_path):
    kw = dict(family="qwen3_5_moe", overrides={"vocab_size": 300}, tokenizer=True)
    a = _read_all(make_tiny(tmp_path / "a", seed=7, **kw))
    b = _read_all(make_tiny(tmp_path / "b", seed=7, **kw))
    c = _read_all(make_tiny(tmp_path / "c", seed=8, **kw))
    assert set(a) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["config.json"] == c["config.json"]


@pytest.mark.parametrize("family,expert_layout", [("qwen3_5", "per_expert"), ("qwen3_5_moe", "per_expert"),
                                                  ("qwen3_5_moe", "fused"), ("qwen3_next", "per_expert"),
                                                  ("qwen3_next", "fused")])
def test_loads_in_transformers(text_ckpts, family, expert_layout):
    folder = text_ckpts[(family, expert_layout)]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [TEXT_CLASSES[family]]
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["dtype"] == cfg["torch_dtype"] == "float32"
    cls = getattr(transformers, TEXT_CLASSES[family])
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    written = _tensors(folder)
    mtp = {k for k in written if k.startswith("mtp.")}
    assert "mtp.fc.weight" in mtp and "mtp.layers.0.self_attn.q_proj.weight" in mtp
    assert not info["missing_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # transformers drops mtp.* silently (_keys_to_ignore_on_load_unexpected); nothing else may be left
    assert set(info["unexpected_keys"]) <= mtp
    state = model.state_dict()
    assert "lm_head.weight" not in written  # tied
    if expert_layout == "fused" or family == "qwen3_5":
        for key, value in written.items():  # the file's tensors are the model's, one to one
            if key not in mtp:
                assert torch.equal(state[key], value), key
        assert len(written) - len(mtp) == len(state) - 1  # all but the tied lm_head


def test_fused_and_per_expert_hold_same_numbers(text_ckpts):
    for family in ("qwen3_5_moe", "qwen3_next"):
        per = _tensors(text_ckpts[(family, "per_expert")])
        fused = _tensors(text_ckpts[(family, "fused")])
        for prefix in ("model.layers.0.mlp.experts.", "mtp.layers.0.mlp.experts."):
            gate_up, down = fused[prefix + "gate_up_proj"], fused[prefix + "down_proj"]
            E, I2, H = gate_up.shape
            assert (E, H) == (4, 64) and I2 == 2 * 32 and down.shape == (E, H, I2 // 2)
            for e in range(E):
                assert torch.equal(gate_up[e, : I2 // 2], per[f"{prefix}{e}.gate_proj.weight"])
                assert torch.equal(gate_up[e, I2 // 2:], per[f"{prefix}{e}.up_proj.weight"])
                assert torch.equal(down[e], per[f"{prefix}{e}.down_proj.weight"])
        # per-expert-layout model loaded through transformers' conversion == fused file
        model = getattr(transformers, TEXT_CLASSES[family]).from_pretrained(text_ckpts[(family, "per_expert")])
        state = model.state_dict()
        for key, value in fused.items():
            if not key.startswith("mtp."):
                assert torch.equal(state[key], value), key


def test_next_gdn_and_moe_keys(text_ckpts):
    t = _tensors(text_ckpts[("qwen3_next", "per_expert")])
    p = "model.layers.0.linear_attn."
    assert t[p + "in_proj_qkvz.weight"].shape == (2 * 32 + 2 * 64, 64)
    assert t[p + "in_proj_ba.weight"].shape == (8, 64)
    assert t[p + "conv1d.weight"].shape == (2 * 32 + 64, 1, 4)
    assert t["model.layers.3.self_attn.q_proj.weight"].shape == (4 * 16 * 2, 64)
    assert t["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert t["model.layers.1.mlp.shared_expert.up_proj.weight"].shape == (48, 64)
    a_log = t[p + "A_log"].exp()
    assert ((a_log >= 1) & (a_log <= 16)).all()
    assert abs(t[p + "norm.weight"].mean() - 1) < 0.2 and abs(t["model.norm.weight"].mean()) < 0.2
    cfg = json.loads((text_ckpts[("qwen3_next", "per_expert")] / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and cfg["decoder_sparse_step"] == 1
    assert cfg["mlp_only_layers"] == [] and cfg["norm_topk_prob"] is True


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_multimodal_layout(tmp_path, family):
    text_dir = make_tiny(tmp_path / "t", family=family, layout="text", seed=5)
    mm_dir = make_tiny(tmp_path / "m", family=family, layout="multimodal", seed=5)
    cfg = json.loads((mm_dir / "config.json").read_text())
    flat = json.loads((text_dir / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["architectures"][0].endswith("ForConditionalGeneration")
    assert cfg["text_config"]["model_type"] == flat["model_type"] == family + "_text"
    assert cfg["vision_config"]["out_hidden_size"] == 64 and cfg["tie_word_embeddings"] is True
    assert cfg["text_config"]["layer_types"] == flat["layer_types"]
    text_t, mm_t = _tensors(text_dir), _tensors(mm_dir)
    assert {"model.visual.patch_embed.proj.weight", "model.visual.blocks.0.norm1.weight"} <= set(mm_t)
    renamed = {k.replace("model.language_model.", "model."): v for k, v in mm_t.items()
               if not k.startswith("model.visual.")}
    assert renamed.keys() == text_t.keys()
    assert all(torch.equal(renamed[k], text_t[k]) for k in text_t)
    # the text-only class reads the multimodal layout too (visual dummies are ignored)
    model, info = getattr(transformers, TEXT_CLASSES[family]).from_pretrained(mm_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], text_t["model.embed_tokens.weight"])


def test_specdec_model_config_parses(tmp_path):
    from specdec.models.model_config import ModelConfig
    for family, layout in [("qwen3_5", "multimodal"), ("qwen3_5_moe", "text"), ("qwen3_next", "text")]:
        mc = ModelConfig.from_folder(make_tiny(tmp_path / f"{family}{layout}", family=family, layout=layout))
        assert mc.family == family and mc.vocab_size == 257 and mc.mtp_num_hidden_layers == 1
        assert mc.attention_layers == [3] and mc.tie_word_embeddings and mc.eos_token_id == (0,)


def test_tokenizer_round_trip(tmp_path):
    folder = make_tiny(tmp_path / "tok", family="qwen3_5", overrides={"vocab_size": 400}, tokenizer=True,
                       mtp_layers=0)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "def f(x):\n    return {'key': [1, 2.5]}  # ünïcödé ✓ 中文\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(tok) <= 400 and max(ids) < 400 and len(ids) < len(text.encode())  # merges were learned
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>") == 0
    assert cfg["mtp_num_hidden_layers"] == 0
    assert not any(k.startswith("mtp.") for k in _tensors(folder))
    with pytest.raises(ValueError, match="too small for a byte-level tokenizer"):
        make_tiny(tmp_path / "small_vocab", tokenizer=True)


def test_sharded(tmp_path, monkeypatch):
    single = make_tiny(tmp_path / "single", family="qwen3_5_moe", expert_layout="fused", seed=2)
    monkeypatch.setattr(tiny, "SHARD_BYTES", 100_000)
    folder = make_tiny(tmp_path / "sharded", family="qwen3_5_moe", expert_layout="fused", seed=2)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2 and "model.safetensors" not in shards
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = _tensors(folder)
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for name in shards:
        size = 0
        with safe_open(folder / name, "pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
                size += f.get_tensor(key).numel() * 4
        assert size <= 100_000 or len(list(safe_open(folder / name, "pt").keys())) == 1
    reference = _tensors(single)
    assert reference.keys() == tensors.keys() and all(torch.equal(reference[k], tensors[k]) for k in tensors)
    model, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # re-writing the folder unsharded removes the old shards and index
    monkeypatch.setattr(tiny, "SHARD_BYTES", 2 * 10**9)
    make_tiny(folder, family="qwen3_5_moe", expert_layout="fused", seed=2)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]


def test_overrides_and_dtype(tmp_path):
    folder = make_tiny(tmp_path / "o", family="qwen3_next", dtype="bfloat16", mtp_layers=2,
                       overrides={"num_hidden_layers": 6, "full_attention_interval": 2,
                                  "vocab_size": 101, "tie_word_embeddings": False})
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["layer_types"] == ["linear_attention", "full_attention"] * 3
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16" and cfg["mtp_num_hidden_layers"] == 2
    t = _tensors(folder)
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    assert t["lm_head.weight"].shape == (101, 64) and t["model.embed_tokens.weight"].shape == (101, 64)
    assert "model.layers.5.self_attn.q_proj.weight" in t and "model.layers.4.linear_attn.A_log" in t
    assert "mtp.layers.1.mlp.experts.3.down_proj.weight" in t and "mtp.layers.1.mlp.gate.weight" in t
    with pytest.raises(ValueError):
        make_tiny(tmp_path / "x", family="qwen3_next", layout="multimodal")
    with pytest.raises(ValueError):
        make_tiny(tmp_path / "x", preset="nope")


def test_greedy_is_not_degenerate(text_ckpts):
    """Random weights must give varied greedy continuations (tests compare greedy tokens)."""
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(text_ckpts[("qwen3_5", "per_expert")]).eval()
    prompts = torch.randint(1, 257, (4, 5), generator=torch.Generator().manual_seed(0))
    out = model.generate(prompts, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[:, 5:]
    repeats = (out[:, 1:] == out[:, :-1]).float().mean().item()
    assert repeats < 0.6 and all(len(set(row.tolist())) >= 4 for row in out)


def test_qwen3_next_80b_preset_is_the_real_config(tmp_path):
    """Config only (its weights are 160 GB): the shapes a --load-format dummy benchmark builds."""
    from specdec.models.model_config import ModelConfig
    from specdec_tools.bench.traffic import ModelTraffic
    from specdec_tools.tiny import make_tiny
    out = make_tiny(tmp_path / "n80", preset="qwen3-next-80b-a3b", weights=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    c = ModelConfig.from_folder(out)
    assert (c.family, c.hidden_size, c.num_hidden_layers, c.vocab_size) == ("qwen3_next", 2048, 48, 151936)
    assert c.attention_layers == list(range(3, 48, 4))
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 2, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim) == (16, 32, 128)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        512, 10, 512, 512)
    assert not c.tie_word_embeddings and c.mtp_num_hidden_layers == 1
    traffic = ModelTraffic.from_checkpoint(out, "bfloat16")   # from the model's shapes: no weight files
    assert 79e9 < traffic.num_params < 81e9
    # one token reaches 10 of 512 experts a layer: ~3.6 B parameters read, not 80 B
    assert 6.5e9 < traffic.weights_read(1) < 7.5e9 and traffic.weights_read(1e6) == traffic.weight_bytes
