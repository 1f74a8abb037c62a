"""Hugging Face checkpoint names → our parameter names, and the tensor re-layouts that go with them.

Handled layouts: Qwen3.5 multimodal (`model.language_model.*`, `model.visual.*` ignored), text-only
(`model.layers.*`), Qwen3-Next fused GDN projections (grouped per key head), per-expert and fused-expert MoE.
`mtp.*` tensors are renamed the same way and returned apart for the drafter.
"""
from __future__ import annotations

import re

import torch

from .model_config import CheckpointError, ModelConfig

_PREFIXES = ("model.language_model.", "model.")
_IGNORED = ("model.visual.", "visual.")
_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def strip_prefix(key: str) -> str | None:
    """Checkpoint key → canonical key (`layers.N...`, `embed_tokens.weight`, `mtp....`), None if ignored."""
    if key.startswith(_IGNORED):
        return None
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def split_fused_gdn(config: ModelConfig, prefix: str, qkvz: torch.Tensor | None,
                    ba: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Qwen3-Next stores, per key head g: qkvz rows [q_g (K) | k_g (K) | v_g (r·V) | z_g (r·V)] and
    ba rows [b_g (r) | a_g (r)] with r = HV / HK. Value head g·r + j belongs to key head g."""
    hk, k_dim, v_dim = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // hk
    out = {}
    if qkvz is not None:
        per_head = 2 * k_dim + 2 * r * v_dim
        if qkvz.shape[0] != hk * per_head:
            raise CheckpointError(f"{prefix}in_proj_qkvz.weight: shape {tuple(qkvz.shape)}, "
                                  f"expected ({hk * per_head}, {config.hidden_size})")
        q, k, v, z = qkvz.view(hk, per_head, -1).split([k_dim, k_dim, r * v_dim, r * v_dim], dim=1)
        hidden = qkvz.shape[1]
        out[prefix + "in_proj_qkv.weight"] = torch.cat([t.reshape(-1, hidden) for t in (q, k, v)])
        out[prefix + "in_proj_z.weight"] = z.reshape(-1, hidden)
    if ba is not None:
        if ba.shape[0] != 2 * hk * r:
            raise CheckpointError(f"{prefix}in_proj_ba.weight: shape {tuple(ba.shape)}, "
                                  f"expected ({2 * hk * r}, {config.hidden_size})")
        b, a = ba.view(hk, 2 * r, -1).split([r, r], dim=1)
        out[prefix + "in_proj_b.weight"] = b.reshape(-1, ba.shape[1])
        out[prefix + "in_proj_a.weight"] = a.reshape(-1, ba.shape[1])
    return out


def to_canonical(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename and re-layout a whole (already prefix-stripped) state dict into our parameter names."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    fused_gdn: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if m := _EXPERT.match(key):
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
        elif key.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
            prefix, name = key.rsplit(".", 2)[0] + ".", key.rsplit(".", 2)[1]
            fused_gdn.setdefault(prefix, {})[name] = t
        elif key.endswith("linear_attn.conv1d.weight"):
            out[key.replace("conv1d.weight", "conv1d_weight")] = t.reshape(t.shape[0], -1)  # [C,1,W] → [C,W]
        elif key.endswith(".mlp.experts.gate_up_proj"):
            out[key.replace(".experts.gate_up_proj", ".experts_gate_up")] = t
        elif key.endswith(".mlp.experts.down_proj"):
            out[key.replace(".experts.down_proj", ".experts_down")] = t
        else:
            out[key] = t
    for prefix, parts in fused_gdn.items():
        out |= split_fused_gdn(config, prefix, parts.get("in_proj_qkvz"), parts.get("in_proj_ba"))
    for mlp, by_expert in experts.items():
        out |= _stack_experts(config, mlp, by_expert)
    return out


def _stack_experts(config: ModelConfig, mlp: str, by_expert: dict[int, dict[str, torch.Tensor]]):
    for e in range(config.num_experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            if name not in by_expert.get(e, {}):
                raise CheckpointError(f"missing tensor {mlp}.experts.{e}.{name}.weight")
    extra = sorted(set(by_expert) - set(range(config.num_experts)))
    if extra:
        raise CheckpointError(f"unexpected tensor {mlp}.experts.{extra[0]}.* (num_experts is {config.num_experts})")
    try:
        gate_up = torch.stack([torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]])
                               for e in range(config.num_experts)])
        down = torch.stack([by_expert[e]["down_proj"] for e in range(config.num_experts)])
    except RuntimeError as err:
        raise CheckpointError(f"{mlp}.experts.*: expert tensors disagree in shape ({err})") from err
    return {f"{mlp}.experts_gate_up": gate_up, f"{mlp}.experts_down": down}
