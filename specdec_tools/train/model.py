"""The demo model: a small Qwen3.5 text trunk (transformers' Qwen3_5ForCausalLM) plus its MTP head.

The trunk is transformers' own class (GDN through its torch chunked kernel, sdpa attention), so the
exported weights are exactly what `Qwen3_5ForCausalLM.from_pretrained` expects. The MTP head shares the
trunk's tied embedding / lm_head. One training window of L + 2 tokens x_0 .. x_{L+1} gives
    trunk:  inputs x_0 .. x_{L-1}            -> targets x_1 .. x_L     (next-token loss)
    MTP:    (x_{t+1}, h_t) for t = 0 .. L-1  -> targets x_2 .. x_{L+1} (token t + 2)
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from .mtp_module import FULL_ATTENTION, MTPModule

LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int = 4096
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    gdn_key_heads: int = 4
    gdn_value_heads: int = 8
    gdn_head_dim: int = 32
    intermediate: int = 768
    full_attention_interval: int = 4

    def layer_types(self) -> list[str]:
        every = self.full_attention_interval
        return [FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(self.layers)]

    def as_dict(self) -> dict:
        return asdict(self)


def build_config(shape: ModelShape, eos_token_id: int = 0) -> Qwen3_5TextConfig:
    config = Qwen3_5TextConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, layer_types=shape.layer_types(),
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        linear_num_key_heads=shape.gdn_key_heads, linear_num_value_heads=shape.gdn_value_heads,
        linear_key_head_dim=shape.gdn_head_dim, linear_value_head_dim=shape.gdn_head_dim,
        linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.02,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, use_cache=True,
        mtp_num_hidden_layers=1,
    )
    config._attn_implementation = "sdpa"
    return config


class DemoModel(nn.Module):
    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__()
        self.config = config
        self.trunk = Qwen3_5ForCausalLM(config)
        self.mtp = MTPModule(config)

    def add_dropout(self, p: float) -> None:
        """Training-only regularisation (Qwen3.5 has none of its own): dropout on the embedding output and
        on every token mixer / MLP output before its residual add, trunk and MTP layer alike. Forward hooks
        only, so parameters, state_dict and eval-mode outputs are unchanged."""
        if p <= 0:
            return
        layers = [*self.trunk.model.layers, *self.mtp.layers]
        mixers = [getattr(layer, "self_attn", None) or layer.linear_attn for layer in layers]
        for module in [self.trunk.model.embed_tokens, *mixers, *(layer.mlp for layer in layers)]:
            module.register_forward_hook(functools.partial(_dropout_hook, p))

    def num_parameters(self) -> int:
        """Unique parameters (the tied embedding / lm_head counted once), trunk + MTP."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def rotary(self, x: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk's rotary (cos, sin) for positions 0 .. length-1 (the same for all three mrope axes)."""
        positions = torch.arange(length, device=x.device).view(1, 1, length).expand(3, x.shape[0], length)
        return self.trunk.model.rotary_emb(x, positions)

    def forward(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """windows [B, L + 2] -> (mean next-token CE, mean MTP CE), float32 scalars."""
        length = windows.shape[1] - 2
        body, lm_head = self.trunk.model, self.trunk.lm_head
        hidden = body(input_ids=windows[:, :length], use_cache=False).last_hidden_state  # after final norm
        next_loss = cross_entropy(lm_head(hidden), windows[:, 1:length + 1])
        next_embeds = body.embed_tokens(windows[:, 1:length + 1])
        out = self.mtp(next_embeds, hidden, self.rotary(hidden, length))
        mtp_loss = cross_entropy(lm_head(out), windows[:, 2:])
        return next_loss, mtp_loss


def _dropout_hook(p: float, module: nn.Module, args, output):
    if not module.training:
        return None
    if isinstance(output, tuple):  # attention returns (output, weights)
        return (F.dropout(output[0], p, True), *output[1:])
    return F.dropout(output, p, True)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: DemoModel, windows: torch.Tensor, batch_size: int, autocast) -> tuple[float, float]:
    """Mean (next-token, MTP) loss over fixed windows [N, L + 2], batch by batch (every window weighs the same)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=windows.device)
    for start in range(0, windows.shape[0], batch_size):
        chunk = windows[start:start + batch_size]
        with autocast():
            next_loss, mtp_loss = model(chunk)
        totals += torch.stack([next_loss, mtp_loss]).double() * chunk.shape[0]
    model.train(was_training)
    next_mean, mtp_mean = (totals / windows.shape[0]).tolist()
    return next_mean, mtp_mean
