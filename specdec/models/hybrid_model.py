"""The target model: embeddings → hybrid decoder layers → final norm → lm_head, over a ragged batch."""
from __future__ import annotations

import torch
from torch import nn

from .caches import ModelCaches
from .decoder_layer import DecoderLayer
from .forward_batch import ForwardBatch
from .model_config import ModelConfig
from .norms import ZeroCentredRMSNorm


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, config.layer_types[i], config.layer_is_moe(i))
            for i in range(config.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden [T, H] after the final norm — the MTP drafter's input, logits [N, V] fp32)."""
        x, residual = self.embed_tokens(batch.input_ids), None     # [T, H]; residual stream (decoder_layer.py)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, batch, caches, caches.layer_slot[i], residual)
        hidden, _ = self.norm.add_and_norm(x, residual)             # [T, H]
        logits = self.lm_head(hidden[batch.logits_indices]).float()  # [N, V]
        return hidden, logits
