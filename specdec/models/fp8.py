"""FP8 weights as Qwen ships them: block-scaled float8_e4m3fn linears, read (dequantized) and written.

A checkpoint's config.json says

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                            "activation_scheme": "dynamic", "modules_to_not_convert": [...]}

and each quantized linear `X` stores `X.weight` (float8_e4m3fn, [out, in]; experts may stack them [E, out, in]) and
`X.weight_scale_inv` (float32, [ceil(out / b0), ceil(in / b1)], leading dims alike). The real weight is

    W[i, j] = weight[i, j] · scale_inv[i // b0, j // b1]          (partial edge blocks included)

What stays as stored (bf16): embeddings, lm_head, norms, router gates, conv1d, A_log, dt_bias, and any module whose
name starts with an entry of modules_to_not_convert. Quantizing (`quantize_blocks`) writes the same format:
scale_inv = max|W| over the block / 448 (the largest e4m3 value), weight = W / scale_inv rounded to e4m3.

This module reads and writes the format. The loader dequantizes FP8 tensors into the model's dtype (the CPU's path,
and everywhere for the MTP head), and `--quantization fp8` rounds a bf16 checkpoint's weights through the same
format; on a GPU the linears keep their FP8 bytes instead (fp8_linear.py), and the MoE routed experts are quantized
back into it (mlp.py: SparseMoE.keep_experts_fp8).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .model_config import CheckpointError
from .tensor_parallel import Shard, take

E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
QUANTIZATIONS = ("none", "fp8")
# linears Qwen keeps in bf16 (besides modules_to_not_convert): routers, the shared expert's gate
_NEVER = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight")


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] = (128, 128)
    not_converted: tuple[str, ...] = ()           # module name prefixes kept as stored

    @staticmethod
    def from_config(config: dict) -> "Fp8Format | None":
        """The format of a config.json (its quantization_config, top level or text_config's); None: none.
        CheckpointError for a quantization we do not read."""
        quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
        if not quant:
            return None
        method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
        if method != "fp8" or fmt != "e4m3":
            raise CheckpointError(f"config.json: quantization_config {method!r} / {fmt!r} is not supported "
                                  f"(FP8 e4m3 with block scales is)")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise CheckpointError("config.json: only activation_scheme \"dynamic\" FP8 checkpoints are supported")
        block = quant.get("weight_block_size") or [128, 128]
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise CheckpointError(f"config.json: weight_block_size must be two positive integers, got {block!r}")
        return Fp8Format((block[0], block[1]), tuple(quant.get("modules_to_not_convert") or ()))

    def to_config(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block),
                "activation_scheme": "dynamic", "modules_to_not_convert": list(self.not_converted)}

    def converts(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the checkpoint tensor `name` (a linear's weight, 2-D or experts' 3-D) is stored in FP8."""
        # norms, A_log and dt_bias are 1-D; conv1d is the one 3-D weight that is not a stack of experts
        if not name.endswith(("weight", "_proj")) or len(shape) not in (2, 3) or name.endswith(_NEVER):
            return False
        if "conv1d" in name:
            return False
        module = name[:-len(".weight")] if name.endswith(".weight") else name
        return not any(_under(module, prefix) for prefix in self.not_converted)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """weight [..., out, in] (e4m3 values, any float dtype) × scale_inv [..., ceil(out/b0), ceil(in/b1)] → dtype."""
    out_dim, in_dim = weight.shape[-2:]
    want = (math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1]))
    if tuple(scale_inv.shape[-2:]) != want or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise CheckpointError(f"FP8 scales of shape {tuple(scale_inv.shape)} do not fit a weight of shape "
                              f"{tuple(weight.shape)} in {block[0]} x {block[1]} blocks")
    scales = scale_inv.float().repeat_interleave(block[0], -2)[..., :out_dim, :]
    scales = scales.repeat_interleave(block[1], -1)[..., :in_dim]                      # [..., out, in]
    return (weight.float() * scales).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] → (float8_e4m3fn weight, float32 scale_inv [..., ceil(out/b0), ceil(in/b1)])."""
    out_dim, in_dim = weight.shape[-2:]
    rows, cols = math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])
    padded = torch.zeros(*weight.shape[:-2], rows * block[0], cols * block[1], dtype=torch.float32,
                         device=weight.device)
    padded[..., :out_dim, :in_dim] = weight.float()
    blocks = padded.unflatten(-1, (cols, block[1])).unflatten(-3, (rows, block[0]))   # [..., R, b0, C, b1]
    amax = blocks.abs().amax(dim=(-3, -1))                                            # [..., R, C]
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale_inv


def dequantize_checkpoint(tensors: dict[str, torch.Tensor], fmt: Fp8Format,
                          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (prefix-stripped names) with every `X` + `X_scale_inv` pair replaced by the real `X` in
    `dtype`. CheckpointError for a scale without its weight or an FP8 weight without its scale."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name[:-len(SCALE_SUFFIX)] not in tensors:
                raise CheckpointError(f"FP8 scale {name} has no weight {name[:-len(SCALE_SUFFIX)]}")
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is not None:
            out[name] = dequantize_blocks(t, scale, fmt.block, dtype)
        elif t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"FP8 weight {name} has no {name + SCALE_SUFFIX}")
        else:
            out[name] = t
    return out


def round_through_fp8(tensors: dict[str, torch.Tensor], fmt: Fp8Format) -> dict[str, torch.Tensor]:
    """`--quantization fp8` on a bf16 checkpoint: each weight FP8 would store, quantized and dequantized."""
    out = {}
    for name, t in tensors.items():
        if fmt.converts(name, tuple(t.shape)):
            t = dequantize_blocks(*quantize_blocks(t, fmt.block), fmt.block, t.dtype)
        out[name] = t
    return out


def scale_shard(shard: Shard, ndim: int, block: tuple[int, int]) -> Shard | None:
    """The rows of `X_scale_inv` that go with a tensor-parallel rank's `shard` of the FP8 weight X (ndim 2: [out, in],
    3: experts [E, out, in]): the blocks its slices cover. The slices' rows must line up with those blocks: each but
    the last starts on a block and is whole blocks long; the last starts on a block or lies inside one. Else None."""
    b = _block_side(shard, ndim, block)
    *head, last = shard.rows
    if any(r.start % b or len(r) % b for r in head) or (last.start % b and last.start // b != (last.stop - 1) // b):
        return None
    return Shard(shard.dim, [range(r.start // b, -(-r.stop // b)) for r in shard.rows])


@dataclass
class Fp8Shards:
    """What a tensor-parallel rank reads of an FP8 checkpoint (the loader's `shard` callback): its slices of each
    FP8 weight and the scale blocks that go with them (`scale_shard`). Slices whose rows do not line up with the
    blocks (the gate and up rows of Qwen3-Next's fused expert stacks at TP 8: 64 of 512 each a rank) are read
    widened to the blocks they touch; `finish` dequantizes those weights into the model's dtype and cuts the
    rank's rows out, so that weight runs unquantized on that rank."""
    shard_of: Callable[[str], Shard | None]        # a checkpoint tensor's slices (tensor_parallel.shard_of)
    block: tuple[int, int]
    scaled: dict[str, int]                         # each weight stored with a scale → its number of dims
    widened: dict[str, tuple[Shard, Shard]] = field(default_factory=dict)   # weight → (its slices, as read)

    def __call__(self, name: str) -> Shard | None:
        weight = name.removesuffix(SCALE_SUFFIX)
        shard = self.shard_of(weight)
        if shard is None or weight not in self.scaled:
            return shard
        ndim = self.scaled[weight]
        scales = scale_shard(shard, ndim, self.block)
        if scales is None:
            b = _block_side(shard, ndim, self.block)
            read = Shard(shard.dim, [range(r.start // b * b, -(-r.stop // b) * b) for r in shard.rows])
            self.widened[weight] = (shard, read)
            shard, scales = read, scale_shard(read, ndim, self.block)
        return scales if name.endswith(SCALE_SUFFIX) else shard

    def finish(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The weights read widened, dequantized and cut to the rank's rows, in place."""
        for weight, (shard, read) in self.widened.items():
            if weight not in tensors:
                continue
            t = dequantize_blocks(tensors[weight], tensors.pop(weight + SCALE_SUFFIX), self.block, dtype)
            rows, at = [], 0                       # the rank's rows inside the widened slices read back to back
            for r, w in zip(shard.rows, read.rows):
                rows.append(range(at + r.start - w.start, at + r.stop - w.start))
                at += len(w)
            tensors[weight] = take(t, Shard(shard.dim, rows))
        return tensors


def _block_side(shard: Shard, ndim: int, block: tuple[int, int]) -> int:
    """The scale block's side along the dimension `shard` splits (rows: block[0], columns: block[1])."""
    return block[0] if shard.dim == ndim - 2 else block[1]


def _under(module: str, prefix: str) -> bool:
    """modules_to_not_convert entries name a module or any part of its dotted path ("mtp", "layers.3.mlp")."""
    prefix = prefix.removeprefix("model.language_model.").removeprefix("model.")
    return module == prefix or module.startswith(prefix + ".") or f".{prefix}." in f".{module}."
