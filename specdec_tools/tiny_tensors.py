"""The tensors of a `specdec_tools.tiny.make_tiny` checkpoint: which ones a family / layout / text
config has (key, shape, init kind, in writing order) and the values of each.

Every tensor is drawn from its own `torch.Generator` seeded from (`seed`, the tensor's layout-independent
name), so the text / multimodal layouts and the per-expert / fused expert layouts of one seed hold the
same numbers.
"""
from __future__ import annotations

import hashlib
import math

import torch

from .tiny_presets import FULL

__all__ = ["OUT_GAIN", "draw", "tensor_specs"]

# init kind -> (std, mean) of a normal draw; "linear" uses std = 1/sqrt(fan_in), "out" (the
# projections that write into the residual stream: o_proj, out_proj, down_proj) OUT_GAIN/sqrt(fan_in).
# With gain 1 the tied N(0, 1) embedding dominates the residual stream and greedy decoding just
# repeats the last input token (nearly every step on "tiny"); gain 3 gives varied greedy continuations.
OUT_GAIN = 3.0
_NORMAL = {"embed": (1.0, 0.0), "norm0": (0.1, 0.0), "norm1": (0.1, 1.0), "dt_bias": (0.5, 1.0)}


# ---- which tensors -----------------------------------------------------------------------------
def _is_moe(family: str, text: dict, layer: int | None) -> bool:
    """layer None = an MTP layer (MoE whenever the family is)."""
    if family == "qwen3_5":
        return False
    if family == "qwen3_5_moe" or layer is None:
        return True
    return (layer not in (text.get("mlp_only_layers") or []) and text["num_experts"] > 0
            and (layer + 1) % int(text.get("decoder_sparse_step", 1)) == 0)


def _mlp(p: str, text: dict, moe: bool, expert_layout: str) -> list[tuple]:
    H = text["hidden_size"]
    if not moe:
        I = text["intermediate_size"]
        return [(p + "gate_proj.weight", (I, H), "linear"), (p + "up_proj.weight", (I, H), "linear"),
                (p + "down_proj.weight", (H, I), "out")]
    E, I, S = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
    specs = [(p + "gate.weight", (E, H), "linear")]
    if expert_layout == "fused":
        specs += [(p + "experts.gate_up_proj", (E, 2 * I, H), "fused_gate_up"),
                  (p + "experts.down_proj", (E, H, I), "fused_down")]
    else:
        for e in range(E):
            specs += _mlp(f"{p}experts.{e}.", {"hidden_size": H, "intermediate_size": I}, False, "")
    specs += _mlp(p + "shared_expert.", {"hidden_size": H, "intermediate_size": S}, False, "")
    return specs + [(p + "shared_expert_gate.weight", (1, H), "linear")]


def _attention(p: str, text: dict) -> list[tuple]:
    H, NH, NKV, D = (text[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    return [(p + "q_proj.weight", (NH * D * 2, H), "linear"), (p + "k_proj.weight", (NKV * D, H), "linear"),
            (p + "v_proj.weight", (NKV * D, H), "linear"), (p + "o_proj.weight", (H, NH * D), "out"),
            (p + "q_norm.weight", (D,), "norm0"), (p + "k_norm.weight", (D,), "norm0")]


def _gdn(p: str, text: dict, family: str) -> list[tuple]:
    H = text["hidden_size"]
    HK, HV, K, V = (text[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                      "linear_key_head_dim", "linear_value_head_dim"))
    conv = 2 * HK * K + HV * V
    if family == "qwen3_next":
        proj = [(p + "in_proj_qkvz.weight", (conv + HV * V, H), "linear"),
                (p + "in_proj_ba.weight", (2 * HV, H), "linear")]
    else:
        proj = [(p + "in_proj_qkv.weight", (conv, H), "linear"), (p + "in_proj_z.weight", (HV * V, H), "linear"),
                (p + "in_proj_b.weight", (HV, H), "linear"), (p + "in_proj_a.weight", (HV, H), "linear")]
    return proj + [(p + "conv1d.weight", (conv, 1, text["linear_conv_kernel_dim"]), "linear"),
                   (p + "dt_bias", (HV,), "dt_bias"), (p + "A_log", (HV,), "A_log"),
                   (p + "norm.weight", (V,), "norm1"), (p + "out_proj.weight", (H, HV * V), "out")]


def _decoder_layer(p: str, text: dict, family: str, kind: str, moe: bool, expert_layout: str) -> list[tuple]:
    H = text["hidden_size"]
    mixer = _attention(p + "self_attn.", text) if kind == FULL else _gdn(p + "linear_attn.", text, family)
    return ([(p + "input_layernorm.weight", (H,), "norm0")] + mixer
            + [(p + "post_attention_layernorm.weight", (H,), "norm0")]
            + _mlp(p + "mlp.", text, moe, expert_layout))


def tensor_specs(family: str, layout: str, text: dict, expert_layout: str) -> list[tuple[str, str, tuple, str]]:
    """[(checkpoint key, layout-independent name, shape, init kind)] in writing order."""
    H, vocab = text["hidden_size"], text["vocab_size"]
    body = [("embed_tokens.weight", (vocab, H), "embed")]
    for i, kind in enumerate(text["layer_types"]):
        body += _decoder_layer(f"layers.{i}.", text, family, kind, _is_moe(family, text, i), expert_layout)
    body.append(("norm.weight", (H,), "norm0"))
    prefix = "model.language_model." if layout == "multimodal" else "model."
    specs = [(prefix + name, name, shape, init) for name, shape, init in body]
    if not text["tie_word_embeddings"]:
        specs.append(("lm_head.weight", "lm_head.weight", (vocab, H), "linear"))
    if layout == "multimodal":  # dummies: loaders must ignore model.visual.*
        specs += [("model.visual.patch_embed.proj.weight", "visual.patch_embed.proj.weight", (16, 3, 2, 16, 16), "linear"),
                  ("model.visual.blocks.0.norm1.weight", "visual.blocks.0.norm1.weight", (16,), "norm1")]
    n_mtp = text["mtp_num_hidden_layers"]
    if n_mtp:
        mtp = [("mtp.fc.weight", (H, 2 * H), "linear"), ("mtp.pre_fc_norm_embedding.weight", (H,), "norm0"),
               ("mtp.pre_fc_norm_hidden.weight", (H,), "norm0")]
        for i in range(n_mtp):
            mtp += _decoder_layer(f"mtp.layers.{i}.", text, family, FULL, _is_moe(family, text, None), expert_layout)
        mtp.append(("mtp.norm.weight", (H,), "norm0"))
        specs += [(name, name, shape, init) for name, shape, init in mtp]
    return specs


# ---- values ------------------------------------------------------------------------------------
def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def draw(seed: int, name: str, shape: tuple, init: str) -> torch.Tensor:
    """float32 values of one tensor; fused experts are stacked from the per-expert draws."""
    if init in ("fused_gate_up", "fused_down"):
        base, (E, rows, cols) = name.rsplit(".", 1)[0], shape
        if init == "fused_down":
            return torch.stack([draw(seed, f"{base}.{e}.down_proj.weight", (rows, cols), "out") for e in range(E)])
        half = (rows // 2, cols)
        return torch.stack([torch.cat([draw(seed, f"{base}.{e}.gate_proj.weight", half, "linear"),
                                       draw(seed, f"{base}.{e}.up_proj.weight", half, "linear")]) for e in range(E)])
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    if init == "A_log":
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=gen))
    x = torch.randn(shape, generator=gen)
    if init in ("linear", "out"):
        return x.mul_((OUT_GAIN if init == "out" else 1.0) / math.sqrt(math.prod(shape[1:])))
    std, mean = _NORMAL[init]
    return x.mul_(std).add_(mean)
