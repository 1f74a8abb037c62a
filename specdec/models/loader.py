"""Load a Hugging Face checkpoint folder into our HybridModel.

Reads `config.json` and `model.safetensors` or a sharded `model.safetensors.index.json`; renames and
re-lays-out tensors (checkpoint_keys), checks every name and shape against the model before assigning,
and keeps the `mtp.*` tensors apart for the MTP drafter. FP8 checkpoints (fp8.py) keep their linears (fp8_linear.py)
and their MoE routed experts (mlp.py) in FP8 on a GPU and are dequantized into the model's dtype elsewhere;
`quantization="fp8"` quantizes a bf16 checkpoint's weights the same way at load time. Problems raise one
CheckpointError naming them.
"""
from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from .checkpoint_keys import strip_prefix, to_canonical
from .fp8 import QUANTIZATIONS, SCALE_SUFFIX, Fp8Format, Fp8Shards, dequantize_checkpoint, round_through_fp8
from .fp8_linear import experts_to_fp8, stored_experts_of, to_fp8_linears
from .fused_linear import fuse_projections
from .hybrid_model import HybridModel
from .model_config import CheckpointError, ModelConfig
from .tensor_parallel import Shard, TensorParallel, shard_of, take

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
LOAD_FORMATS = ("safetensors", "dummy")
PROGRESS_BYTES = 256 << 20  # show a progress bar from this checkpoint size on


@dataclass
class LoadedModel:
    config: ModelConfig
    model: HybridModel
    mtp_weights: dict[str, torch.Tensor]  # `mtp.` stripped, canonical names (e.g. "fc.weight", "layers.0...")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} names shard {f.name}, which is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def read_tensors(files: list[Path], dtype: torch.dtype, device: torch.device | str,
                 progress: bool | None, keep: Callable[[str], bool] | None = None,
                 shard: Callable[[str], Shard | None] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint (those whose prefix-stripped name `keep` accepts; all by default) under
    prefix-stripped names, cast to `dtype` on `device` (FP8 weights and their scales as stored). `shard`: the part of each tensor to read (a tensor-parallel
    rank's slices: only their bytes are read)."""
    total = sum(f.stat().st_size for f in files)
    show = progress if progress is not None else total >= PROGRESS_BYTES
    out: dict[str, torch.Tensor] = {}
    with tqdm(total=total if shard is None else None, unit="B", unit_scale=True, desc="loading weights",
              disable=not show) as bar:
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as reader:
                    for key in reader.keys():
                        name = strip_prefix(key)
                        if name is None or (keep is not None and not keep(name)):
                            continue
                        part = shard(name) if shard is not None else None
                        t = reader.get_tensor(key) if part is None else _read_slices(reader, key, part)
                        bar.update(t.numel() * t.element_size())
                        # FP8 weights stay e4m3 (a byte each) and their scales fp32; the rest is cast
                        cast = t.is_floating_point() and t.dtype != torch.float8_e4m3fn \
                            and not name.endswith(SCALE_SUFFIX)
                        out[name] = t.to(device=device, dtype=dtype if cast else t.dtype)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
    return out


def scaled_weights(files: list[Path]) -> dict[str, int]:
    """An FP8 checkpoint's weights stored with a block scale (prefix-stripped names) → their number of dims."""
    scaled = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as reader:
                for key in reader.keys():
                    name = strip_prefix(key)
                    if name is not None and name.endswith(SCALE_SUFFIX):
                        scaled[name.removesuffix(SCALE_SUFFIX)] = len(reader.get_slice(key).get_shape())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
    return scaled


def _read_slices(reader, key: str, shard: Shard) -> torch.Tensor:
    """Only `shard`'s rows of the checkpoint tensor `key`, as `take` cuts them: each slice's rows past the tensor's end
    read as zeros (the vocabulary's padding; an FP8 slice widened to its blocks, fp8.Fp8Shards)."""
    view = reader.get_slice(key)
    shape = view.get_shape()
    parts = []
    for rows in shard.rows:
        index = [slice(None)] * len(shape)
        index[shard.dim] = slice(min(rows.start, shape[shard.dim]), min(rows.stop, shape[shard.dim]))
        part = view[tuple(index)]
        parts.append(take(part, Shard(shard.dim, [range(0, len(rows))])))          # padded to the slice's length
    return torch.cat(parts, dim=shard.dim) if len(parts) > 1 else parts[0]


def dummy_tensors(shapes: dict[str, torch.Size], dtype: torch.dtype, device: torch.device | str,
                  seed: int = 0, distinct: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Random weights of these shapes, made on the device (`--load-format dummy`: benchmarks of shapes whose
    checkpoint is not at hand; the output is meaningless). Linears and embeddings ~ N(0, 0.02²); zero-centred
    norms 0 (a scale of 1); the GDN output norm 1; A_log = log(U(1, 16)) and dt_bias 0, as the model is initialised.
    Each tensor's draw depends on its name only, plus `seed` for the names `distinct` accepts (all by default):
    tensor-parallel ranks draw different shards and the same replicated tensors (the router)."""
    generator = torch.Generator(device=device)
    out = {}
    for name, shape in shapes.items():
        own = distinct is None or distinct(name)
        generator.manual_seed(zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF if own else 0))  # 32 bits
        t = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("linear_attn.norm.weight"):
            t.fill_(1.0)
        elif name.endswith(("norm.weight", "layernorm.weight", "dt_bias")):
            t.zero_()
        elif name.endswith("A_log"):
            t.uniform_(1.0, 16.0, generator=generator).log_()
        else:
            t.normal_(0.0, 0.02, generator=generator)
        out[name] = t
    return out


def checkpoint_name(name: str) -> str:
    """A parameter's name as checkpoints spell it (the model's conv1d_weight / experts_gate_up / experts_down)."""
    return (name.replace("conv1d_weight", "conv1d.weight").replace("experts_gate_up", "experts.gate_up_proj")
            .replace("experts_down", "experts.down_proj"))


def check_against(expected: dict[str, torch.Size], given: dict[str, torch.Tensor], where: str) -> None:
    problems = [f"missing tensor {checkpoint_name(k)}" for k in expected if k not in given]
    problems += [f"unexpected tensor {checkpoint_name(k)}" for k in given if k not in expected]
    problems += [f"tensor {checkpoint_name(k)} has shape {tuple(given[k].shape)}, expected {tuple(shape)}"
                 for k, shape in expected.items() if k in given and given[k].shape != shape]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"{where}: " + "; ".join(problems[:5]) + more)


def load_model(folder: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               progress: bool | None = None, tp: TensorParallel = TensorParallel(),
               load_format: str = "safetensors", quantization: str = "none",
               fp8_weights: bool | None = None) -> LoadedModel:
    """The target in `folder`. Under tensor parallelism (`tp`) only this rank's shard is read, and the mtp.* tensors
    are left to the drafter service. load_format "dummy": random weights of the config's shapes, no files read.
    quantization "fp8": the weights an FP8 checkpoint would store are rounded through FP8 blocks (an FP8
    checkpoint is read as it is either way; under `tp` each rank rounds its own slices in blocks of their own,
    which differ from one GPU's where a slice is not whole blocks). An FP8 checkpoint under `tp`: fp8.Fp8Shards.
    fp8_weights (default: on CUDA): those linears and the MoE routed experts keep their FP8 weights and run FP8
    kernels (fp8_linear.py, mlp.py); else they are dequantized into `dtype` (the reference path)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load format must be one of {', '.join(LOAD_FORMATS)}, not {load_format!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    fp8 = fp8_format(folder)
    torch_dtype = parse_dtype(dtype)
    quantized = fp8 is not None or quantization == "fp8"
    keep_fp8 = quantized and (fp8_kernels_run(torch.device(device)) if fp8_weights is None else fp8_weights)
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # an FP8 checkpoint's linears: (e4m3 [out, in], scales)
    stored_experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}   # its routed experts, stacked alike
    with torch.device("meta"):
        model = HybridModel(config, tp)
    expected = {k: p.shape for k, p in model.state_dict().items()}
    linears = frozenset(f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear))
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    if load_format == "dummy":
        sharded = lambda name: shard_of(config, tp, name) is not None  # noqa: E731
        target, mtp = dummy_tensors(expected, torch_dtype, device, seed=tp.rank, distinct=sharded), {}
        log.warning("--load-format dummy: random weights of %s's shapes (benchmarks only, the output is noise)",
                    folder.name)
    else:
        keep = (lambda name: not name.startswith("mtp.")) if tp.active else None  # noqa: E731
        shard = (lambda name: shard_of(config, tp, name)) if tp.active else None  # noqa: E731
        if shard is not None and fp8 is not None:   # each slice with its scale blocks
            shard = Fp8Shards(shard, fp8.block, scaled_weights(checkpoint_files(folder)))
        tensors = read_tensors(checkpoint_files(folder), torch_dtype, device, progress, keep, shard)
        if isinstance(shard, Fp8Shards):
            tensors = shard.finish(tensors, torch_dtype)
        if fp8 is not None:
            if keep_fp8:
                stored = {name: (tensors[name], tensors[name + SCALE_SUFFIX])
                          for name in linears if name + SCALE_SUFFIX in tensors}
                stored_experts, consumed = stored_experts_of(model.config, fp8, tensors)
                for name in consumed:   # never dequantized: the layers take the e4m3 tensors below
                    del tensors[name]
            tensors = dequantize_checkpoint(tensors, fp8, torch_dtype)
            tensors |= {k: q for k, (q, _) in stored_experts.items()}
        else:
            e4m3 = [k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
            if e4m3:
                raise CheckpointError(f"{folder}: {e4m3[0]} is float8_e4m3fn but config.json has no FP8 "
                                      f"quantization_config (its block scales cannot be read)")
            if quantization == "fp8":   # (quantizing a rounded weight again gives the same bytes, for the linears)
                tensors = round_through_fp8(tensors, Fp8Format())
        canonical = to_canonical(model.config, tensors)      # (stored experts already under our names)
        mtp = {k[len("mtp."):]: v for k, v in canonical.items() if k.startswith("mtp.")}
        target = {k: v for k, v in canonical.items() if not k.startswith("mtp.")}
    if config.tie_word_embeddings:
        target.pop("lm_head.weight", None)
    check_against(expected, target, str(folder))
    model.load_state_dict(target, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False).eval()
    num_fp8 = 0
    num_experts_fp8 = 0
    if keep_fp8:   # an FP8 checkpoint: exactly the linears it stores in FP8; --quantization fp8: what Qwen's would
        from_files = fp8 is not None and load_format != "dummy"   # dummy: every linear an FP8 checkpoint stores
        num_fp8 = to_fp8_linears(model, fp8 or Fp8Format(), stored, only_stored=from_files)
        num_experts_fp8 = experts_to_fp8(model, fp8 or Fp8Format(), stored_experts)
    stored.clear()
    stored_experts.clear()
    fuse_projections(model)
    outcome = (f", {num_fp8} linears and {num_experts_fp8} MoE layers' experts in FP8" if keep_fp8
               else ", FP8 checkpoint dequantized" if fp8 else ", weights rounded through FP8" if quantized else "")
    log.info("loaded %s (%s, %d layers, %s%s) from %s; %d mtp tensors%s", config.model_type, config.family,
             config.num_hidden_layers, torch_dtype, outcome, folder, len(mtp),
             f"; tensor-parallel rank {tp.rank} of {tp.size}" if tp.active else "")
    return LoadedModel(config=config, model=model, mtp_weights=mtp)


SHARED_WITH_DRAFTER = ("embed_tokens.weight", "lm_head.weight")


def load_drafter_weights(folder: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                         shared: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Only what an MTP drafter needs: (config, mtp tensors, shared embed_tokens / lm_head weights).
    With shared=False the embedding and lm_head are not read (they come from the verifier over CUDA IPC)."""
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    wanted = lambda name: name.startswith("mtp.") or (shared and name in SHARED_WITH_DRAFTER)  # noqa: E731
    tensors = read_tensors(checkpoint_files(folder), parse_dtype(dtype), device, None, wanted)
    fp8 = fp8_format(folder)
    tensors = to_canonical(config, dequantize_checkpoint(tensors, fp8, parse_dtype(dtype)) if fp8 else tensors)
    mtp = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
    weights = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    if shared and config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    for name in SHARED_WITH_DRAFTER if shared else ():
        if name not in weights:
            raise CheckpointError(f"{folder}: missing tensor {name}")
    return config, mtp, weights


def fp8_kernels_run(device: torch.device) -> bool:
    """Whether FP8 weights stay FP8 on `device`: CUDA with float8 e4m3 support in Triton (compute capability 8.9+:
    Ada, Hopper and later); elsewhere they are dequantized at load."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_format(folder: Path) -> Fp8Format | None:
    """The folder's FP8 format (config.json's quantization_config), None for a bf16 / fp32 checkpoint."""
    return Fp8Format.from_config(json.loads((Path(folder) / "config.json").read_text()))


def has_mtp_weights(folder: str | Path) -> bool:
    """Whether the checkpoint carries mtp.* tensors (reads only the safetensors headers)."""
    for f in checkpoint_files(Path(folder)):
        with safe_open(str(f), framework="pt") as reader:
            if any(strip_prefix(k) is not None and strip_prefix(k).startswith("mtp.") for k in reader.keys()):
                return True
    return False
