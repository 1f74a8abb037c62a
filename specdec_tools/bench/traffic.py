"""Bytes a decode step must move (docs/architecture.md): the roofline every measured step is held against.

    bytes(step) = weights                         read once per step, whatever the batch (lm_head included,
                                                  a tied embedding counted once, embedding rows not counted)
                + Σ_seq context · kv_bytes_per_token          KV read by the attention layers
                + Σ_seq (1 + d) · kv_bytes_per_token          KV written for the verified tokens
                + Σ_seq gdn_state · (1 read + w writes)       fp32 recurrent state, w = 1 + d for a verifier
                                                              that keeps one state per verify token, 1 otherwise
                + Σ_seq conv columns read and written
with d the drafts verified per sequence. FP8 linears (an FP8 checkpoint or --quantization fp8) count one byte per
weight plus their fp32 block scales, as a GPU reads them (a CPU dequantizes them: its bytes are undercounted; the
zero rows that align fused FP8 parts are not counted), and so do MoE routed experts the loader keeps in FP8 (their
width a multiple of the block's rows: fp8_linear.experts_to_fp8).
Shapes come from the checkpoint's safetensors headers and config.json
(a folder with config.json only, for --load-format dummy: from the model's shapes), so nothing is loaded. An MoE
model's routed experts count by the share a step's tokens reach: with top-k of E experts and n = batch · (1 + d)
tokens routed uniformly, each layer reads 1 − (1 − k/E)^n of them. Under tensor parallelism each GPU moves 1/N of
it all (the bench divides).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from specdec.models.checkpoint_keys import strip_prefix
from specdec.models.fp8 import SCALE_SUFFIX, Fp8Format
from specdec.models.loader import checkpoint_files, checkpoint_name, fp8_format, parse_dtype
from specdec.models.model_config import CheckpointError, ModelConfig

EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class ModelTraffic:
    weight_bytes: int                       # target weights one step reads
    linear_shapes: tuple[tuple[int, int], ...]  # [out, in] of every 2-D weight a token passes, lm_head last
    kv_bytes_per_token: int                 # K and V of all attention layers
    gdn_state_bytes: int                    # recurrent state of all GDN layers, one sequence (fp32)
    conv_bytes_per_column: int              # one conv-state column of all GDN layers
    conv_kernel: int
    num_params: int
    expert_bytes: int = 0                   # the routed experts' weights (in weight_bytes)
    num_experts: int = 0
    experts_per_token: int = 0
    active_params: int = 0                  # weights one prompt token multiplies (lm_head and unrouted experts out)
    attention_width: int = 0                # sum over attention layers of heads x head_dim (the QK and PV widths)

    @classmethod
    def from_checkpoint(cls, folder: str | Path, dtype: str, quantization: str = "none") -> "ModelTraffic":
        config = ModelConfig.from_folder(folder)
        elem = parse_dtype(dtype).itemsize
        fmt = Fp8Format() if quantization == "fp8" else fp8_format(Path(folder))
        shapes = {k: s for k, s in _shapes(Path(folder), config).items() if not k.endswith(SCALE_SUFFIX)}
        if EMBED not in shapes:
            raise ValueError(f"{folder}: no {EMBED} in the checkpoint")
        head = shapes.get(LM_HEAD, shapes[EMBED])        # tied: the embedding is the lm_head
        body = {k: s for k, s in shapes.items() if k not in (EMBED, LM_HEAD)}
        numel = sum(math.prod(s) for s in body.values()) + math.prod(head)
        linears = tuple((s[0], s[1]) for k, s in sorted(body.items(), key=lambda kv: _layer_order(kv[0]))
                        if len(s) == 2 and k.endswith(".weight")) + ((head[0], head[1]),)
        attn, gdn = len(config.attention_layers), len(config.gdn_layers)
        experts = {k: s for k, s in body.items() if ".experts" in k}
        expert_numel = sum(math.prod(s) for s in experts.values())
        fp8 = [s for k, s in body.items() if fmt and len(s) == 2 and k not in experts and fmt.converts(k, s)]
        saved = sum(math.prod(s) * elem - _fp8_bytes(s, fmt.block) for s in fp8)
        aligned = bool(fmt) and config.moe_intermediate_size % fmt.block[0] == 0          # fp8_linear.experts_to_fp8
        expert_bytes = sum(_fp8_bytes(s[-2:], fmt.block) * math.prod(s[:-2])
                           if aligned and fmt.converts(checkpoint_name(k), s) else math.prod(s) * elem
                           for k, s in experts.items())
        saved += expert_numel * elem - expert_bytes
        return cls(
            weight_bytes=numel * elem - saved, linear_shapes=linears,
            kv_bytes_per_token=2 * attn * config.num_key_value_heads * config.head_dim * elem,
            gdn_state_bytes=gdn * config.linear_num_value_heads * config.linear_key_head_dim
            * config.linear_value_head_dim * 4,
            conv_bytes_per_column=gdn * config.gdn_conv_dim * elem, conv_kernel=config.linear_conv_kernel_dim,
            num_params=numel + (math.prod(shapes[EMBED]) if LM_HEAD in shapes else 0),
            expert_bytes=expert_bytes, num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
            active_params=sum(o * i for o, i in linears[:-1]) + (expert_numel * config.num_experts_per_tok
                                                                 // config.num_experts if config.num_experts else 0),
            attention_width=attn * config.num_attention_heads * config.head_dim)

    def prefill_flops(self, num_tokens: int) -> float:
        """FLOPs of one prompt of `num_tokens` tokens: 2 per active weight per token, causal attention's QK^T and
        PV (2 x 2 x width per query-key pair, T (T + 1) / 2 pairs), and lm_head for the last token only."""
        pairs = num_tokens * (num_tokens + 1) / 2
        vocab, hidden = self.linear_shapes[-1]
        return 2.0 * self.active_params * num_tokens + 4.0 * self.attention_width * pairs + 2.0 * vocab * hidden

    def step_bytes(self, batch: int, mean_context: float, drafts: float) -> float:
        """Bytes one decode step moves for `batch` sequences of `mean_context` cached tokens, each verifying
        1 + drafts tokens, reading and writing its GDN state once (drafts commit in the next step: the
        deferred commit of kernels/gated_delta_rule/reference.py; the ring of draft inputs is not counted)."""
        per_seq = (mean_context * self.kv_bytes_per_token + (1 + drafts) * self.kv_bytes_per_token
                   + 2 * self.gdn_state_bytes
                   + (2 * (self.conv_kernel - 1) + drafts) * self.conv_bytes_per_column)
        return self.weights_read(batch * (1 + drafts)) + batch * per_seq

    def weights_read(self, num_tokens: float) -> float:
        """Weight bytes a step of `num_tokens` tokens reads: all but the routed experts none of them reaches."""
        if not self.expert_bytes:
            return self.weight_bytes
        reached = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(num_tokens, 1.0)
        return self.weight_bytes - self.expert_bytes * (1.0 - reached)


def _shapes(folder: Path, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every target tensor's shape (mtp.* aside): the safetensors headers, or the model's own without them."""
    try:
        files = checkpoint_files(folder)
    except CheckpointError:   # config.json only (--load-format dummy)
        import torch

        from specdec.models.hybrid_model import HybridModel
        with torch.device("meta"):
            shapes = {k: tuple(p.shape) for k, p in HybridModel(config).state_dict().items()}
        if config.tie_word_embeddings:   # one tensor, as a checkpoint stores it
            shapes.pop(LM_HEAD)
        return shapes
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for key in reader.keys():
                name = strip_prefix(key)
                if name is not None and not name.startswith("mtp."):
                    shapes[name] = tuple(reader.get_slice(key).get_shape())
    return shapes


def _layer_order(name: str) -> tuple:
    """layers.10.x after layers.9.x: the order a token passes through them."""
    parts = name.split(".")
    return (0, int(parts[1]), name) if parts[0] == "layers" and parts[1].isdigit() else (1, 0, name)


def round_sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (a small figure never rounds to 0)."""
    return float(f"{x:.{digits}g}")


def utilisation(step_bytes: float, step_seconds: float | None, copy_gbs: float | None,
                chain_gbs: float | None) -> dict:
    """Achieved bandwidth of a step and its ratio to the device copy and to the bare weight-GEMM chain."""
    if not step_seconds:
        return {"bytes_per_step": round(step_bytes), "achieved_gbs": None, "vs_copy": None, "vs_chain": None}
    achieved = step_bytes / step_seconds / 1e9
    return {"bytes_per_step": round(step_bytes), "achieved_gbs": round_sig(achieved),
            "vs_copy": round_sig(achieved / copy_gbs) if copy_gbs else None,
            "vs_chain": round_sig(achieved / chain_gbs) if chain_gbs else None}


def _fp8_bytes(shape: tuple[int, ...], block: tuple[int, int]) -> int:
    """Bytes of one FP8 matrix [out, in]: a byte a weight and a float32 scale a block."""
    return math.prod(shape) + math.ceil(shape[0] / block[0]) * math.ceil(shape[1] / block[1]) * 4

