"""The target model: embeddings → hybrid decoder layers → final norm → lm_head, over a ragged batch.

Under tensor parallelism (tensor_parallel.py) each rank builds this model over its shard: `config` is the rank's
local config, the embedding and lm_head hold the rank's rows of the padded vocabulary, and the logits are gathered
so that every rank returns all of them.
"""
from __future__ import annotations

import torch
from torch import nn

from .caches import ModelCaches
from .decoder_layer import DecoderLayer
from .forward_batch import ForwardBatch
from .model_config import ModelConfig
from .norms import ZeroCentredRMSNorm
from .tensor_parallel import TensorParallel, local_config


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.full_config, self.tp = config, tp
        self.config = local_config(config, tp)         # the shard's shapes (= config on one rank)
        self.vocab_rows = tp.vocab_rows(config.vocab_size)
        self.embed_tokens = nn.Embedding(len(self.vocab_rows), config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(self.config, config.layer_types[i], config.layer_is_moe(i), tp)
            for i in range(config.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, len(self.vocab_rows), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden [T, H] after the final norm — the MTP drafter's input, logits [N, V] fp32)."""
        x, residual = self.embed(batch.input_ids), None             # [T, H]; residual stream (decoder_layer.py)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, batch, caches, caches.layer_slot[i], residual)
        hidden, _ = self.norm.add_and_norm(x, residual)             # [T, H]
        logits = self.lm_head(hidden[batch.logits_indices])        # [N, V / ranks]
        if self.tp.active:
            logits = self.tp.all_gather_columns(logits)[:, :self.full_config.vocab_size]  # [N, V]
        return hidden, logits.float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] → [T, H]; across ranks, each looks up the ids in its rows (zeros elsewhere) and the sum is taken."""
        if not self.tp.active:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_rows.start                                      # [T]
        mine = (local >= 0) & (local < len(self.vocab_rows))                          # [T]
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)
