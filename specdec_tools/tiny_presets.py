"""Shapes for `specdec_tools.tiny.make_tiny`: named presets of text-config fields and the per-family
config.json identity (model_type / architectures).

Every preset carries the MoE fields too; they are written only for the MoE families.
"""
from __future__ import annotations

FULL = "full_attention"
LINEAR = "linear_attention"


def layer_types(num_layers: int, interval: int) -> list[str]:
    """Layer i is full attention iff (i + 1) % interval == 0 (the Qwen3.5 / Qwen3-Next pattern)."""
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]


def _preset(*, vocab, hidden, layers, heads, kv_heads, head_dim, lk_heads, lv_heads, lk_dim, lv_dim,
            intermediate, experts, topk, moe_inter, shared_inter, theta, max_pos, eos, interval=4,
            tie=True) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "full_attention_interval": interval,
        "layer_types": layer_types(layers, interval),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "linear_num_key_heads": lk_heads,
        "linear_num_value_heads": lv_heads,
        "linear_key_head_dim": lk_dim,
        "linear_value_head_dim": lv_dim,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25},
        "max_position_embeddings": max_pos,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": tie,
        "bos_token_id": None,
        "eos_token_id": eos,
        # MoE (only written for qwen3_5_moe / qwen3_next)
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "moe_intermediate_size": moe_inter,
        "shared_expert_intermediate_size": shared_inter,
    }


PRESETS: dict[str, dict] = {
    # vocab 257 is odd on purpose (catches code that assumes a padded / even vocab)
    "tiny": _preset(vocab=257, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16,
                    lk_heads=2, lv_heads=4, lk_dim=16, lv_dim=16, intermediate=128,
                    experts=4, topk=2, moe_inter=32, shared_inter=48,
                    theta=10000.0, max_pos=4096, eos=0),
    "small": _preset(vocab=1024, hidden=128, layers=8, heads=4, kv_heads=2, head_dim=32,
                     lk_heads=4, lv_heads=8, lk_dim=32, lv_dim=32, intermediate=384,
                     experts=8, topk=2, moe_inter=64, shared_inter=128,
                     theta=10000.0, max_pos=4096, eos=0),
    # Qwen3.5-4B shapes (benchmarks only). The MoE fields are a made-up mid-size MoE so that the
    # MoE families have something to write with this preset; the real 4B model is dense.
    "qwen3.5-4b": _preset(vocab=248320, hidden=2560, layers=32, heads=16, kv_heads=4, head_dim=256,
                          lk_heads=16, lv_heads=32, lk_dim=128, lv_dim=128, intermediate=9216,
                          experts=64, topk=8, moe_inter=512, shared_inter=512,
                          theta=10000000.0, max_pos=262144, eos=248044),
    # Qwen3-Next-80B-A3B's config (benchmarks with --load-format dummy: 160 GB of bf16 weights are not written
    # unless asked). Every layer is MoE; intermediate_size is the config's, unused.
    "qwen3-next-80b-a3b": _preset(vocab=151936, hidden=2048, layers=48, heads=16, kv_heads=2, head_dim=256,
                                  lk_heads=16, lv_heads=32, lk_dim=128, lv_dim=128, intermediate=5120,
                                  experts=512, topk=10, moe_inter=512, shared_inter=512,
                                  theta=10000000.0, max_pos=262144, eos=151645, tie=False),
}

# presets written in bfloat16 unless make_tiny is given a dtype
BF16_PRESETS = {"qwen3.5-4b", "qwen3-next-80b-a3b"}
# the family a preset is written as unless make_tiny is given one (else qwen3_5)
PRESET_FAMILIES = {"qwen3-next-80b-a3b": "qwen3_next"}

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")

# family -> {layout: (model_type, architecture, text model_type or None when not nested)}
FAMILIES: dict[str, dict[str, tuple[str, str, str | None]]] = {
    "qwen3_5": {
        "text": ("qwen3_5_text", "Qwen3_5ForCausalLM", None),
        "multimodal": ("qwen3_5", "Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    },
    "qwen3_5_moe": {
        "text": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", None),
        "multimodal": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
    },
    "qwen3_next": {
        "text": ("qwen3_next", "Qwen3NextForCausalLM", None),
    },
}

VISION_MODEL_TYPE = {"qwen3_5": "qwen3_5_vision", "qwen3_5_moe": "qwen3_5_moe_vision"}
