"""Writing the trained model as a Hugging Face checkpoint folder.

    config.json        model_type "qwen3_5_text", architectures ["Qwen3_5ForCausalLM"], mtp_num_hidden_layers 1
    model.safetensors  bfloat16; the trunk under the keys Qwen3_5ForCausalLM.save_pretrained writes
                       (model.embed_tokens.weight, model.layers.N.*, model.norm.weight; no lm_head.weight,
                       it is tied) plus mtp.fc.weight, mtp.pre_fc_norm_{embedding,hidden}.weight,
                       mtp.layers.0.*, mtp.norm.weight
    tokenizer files    written by bpe.save_tokenizer
    README.md, training_log.json   written by model_card
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .model import DemoModel

MAX_FOLDER_BYTES = 30_000_000  # 30 MB (decimal)
EXPORT_DTYPE = torch.bfloat16
# PreTrainedConfig bookkeeping with nothing to say about a causal LM; left out of config.json
GENERIC_FIELDS = ("id2label", "label2id", "problem_type", "output_hidden_states", "output_attentions",
                  "return_dict", "chunk_size_feed_forward", "is_encoder_decoder")


def export_tensors(model: DemoModel, dtype: torch.dtype = EXPORT_DTYPE) -> dict[str, torch.Tensor]:
    trunk = {k: v for k, v in model.trunk.state_dict().items() if k != "lm_head.weight"}
    mtp = {f"mtp.{k}": v for k, v in model.mtp.state_dict().items()}
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in {**trunk, **mtp}.items()}


def config_dict(model: DemoModel, dtype: torch.dtype = EXPORT_DTYPE) -> dict:
    cfg = model.config.to_dict()
    for key in ("_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
                *GENERIC_FIELDS):
        cfg.pop(key, None)
    dtype_name = str(dtype).removeprefix("torch.")
    first_full = cfg["layer_types"].index("full_attention") if "full_attention" in cfg["layer_types"] else 0
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            **cfg, "full_attention_interval": first_full + 1, "mtp_num_hidden_layers": 1,
            "dtype": dtype_name, "torch_dtype": dtype_name,
            "transformers_version": model.config.to_dict().get("transformers_version")}


def write_weights(model: DemoModel, out: Path) -> dict:
    """config.json + model.safetensors; returns a summary for the training log."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = export_tensors(model)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_dict(model), indent=2) + "\n")
    mtp_keys = [k for k in tensors if k.startswith("mtp.")]
    return {"dtype": str(EXPORT_DTYPE).removeprefix("torch."), "tensors": len(tensors),
            "mtp_tensors": len(mtp_keys), "parameters_written": sum(t.numel() for t in tensors.values()),
            "model_safetensors_bytes": (out / "model.safetensors").stat().st_size}


def folder_files(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}


def check_folder_size(out: Path, limit: int = MAX_FOLDER_BYTES) -> int:
    total = sum(folder_files(out).values())
    if total > limit:
        raise RuntimeError(f"{out}: checkpoint folder is {total / 1e6:.2f} MB, over the {limit / 1e6:.0f} MB "
                           f"limit; choose a smaller --hidden / --layers / --intermediate / --vocab-size")
    return total
