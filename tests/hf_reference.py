"""Tiny random transformers models (the reference) saved with save_pretrained, for parity tests."""
from __future__ import annotations

import torch
import transformers

FAMILIES = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, {}),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                         shared_expert_intermediate_size=40)),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                        shared_expert_intermediate_size=40, norm_topk_prob=True)),
}

BASE = dict(vocab_size=131, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
            linear_value_head_dim=16, intermediate_size=96, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights everywhere, so that every convention (zero-centred norms, gates, A_log) matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.5, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                std = 1.0 if "embed_tokens" in name else fan_in ** -0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))


def make_hf_model(family: str, path, seed: int = 0, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**(BASE | extra | overrides))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [L, V]
