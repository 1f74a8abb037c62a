"""The MTP head of Qwen3.5 / Qwen3-Next (the `mtp.*` tensors), sharing the target's embed_tokens and lm_head.

For the pair (next token t+1, hidden h):
    x = fc(cat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h)])   # embedding FIRST
    x = mtp.layers[i](x)                                                     # full-attention decoder layer
    out = mtp.norm(x); logits = lm_head(out)                                 # shared lm_head
h is the target's hidden state after its final norm for draft step 0 (and over the prompt); for draft steps
≥ 1 it is the previous step's `out` (after mtp.norm). Draft step i uses layer i % mtp_num_hidden_layers.

With L > 1 layers the reference is the whole chain recomputed at every draft step: step i runs layer i % L
over every position so far, committed pairs (t+1, target h) and drafted pairs (d, out) alike, all with the
same fc input x. So every layer needs its KV at every position, not only where it is the step's layer: each
call runs x through ALL layers (each writes its own KV rows) and returns the normed output of the one asked
for. With L = 1 (every released Qwen3.5 / Qwen3-Next checkpoint) that is the one layer, at no extra cost.
This L > 1 rule is specdec's own (no released checkpoint pins one; DeepSeek-V3 chains its MTP modules
differently): tests/test_mtp_formula.py checks the code against it, not against a reference implementation.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.models.caches import ModelCaches
from specdec.models.decoder_layer import DecoderLayer
from specdec.models.forward_batch import ForwardBatch
from specdec.models.fused_linear import fuse_projections
from specdec.models.loader import check_against
from specdec.models.model_config import FULL_ATTENTION, ModelConfig
from specdec.models.norms import ZeroCentredRMSNorm


class MTPHead(nn.Module):
    def __init__(self, config: ModelConfig, num_layers: int):
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        moe = config.family != "qwen3_5"
        self.layers = nn.ModuleList(DecoderLayer(config, FULL_ATTENTION, moe) for _ in range(num_layers))
        self.norm = ZeroCentredRMSNorm(hidden, config.rms_norm_eps)
        self.shared: tuple[nn.Embedding, nn.Linear] | None = None  # (embed_tokens, lm_head), not registered

    @staticmethod
    def from_weights(config: ModelConfig, weights: dict[str, torch.Tensor], embed_tokens: nn.Embedding,
                     lm_head: nn.Linear) -> "MTPHead":
        num_layers = config.mtp_num_hidden_layers or 1 + max(
            (int(k.split(".")[1]) for k in weights if k.startswith("layers.")), default=-1)
        with torch.device("meta"):
            head = MTPHead(config, num_layers)
        check_against({k: p.shape for k, p in head.state_dict().items()}, weights, "mtp head")
        head.load_state_dict(weights, strict=True, assign=True)
        head.requires_grad_(False).eval()
        fuse_projections(head)
        head.shared = (embed_tokens, lm_head)
        return head

    @torch.inference_mode()
    def forward(self, next_tokens_batch: ForwardBatch, hidden: torch.Tensor, caches: ModelCaches,
                layer: int) -> torch.Tensor:
        """next_tokens_batch.input_ids are the t+1 tokens at the batch positions; hidden [T, H] → out [T, H]
        after mtp.norm of layer `layer` (the feedback for the next draft step). Every layer writes its KV rows."""
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"mtp layer {layer}: the head has {len(self.layers)}")
        embed_tokens, _ = self.shared
        e = self.pre_fc_norm_embedding(embed_tokens(next_tokens_batch.input_ids))   # [T, H]
        h = self.pre_fc_norm_hidden(hidden.to(e.dtype))                             # [T, H]
        x = self.fc(torch.cat([e, h], dim=-1))                                      # [T, H]
        out = None
        for i, decoder_layer in enumerate(self.layers):   # same x into each: see the module docstring
            y, residual = decoder_layer(x, next_tokens_batch, caches, i)
            if i == layer:
                out = self.norm.add_and_norm(y, residual)[0]                       # [T, H]
        return out

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        _, lm_head = self.shared
        return lm_head(out).float()  # [N, V]
