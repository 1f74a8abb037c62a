"""specdec_tools.train: the stdlib corpus, the MTP head's formula, and a tiny end-to-end train + export run whose
folder must load in our loader, in transformers (same greedy tokens) and in the MTP drafter."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

from specdec_tools.train import corpus  # noqa: E402
from specdec_tools.train.model import DemoModel, ModelShape, build_config  # noqa: E402
from specdec_tools.train.mtp_module import MTPModule  # noqa: E402

TINY_ARGS = ["--device", "cpu", "--train-files", "12", "--tokenizer-files", "12", "--vocab-size", "384",
             "--hidden", "64", "--layers", "4", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
             "--gdn-key-heads", "2", "--gdn-value-heads", "4", "--gdn-head-dim", "16", "--intermediate", "128",
             "--seq-len", "48", "--batch-size", "4", "--steps", "40", "--lr", "1e-2", "--eval-windows", "4",
             "--eval-every", "20", "--log-every", "10"]
MTP_LAYER = {"input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
             "mlp.up_proj.weight", "mlp.down_proj.weight"} | {
    f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
MTP_KEYS = {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight"} | {
    f"layers.0.{n}" for n in MTP_LAYER}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from specdec_tools.train.train_demo import main
    out = tmp_path_factory.mktemp("train_demo") / "ckpt"
    assert main(["--out", str(out), *TINY_ARGS]) == out
    return out


# ---- an independent reference of the MTP formula (docs/architecture.md): every RMSNorm zero-centred -----------------
def zc_norm(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())


def rope(x, rotary_dim, theta):  # x [L, heads, D]; neox halves on the first rotary_dim dims, position = row
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    ang = torch.arange(x.shape[0])[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b, rest = x[..., : rotary_dim // 2], x[..., rotary_dim // 2: rotary_dim], x[..., rotary_dim:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)


def attention_layer(x, w, cfg):
    """One gated full-attention decoder layer (causal) over x [L, H]; w: the layer's tensors by name."""
    n, nh, nkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rot, theta = int(d * 0.25), cfg.rope_parameters["rope_theta"]
    h = zc_norm(x, w["input_layernorm.weight"])
    qg = (h @ w["self_attn.q_proj.weight"].t()).view(n, nh, 2 * d)
    q = rope(zc_norm(qg[..., :d], w["self_attn.q_norm.weight"]), rot, theta)
    k = rope(zc_norm((h @ w["self_attn.k_proj.weight"].t()).view(n, nkv, d), w["self_attn.k_norm.weight"]), rot, theta)
    v = (h @ w["self_attn.v_proj.weight"].t()).view(n, nkv, d)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * d)
    x = x + (o * torch.sigmoid(qg[..., d:].reshape(n, nh * d))) @ w["self_attn.o_proj.weight"].t()
    h = zc_norm(x, w["post_attention_layernorm.weight"])
    mlp = F.silu(h @ w["mlp.gate_proj.weight"].t()) * (h @ w["mlp.up_proj.weight"].t())
    return x + mlp @ w["mlp.down_proj.weight"].t()


def mtp_reference(w, cfg, next_embeds, hidden, embedding_first=True):
    """w: MTP tensors by name (no "mtp." prefix); next_embeds = embed(token_{t+1}) [L, H]; hidden = h_t [L, H]."""
    e, h = zc_norm(next_embeds, w["pre_fc_norm_embedding.weight"]), zc_norm(hidden, w["pre_fc_norm_hidden.weight"])
    x = torch.cat([e, h] if embedding_first else [h, e], -1) @ w["fc.weight"].t()
    layer = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
    return zc_norm(attention_layer(x, layer, cfg), w["norm.weight"])


def tiny_random_model(seed=0) -> DemoModel:
    torch.manual_seed(seed)
    shape = ModelShape(vocab_size=97, hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16, gdn_key_heads=2,
                       gdn_value_heads=4, gdn_head_dim=8, intermediate=48)
    model = DemoModel(build_config(shape)).eval()
    with torch.no_grad():  # non-zero norm weights, so a "1 + w" vs "w" mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return model


# ---- unit tests -------------------------------------------------------------------------------------------
def test_mtp_module_matches_formula():
    model = tiny_random_model()
    cfg, length = model.config, 9
    tokens = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    next_embeds, hidden = model.trunk.model.embed_tokens(tokens), torch.randn(length, cfg.hidden_size)
    with torch.no_grad():
        got = model.mtp(next_embeds[None], hidden[None], model.rotary(hidden[None], length))[0]
        w = dict(model.mtp.state_dict())
        want = mtp_reference(w, cfg, next_embeds, hidden)
        swapped = mtp_reference(w, cfg, next_embeds, hidden, embedding_first=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - swapped).abs().max() > 1e-2  # the reference tells the concatenation orders apart
    assert set(w) == MTP_KEYS
    assert all(MTPModule(cfg).state_dict()[k].eq(0).all() for k in MTP_KEYS if k.endswith("norm.weight"))


def test_training_losses_align_tokens():
    """Trunk logits at t predict token t+1; MTP logits at t, from (embed(token t+1), h_t), predict t+2."""
    model = tiny_random_model(seed=3)
    windows = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    length = windows.shape[1] - 2
    with torch.no_grad():
        next_loss, mtp_loss = model(windows)
        hidden = model.trunk.model(input_ids=windows[:, :length]).last_hidden_state  # after the final norm
        embed = model.trunk.model.embed_tokens.weight
        w = dict(model.mtp.state_dict())
        want_next = F.cross_entropy((hidden @ embed.t()).flatten(0, 1), windows[:, 1:length + 1].flatten())
        outs = torch.stack([mtp_reference(w, model.config, embed[windows[b, 1:length + 1]], hidden[b])
                            for b in range(2)])
        want_mtp = F.cross_entropy((outs @ embed.t()).flatten(0, 1), windows[:, 2:].flatten())
    torch.testing.assert_close(next_loss, want_next, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mtp_loss, want_mtp, atol=1e-5, rtol=1e-5)


def test_dropout_is_training_only():
    model = tiny_random_model(seed=5)
    windows = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = model(windows)
        model.add_dropout(0.5)
        after = model(windows)  # eval mode: the hooks do nothing
        model.train()
        noisy = [model(windows)[0] for _ in range(2)]
    torch.testing.assert_close(before, after, rtol=0, atol=0)
    assert not torch.equal(noisy[0], noisy[1])
    assert set(dict(model.state_dict())) == set(dict(tiny_random_model().state_dict()))


def test_corpus_split():
    root = corpus.stdlib_root()
    train, held = corpus.training_files(root), corpus.held_out_files(root)
    train_names = {corpus.relative_name(p, root) for p in train}
    held_names = [corpus.relative_name(p, root) for p in held]
    assert not train_names & set(held_names)
    assert len(held) >= 24 and set(held_names) <= set(corpus.HELD_OUT)
    assert {"json/decoder.py", "textwrap.py", "html/parser.py"} <= set(held_names)
    assert train == sorted(train, key=lambda p: corpus.relative_name(p, root)) and len(train) > 300
    assert "os.py" in train_names and "json/encoder.py" in train_names
    for name in train_names:
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(name.split("/")[:-1])
    assert all(p.stat().st_size <= corpus.MAX_FILE_BYTES for p in train + held)
    assert corpus.spread(train, 5) == corpus.spread(train, 5) and len(corpus.spread(train, 5)) == 5


def test_tokenizer_is_deterministic():
    from specdec_tools.train.bpe import train_tokenizer
    files = corpus.spread(corpus.training_files(), 6)
    a, b = train_tokenizer(files, 300), train_tokenizer(files, 300)
    assert a.to_str() == b.to_str() and a.token_to_id("<|endoftext|>") == 0 and a.get_vocab_size() == 300


# ---- the exported folder ----------------------------------------------------------------------------------
def test_folder_layout(trained, tmp_path):
    names = {p.name for p in trained.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "training_log.json"} <= names
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] and cfg["eos_token_id"] == 0
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
    assert {k[len("mtp."):] for k in keys if k.startswith("mtp.")} == MTP_KEYS
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(trained, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "resaved")
    with safe_open(str(tmp_path / "resaved" / "model.safetensors"), "pt") as f:
        assert {k for k in keys if not k.startswith("mtp.")} == set(f.keys())  # exactly save_pretrained's keys
    assert "lm_head.weight" not in keys
    log = json.loads((trained / "training_log.json").read_text())
    assert log["export"]["folder_bytes"] <= 30_000_000 and log["training"]["steps_done"] == 40
    assert log["corpus"]["train_files"] == 12 and log["corpus"]["held_out_files"] >= 24
    assert len(log["evals"]) == 1 and log["results"]["held_out_windows"] == 4


def test_model_card(trained):
    card = (trained / "README.md").read_text()
    log = json.loads((trained / "training_log.json").read_text())
    assert "held-out loss" in card and f"{log['results']['held_out_loss']:.4f}" in card
    assert f"{log['results']['held_out_mtp_loss']:.4f}" in card and f"{log['model']['parameters']:,}" in card
    assert "json/decoder.py" in card and log["corpus"]["python_version"] in card


def test_tokenizer_loads(trained):
    from tokenizers import Tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(trained)
    text = "def f(x):\n    return {'key': [1, 2.5]}  # ünïcödé\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < 384 and len(ids) < len(text.encode())
    assert tok.eos_token_id == tok.pad_token_id == 0
    assert Tokenizer.from_file(str(trained / "tokenizer.json")).encode(text).ids == ids


def test_loads_and_generates_like_transformers(trained):
    from specdec.models.loader import load_model
    from verifier_service.executor import Executor
    from verifier_service.plain_generate import greedy_generate
    from verifier_service.sequence import Sequence
    loaded = load_model(trained, dtype="float32")
    assert set(loaded.mtp_weights) == MTP_KEYS and loaded.config.mtp_num_hidden_layers == 1
    tok = transformers.AutoTokenizer.from_pretrained(trained)
    ids = tok("import os\n\n\ndef main(argv):\n    ")["input_ids"]
    executor = Executor.build(loaded, num_blocks=8, block_size=16, max_seqs=1)
    ours = greedy_generate(executor, [ids], 16)[0]
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert out[0, len(ids):].tolist() == ours and len(ours) == 16
    # and teacher-forced, every position's logits agree (greedy tokens alone may be repetitive this early)
    seq = Sequence(seq_id=0, token_ids=ids + ours, num_prompt=len(ids))
    _, logits = executor.forward([seq], [seq.token_ids], logits="all")
    executor.blocks.release(seq)
    with torch.no_grad():
        want = hf(torch.tensor([ids + ours])).logits[0]
    torch.testing.assert_close(logits, want, atol=2e-4, rtol=2e-4)


def test_drafter_reads_the_trained_mtp_head(trained):
    """The serving MTP drafter, given the exported mtp.* tensors, computes what training computed."""
    from specdec.drafting import DraftBatch, DraftInput
    from drafter_service.mtp.mtp_drafter import MTPDrafter
    from specdec.models.loader import load_model
    loaded = load_model(trained, dtype="float32")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    mtp = MTPModule(hf.config)
    with safe_open(str(trained / "model.safetensors"), "pt") as f:
        mtp.load_state_dict({k[4:]: f.get_tensor(k).float() for k in f.keys() if k.startswith("mtp.")})
    tokens = transformers.AutoTokenizer.from_pretrained(trained)("for i in range(10):\n    print(i)\n")["input_ids"]
    n = len(tokens) - 1
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]  # after the final norm
        positions = torch.arange(n).view(1, 1, n).expand(3, 1, n)
        want = mtp(hf.model.embed_tokens(torch.tensor([tokens[1:]])), hidden[None, :n],
                   hf.model.rotary_emb(hidden[None], positions))[0, -1]
    drafter = MTPDrafter(loaded, 1, num_blocks=8, block_size=16)
    record, logits = [], drafter.head.logits
    drafter.head.logits = lambda out: (record.append(out.clone()), logits(out))[1]
    got = drafter.propose(DraftBatch(1, [DraftInput(0, 0, tokens, 1)], hidden[:n]))
    torch.testing.assert_close(record[0][0], want, atol=1e-4, rtol=1e-4)
    assert got.drafts == [[int((want @ hf.model.embed_tokens.weight.t()).argmax())]]
