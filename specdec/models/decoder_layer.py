"""One pre-norm decoder layer: token mixer (GDN or gated attention) + MLP, each with a residual."""
import torch
from torch import nn

from .caches import ModelCaches
from .forward_batch import ForwardBatch
from .gated_attention import GatedAttention
from .gated_deltanet import GatedDeltaNet
from .mlp import SparseMoE, SwiGLU
from .model_config import FULL_ATTENTION, ModelConfig
from .norms import ZeroCentredRMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, moe: bool):
        super().__init__()
        self.is_attention = layer_type == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = SparseMoE(config) if moe else SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, cache_idx: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_attention:
            h = self.self_attn(h, batch, caches.kv.k[cache_idx], caches.kv.v[cache_idx])
        else:
            h = self.linear_attn(h, batch, caches.gdn.recurrent[cache_idx], caches.gdn.conv[cache_idx])
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))
