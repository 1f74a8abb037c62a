"""The MTP head against a reference written here from docs/architecture.md, "The model", so its conventions are pinned:
x = fc(cat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)]) (embedding FIRST), h_t the target's
hidden AFTER its final norm, one full-attention layer, mtp.norm, the shared lm_head; draft steps ≥ 1 feed back
the MTP output after mtp.norm. Every RMSNorm here is zero-centred: x̂ · (1 + w)."""
import pytest
import torch
import torch.nn.functional as F

from drafter_service.mtp.mtp_drafter import MTPDrafter
from specdec.drafting import DraftBatch, DraftInput
from specdec.models.caches import ModelCaches
from specdec.models.forward_batch import ForwardBatch


def zc_norm(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())


def rope(x, positions, rotary_dim, theta):  # x [L, heads, D]: neox halves on the first rotary_dim dims
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    ang = positions[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b, rest = x[..., : rotary_dim // 2], x[..., rotary_dim // 2: rotary_dim], x[..., rotary_dim:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)


def attention_layer(x, w, cfg):
    """One gated full-attention decoder layer over a whole causal sequence x [L, H]."""
    n, nh, nkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = zc_norm(x, w["input_layernorm.weight"])
    qg = (h @ w["self_attn.q_proj.weight"].t()).view(n, nh, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]                                  # query | gate, per head
    q = zc_norm(q, w["self_attn.q_norm.weight"])
    k = zc_norm((h @ w["self_attn.k_proj.weight"].t()).view(n, nkv, d), w["self_attn.k_norm.weight"])
    v = (h @ w["self_attn.v_proj.weight"].t()).view(n, nkv, d)
    pos = torch.arange(n)
    q, k = rope(q, pos, cfg.rotary_dim, cfg.rope_theta), rope(k, pos, cfg.rotary_dim, cfg.rope_theta)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, nh * d)
    x = x + (o * torch.sigmoid(gate.reshape(n, nh * d))) @ w["self_attn.o_proj.weight"].t()
    h = zc_norm(x, w["post_attention_layernorm.weight"])
    mlp = (F.silu(h @ w["mlp.gate_proj.weight"].t()) * (h @ w["mlp.up_proj.weight"].t())) @ w["mlp.down_proj.weight"].t()
    return x + mlp


def mtp_reference(loaded, tokens, target_hidden, k, embedding_first=True):
    """tokens: x_0..x_L; target_hidden: h_0..h_{L-1}. Returns (drafts, normed outputs of each draft step).
    Every draft step recomputes the whole chain: step j runs MTP layer j % num_layers over every position."""
    w, cfg = loaded.mtp_weights, loaded.config
    embed, lm_head = loaded.model.embed_tokens.weight, loaded.model.lm_head.weight
    num_layers = cfg.mtp_num_hidden_layers
    layers_w = [{n[len(f"layers.{i}."):]: t for n, t in w.items() if n.startswith(f"layers.{i}.")}
                for i in range(num_layers)]
    next_tokens, hiddens = list(tokens[1:]), [h for h in target_hidden]
    drafts, outs = [], []
    for step in range(k):
        e = zc_norm(embed[torch.tensor(next_tokens)], w["pre_fc_norm_embedding.weight"])
        h = zc_norm(torch.stack(hiddens), w["pre_fc_norm_hidden.weight"])
        x = torch.cat([e, h] if embedding_first else [h, e], -1) @ w["fc.weight"].t()
        layer_w = layers_w[step % num_layers]
        out = zc_norm(attention_layer(x, layer_w, cfg), w["norm.weight"])[-1]      # after mtp.norm
        drafts.append(int((out @ lm_head.t()).argmax()))
        outs.append(out)
        next_tokens.append(drafts[-1])
        hiddens.append(out)                                                        # feedback: post-norm
    return drafts, outs


def target_hidden(loaded, tokens):
    caches = ModelCaches.allocate(loaded.config, 16, 4, 1)
    batch = ForwardBatch.build([tokens], [0], [list(range(16))], 4, [0])
    hidden, _ = loaded.model(batch, caches)
    return hidden  # [L, H] after the final norm


def recorded_drafter(loaded, k):
    drafter = MTPDrafter(loaded, k, num_blocks=32, block_size=4)
    record, logits = [], drafter.head.logits
    drafter.head.logits = lambda out: (record.append(out.clone()), logits(out))[1]
    return drafter, record


@pytest.fixture(scope="module")
def two_layer_mtp_model(tmp_path_factory):
    """The tiny preset with mtp_num_hidden_layers = 2: draft steps alternate layers 0, 1, 0, 1."""
    from specdec.models.loader import load_model
    from specdec_tools.tiny import make_tiny
    return load_model(make_tiny(tmp_path_factory.mktemp("mtp2"), seed=3, mtp_layers=2, progress=False))


@pytest.mark.parametrize("model", ["tiny_model", "two_layer_mtp_model"])
def test_mtp_matches_formula_over_two_steps(model, request):
    """With two MTP layers, layer 1 attends over catch-up KV of the committed pairs and layer 0 over the KV of
    the positions layer 1 drafted at: both must be written whichever layer a step's output comes from."""
    tiny_model = request.getfixturevalue(model)
    prompt, first, k = [11, 200, 3, 47, 90, 5, 128], 66, 4
    hidden = target_hidden(tiny_model, prompt + [first])
    drafter, record = recorded_drafter(tiny_model, k)
    got = drafter.propose(DraftBatch(1, [DraftInput(0, 0, prompt + [first], k)], hidden[: len(prompt)]))
    want, outs = mtp_reference(tiny_model, prompt + [first], hidden[: len(prompt)], k)
    assert got.drafts == [want]
    for step in range(k):
        torch.testing.assert_close(record[step][0].float(), outs[step], atol=1e-4, rtol=1e-4)
    # Next step: the verifier committed [first, y1, y2] at positions 7..9; the drafter rebuilds its KV there
    # (over the draft-step entries) from target hiddens and drafts again.
    committed = prompt + [first, 9, 201]
    hidden = target_hidden(tiny_model, committed)
    record.clear()
    got = drafter.propose(DraftBatch(2, [DraftInput(0, len(prompt), [first, 9, 201], k)],
                                     hidden[len(prompt): len(prompt) + 2]))
    want, outs = mtp_reference(tiny_model, committed, hidden[: len(committed) - 1], k)
    assert got.drafts == [want]
    for step in range(k):
        torch.testing.assert_close(record[step][0].float(), outs[step], atol=1e-4, rtol=1e-4)


def test_reference_is_sensitive_to_the_conventions(tiny_model):
    """The reference tells the conventions apart: hidden-first concatenation changes the drafts' inputs."""
    prompt, first = [11, 200, 3, 47, 90, 5, 128], 66
    hidden = target_hidden(tiny_model, prompt + [first])[: len(prompt)]
    _, right = mtp_reference(tiny_model, prompt + [first], hidden, 2)
    _, swapped = mtp_reference(tiny_model, prompt + [first], hidden, 2, embedding_first=False)
    assert (right[0] - swapped[0]).abs().max() > 1e-2
    pre_norm = hidden / (1 + tiny_model.model.norm.weight.float())  # a hidden taken before the final norm
    _, wrong_hidden = mtp_reference(tiny_model, prompt + [first], pre_norm, 2)
    assert (right[0] - wrong_hidden[0]).abs().max() > 1e-2
