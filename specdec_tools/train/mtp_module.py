"""The trainable multi-token-prediction (MTP) head, in the Qwen3.5 checkpoint layout (`mtp.*`).

For position t, with h_t the trunk's hidden state AFTER its final norm and token_{t+1} the next token:

    x   = fc(cat[pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)])   # embedding FIRST
    x   = layers[0](x)              # one full-attention Qwen3_5DecoderLayer, rotary position t, causal
    out = norm(x)
    logits = lm_head(out)           # the trunk's tied embedding / lm_head, shared (not owned here)

and the logits at position t predict token_{t+2}. fc is Linear(2H -> H, no bias); pre_fc_norm_* and norm
are zero-centred RMSNorms (x_hat * (1 + w), w initialised to 0), i.e. transformers' Qwen3_5RMSNorm.
Parameter names (state_dict keys, to be prefixed "mtp."): fc.weight, pre_fc_norm_embedding.weight,
pre_fc_norm_hidden.weight, layers.0.<decoder layer>, norm.weight.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

FULL_ATTENTION = "full_attention"


def mtp_layer_config(config: Qwen3_5TextConfig) -> Qwen3_5TextConfig:
    """The trunk's config with a single layer, marked full attention (layer index 0 of the MTP stack)."""
    fields = config.to_dict()
    for key in ("transformers_version", "model_type", "architectures", "_name_or_path"):
        fields.pop(key, None)
    fields.update(num_hidden_layers=1, layer_types=[FULL_ATTENTION])
    layer_config = Qwen3_5TextConfig(**fields)
    layer_config._attn_implementation = config._attn_implementation
    return layer_config


class MTPModule(nn.Module):
    def __init__(self, config: Qwen3_5TextConfig, init_std: float | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        layer_config = mtp_layer_config(config)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)
        self.attn_implementation = config._attn_implementation
        self.reset_parameters(config.initializer_range if init_std is None else init_std)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Linear weights ~ N(0, std) like the trunk's init; every RMSNorm weight 0 (i.e. scale 1)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, Qwen3_5RMSNorm):
                module.weight.zero_()

    def causal_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """None for sdpa (it applies is_causal itself); an additive [1, 1, L, L] mask otherwise (eager)."""
        if self.attn_implementation == "sdpa":
            return None
        n = x.shape[1]
        upper = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        return torch.zeros(n, n, dtype=x.dtype, device=x.device).masked_fill(upper, float("-inf"))[None, None]

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """next_embeds = embed(token_{t+1}) [B, L, H]; hidden = h_t [B, L, H] (after the trunk's final norm);
        position_embeddings = the trunk's rotary (cos, sin) for positions 0..L-1. Returns out [B, L, H]
        after mtp.norm; lm_head(out)[:, t] predicts token_{t+2}."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=self.causal_mask(x))
        if isinstance(x, tuple):  # older transformers releases return (hidden_states, ...)
            x = x[0]
        return self.norm(x)
