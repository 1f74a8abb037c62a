"""The model's shape, read once from a Hugging Face `config.json`.

Three families share one implementation; `family` says which parts differ:
  - "qwen3_5"      dense SwiGLU MLP, split GDN projections
  - "qwen3_5_moe"  MoE (softmax top-k, always renormalised) + sigmoid-gated shared expert
  - "qwen3_next"   like qwen3_5_moe but fused `in_proj_qkvz` / `in_proj_ba`, `norm_topk_prob`,
                   `decoder_sparse_step` and `mlp_only_layers`
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served; the message names the file, field or tensor."""


# model_type -> (family, is the text config nested under "text_config"?)
MODEL_TYPES = {
    "qwen3_5": ("qwen3_5", True),
    "qwen3_5_text": ("qwen3_5", False),
    "qwen3_5_moe": ("qwen3_5_moe", True),
    "qwen3_5_moe_text": ("qwen3_5_moe", False),
    "qwen3_next": ("qwen3_next", False),
}

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated deltanet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # mlp
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:  # HK * K
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:  # HV * V
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:  # channels of [q, k, v] that go through the causal conv
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    def layer_is_moe(self, layer_idx: int) -> bool:
        if self.family == "qwen3_5":
            return False
        if self.family == "qwen3_5_moe":
            return True
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    # ---- parsing --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise CheckpointError(
                f"config.json: unsupported model_type {model_type!r}; "
                f"supported: {', '.join(sorted(MODEL_TYPES))}")
        family, nested = MODEL_TYPES[model_type]
        text = cfg.get("text_config") if nested else cfg
        if not isinstance(text, dict):
            raise CheckpointError(f"config.json: model_type {model_type!r} needs a 'text_config' object")
        return _parse_text_config(family, model_type, text, cfg)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found (a model folder needs config.json)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        config = cls.from_dict(cfg)
        extra = _generation_eos(Path(folder) / "generation_config.json")
        if extra:  # generate() stops on generation_config's ids (Qwen lists more there); stop on both lists
            config = dataclasses.replace(config, eos_token_id=tuple(dict.fromkeys(config.eos_token_id + extra)))
        return config


def _require(text: dict, key: str):
    if key not in text:
        raise CheckpointError(f"config.json: missing required field {key!r}")
    return text[key]


def _layer_types(text: dict, num_layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
    if len(types) != num_layers:
        raise CheckpointError(f"config.json: layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")
    for t in types:
        if t not in (FULL_ATTENTION, LINEAR_ATTENTION):
            raise CheckpointError(f"config.json: unknown layer type {t!r} in layer_types")
    return tuple(types)


def _rope(text: dict) -> tuple[float, float]:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"config.json: unsupported rope_type {rope_type!r} (only default RoPE is implemented)")
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    return float(theta), float(factor)


def _generation_eos(path: Path) -> tuple[int, ...]:
    """eos_token_id of generation_config.json (absent file or field: none)."""
    if not path.is_file():
        return ()
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a valid JSON object ({e})") from e
    try:
        return _eos(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: eos_token_id must be an integer or a list of integers, got {value!r}") from e


def _eos(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _parse_text_config(family: str, model_type: str, text: dict, top: dict) -> ModelConfig:
    num_layers = int(_require(text, "num_hidden_layers"))
    hidden = int(_require(text, "hidden_size"))
    heads = int(_require(text, "num_attention_heads"))
    theta, factor = _rope(text)
    tie = text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
    moe = family != "qwen3_5"
    return ModelConfig(
        family=family, model_type=model_type,
        vocab_size=int(_require(text, "vocab_size")), hidden_size=hidden,
        num_hidden_layers=num_layers, layer_types=_layer_types(text, num_layers),
        num_attention_heads=heads, num_key_value_heads=int(text.get("num_key_value_heads", heads)),
        head_dim=int(text.get("head_dim") or hidden // heads),
        rope_theta=theta, partial_rotary_factor=factor,
        linear_num_key_heads=int(_require(text, "linear_num_key_heads")),
        linear_num_value_heads=int(_require(text, "linear_num_value_heads")),
        linear_key_head_dim=int(_require(text, "linear_key_head_dim")),
        linear_value_head_dim=int(_require(text, "linear_value_head_dim")),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(text.get("intermediate_size", 0)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(tie),
        hidden_act=text.get("hidden_act", "silu"),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        num_experts=int(text.get("num_experts", 0)) if moe else 0,
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0)) if moe else 0,
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0)) if moe else 0,
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0)) if moe else 0,
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        decoder_sparse_step=int(text.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", top.get("mtp_num_hidden_layers", 0)) or 0),
        eos_token_id=_eos(text.get("eos_token_id", top.get("eos_token_id"))),
        bos_token_id=text.get("bos_token_id", top.get("bos_token_id")),
        raw=top,
    )
