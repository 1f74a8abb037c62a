"""Random checkpoints in the exact Hugging Face layout, for tests and benchmarks.

    make_tiny("/tmp/m", family="qwen3_5_moe", preset="tiny", seed=1)

writes config.json + model.safetensors (or shards + model.safetensors.index.json) and optionally
a byte-level BPE tokenizer. Output is a pure function of the arguments: every tensor is drawn from
its own `torch.Generator` seeded from (`seed`, the tensor's layout-independent name), so the same
arguments give byte-identical files, and the text / multimodal layouts or the per-expert / fused
expert layouts of one seed hold the same numbers. Which tensors, and their values: tiny_tensors.py;
presets and config identities: tiny_presets.py; this module writes config.json, the shards and the tokenizer.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdec.models.fp8 import SCALE_SUFFIX, Fp8Format, quantize_blocks

from .tiny_presets import BF16_PRESETS, FAMILIES, MOE_FIELDS, PRESET_FAMILIES, PRESETS, VISION_MODEL_TYPE, layer_types
from .tiny_tensors import draw, tensor_specs

__all__ = ["PRESETS", "SHARD_BYTES", "make_tiny"]

SHARD_BYTES = 2 * 10**9          # max bytes per safetensors shard (monkeypatch in tests)
PROGRESS_MIN_PARAMS = 50_000_000  # show a tqdm bar only for models at least this large
EOS_TOKEN = "<|endoftext|>"
TRANSFORMERS_VERSION = "5.2.0"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_tiny(out_dir: str | Path, *, family: str | None = None, preset: str = "tiny", seed: int = 0,
              layout: str = "text", mtp_layers: int = 1, tokenizer: bool = False,
              dtype: str | None = None, overrides: dict | None = None, progress: bool = True,
              expert_layout: str = "per_expert", weights: bool = True, quantization: str = "none",
              fp8_block: tuple[int, int] = (128, 128)) -> Path:
    """Write a random checkpoint into `out_dir` (created) and return its path.

    family: "qwen3_5" | "qwen3_5_moe" | "qwen3_next" (default: the preset's, else qwen3_5);
    layout: "text" | "multimodal" (not for qwen3_next); preset: a key of PRESETS; overrides: text-config fields
    applied after the preset (giving "full_attention_interval" or "num_hidden_layers" regenerates "layer_types");
    mtp_layers: MTP decoder layers (0 = no MTP head); dtype: "float32" | "bfloat16" | "float16"
    (default float32, bfloat16 for the real-size presets); expert_layout: "per_expert" writes
    mlp.experts.E.{gate,up,down}_proj.weight, "fused" writes mlp.experts.gate_up_proj [E, 2I, H]
    and mlp.experts.down_proj [E, H, I]; tokenizer: also write a byte-level BPE tokenizer (needs
    vocab_size >= 258) whose `<|endoftext|>` id becomes eos_token_id; weights=False: config.json (and the
    tokenizer) only, for `--load-format dummy`; quantization "fp8": the linears in Qwen's FP8 format
    (specdec/models/fp8.py: float8_e4m3fn weights, 128 x 128 block scales, quantization_config in config.json);
    fp8_block: the scale blocks' rows x columns (tests take smaller ones, for several blocks a row in tiny shapes).
    """
    family = family or PRESET_FAMILIES.get(preset, "qwen3_5")
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    if layout not in FAMILIES[family]:
        raise ValueError(f"family {family!r} has no layout {layout!r}; choose from {sorted(FAMILIES[family])}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"expert_layout must be 'per_expert' or 'fused', not {expert_layout!r}")
    if quantization not in ("none", "fp8"):
        raise ValueError(f"quantization must be 'none' or 'fp8', not {quantization!r}")
    if not isinstance(fp8_block, tuple) or len(fp8_block) != 2 or not all(isinstance(b, int) and b > 0
                                                                           for b in fp8_block):
        raise ValueError(f"fp8_block must be two positive integers, not {fp8_block!r}")
    fp8 = Fp8Format(tuple(fp8_block)) if quantization == "fp8" else None
    if mtp_layers < 0:
        raise ValueError(f"mtp_layers must be >= 0, not {mtp_layers}")
    dtype = dtype or ("bfloat16" if preset in BF16_PRESETS else "float32")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")

    text = _text_config(family, preset, overrides, mtp_layers, dtype)
    if tokenizer and text["vocab_size"] < 258:
        raise ValueError(f"vocab_size {text['vocab_size']} is too small for a byte-level tokenizer "
                         f"(needs >= 258: 256 byte tokens + {EOS_TOKEN}); pass "
                         f"overrides={{'vocab_size': 258 or more}}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        text["eos_token_id"] = _write_tokenizer(out, text["vocab_size"])
    if weights:
        _write_tensors(out, tensor_specs(family, layout, text, expert_layout), seed, _DTYPES[dtype], progress, fp8)
    config = _full_config(family, layout, text, dtype) | ({"quantization_config": fp8.to_config()} if fp8 else {})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


# ---- config.json -------------------------------------------------------------------------------
def _text_config(family: str, preset: str, overrides: dict | None, mtp_layers: int, dtype: str) -> dict:
    cfg = copy.deepcopy(PRESETS[preset])
    if family == "qwen3_5":
        for k in MOE_FIELDS:
            cfg.pop(k)
    if family == "qwen3_next":
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    ov = copy.deepcopy(dict(overrides or {}))
    cfg.update(ov)
    if "layer_types" not in ov and ("full_attention_interval" in ov or "num_hidden_layers" in ov):
        cfg["layer_types"] = layer_types(int(cfg["num_hidden_layers"]), int(cfg["full_attention_interval"]))
    if len(cfg["layer_types"]) != cfg["num_hidden_layers"]:
        raise ValueError(f"layer_types has {len(cfg['layer_types'])} entries, "
                         f"num_hidden_layers is {cfg['num_hidden_layers']}")
    cfg["mtp_num_hidden_layers"] = mtp_layers
    cfg["dtype"] = dtype
    return cfg


def _full_config(family: str, layout: str, text: dict, dtype: str) -> dict:
    model_type, arch, text_model_type = FAMILIES[family][layout]
    head = {"architectures": [arch], "model_type": model_type}
    tail = {"torch_dtype": dtype, "dtype": dtype, "transformers_version": TRANSFORMERS_VERSION}
    if text_model_type is None:
        text = {k: v for k, v in text.items() if k != "dtype"}
        return {**head, **text, **tail}
    vision = {"model_type": VISION_MODEL_TYPE[family], "depth": 1, "hidden_size": 16, "num_heads": 2,
              "intermediate_size": 32, "out_hidden_size": text["hidden_size"]}
    return {**head, "text_config": {"model_type": text_model_type, **text}, "vision_config": vision,
            "tie_word_embeddings": text["tie_word_embeddings"], **tail}


def _write_tensors(out: Path, specs: list, seed: int, dtype: torch.dtype, progress: bool,
                   fp8: Fp8Format | None = None) -> None:
    esize = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(shape) * esize for _, _, shape, _ in specs]
    total = sum(sizes)
    groups: list[list[int]] = [[]]
    used = 0
    for idx, size in enumerate(sizes):  # greedy packing, in writing order
        if groups[-1] and used + size > SHARD_BYTES:
            groups.append([])
            used = 0
        groups[-1].append(idx)
        used += size
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    n = len(groups)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    bar = None
    if progress and total // esize >= PROGRESS_MIN_PARAMS:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(specs), desc="make_tiny", unit="tensor")
    weight_map = {}
    for fname, group in zip(files, groups):
        shard = {}
        for idx in group:
            key, name, shape, init = specs[idx]
            shard[key] = draw(seed, name, shape, init).to(dtype).contiguous()
            weight_map[key] = fname
            if fp8 is not None and fp8.converts(key, tuple(shape)):
                shard[key], shard[key + SCALE_SUFFIX] = quantize_blocks(shard[key], fp8.block)
                weight_map[key + SCALE_SUFFIX] = fname
            if bar is not None:
                bar.update(1)
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        del shard
    if bar is not None:
        bar.close()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---- tokenizer ---------------------------------------------------------------------------------
def _corpus() -> list[str]:
    """A few dozen KB of deterministic text: the interpreter's own stdlib sources."""
    import inspect
    import json.decoder
    import json.encoder
    import string
    import textwrap
    return [inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap, string)]


def _write_tokenizer(out: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:  # cannot happen with the trainer's limit; guard anyway
        raise ValueError(f"trained tokenizer has {tok.get_vocab_size()} tokens > vocab_size {vocab_size}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=None, pad_token=EOS_TOKEN)
    fast.save_pretrained(str(out))
    return tok.token_to_id(EOS_TOKEN)
