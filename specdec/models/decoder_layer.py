"""One pre-norm decoder layer: token mixer (GDN or gated attention) + MLP, each with a residual.

The residual stream is carried between layers instead of being added in place: a layer receives the previous
layer's MLP output x and the stream `residual` (None before the first layer), and its norms add them as they
normalise (`add_and_norm`). Unfused, the same computation is  r = r + x; h = mixer(norm(r)); r = r + h;
x = mlp(norm(r)) — with identical roundings, since each add is rounded to the model dtype before its norm.
The model adds the last layer's (x, residual) inside its final norm.
Under tensor parallelism the mixer's and the MLP's outputs are each rank's partial sums: one all-reduce each.
"""
import torch
from torch import nn

from .caches import ModelCaches
from .forward_batch import ForwardBatch
from .gated_attention import GatedAttention
from .gated_deltanet import GatedDeltaNet
from .mlp import SparseMoE, SwiGLU
from .model_config import FULL_ATTENTION, ModelConfig
from .norms import ZeroCentredRMSNorm
from .tensor_parallel import TensorParallel


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, moe: bool, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp = tp
        self.is_attention = layer_type == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = SparseMoE(config) if moe else SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: ModelCaches, cache_idx: int,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (the embeddings, or the previous layer's MLP output), residual [T, H] or None →
        (this layer's MLP output, the residual stream before it)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        if self.is_attention:
            h = self.self_attn(h, batch, caches.kv.k[cache_idx], caches.kv.v[cache_idx])
        else:
            h = self.linear_attn(h, batch, caches.gdn.recurrent[cache_idx], caches.gdn.pending[cache_idx],
                                 caches.gdn.conv[cache_idx])
        h, residual = self.post_attention_layernorm.add_and_norm(self.tp.all_reduce(h), residual)
        return self.tp.all_reduce(self.mlp(h)), residual
