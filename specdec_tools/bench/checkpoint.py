"""The checkpoint a bench runs on: an existing folder, or one `make-tiny` writes into it first (timed)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from specdec.models.model_config import ModelConfig

log = logging.getLogger(__name__)


def ensure_checkpoint(folder: str, make_preset: str | None, layers: int | None, seed: int = 0,
                      weights: bool = True) -> dict:
    """Use `folder` if it holds a checkpoint; else write one with make-tiny (`make_preset`, `layers` layers;
    without `weights`, config.json only). Returns how it came to be: {"made": bool, "seconds", "command"}."""
    path = Path(folder)
    if layers is not None and not make_preset:
        raise ValueError("--layers only applies to a checkpoint the bench writes: give --make-tiny PRESET too")
    if (path / "config.json").is_file():
        config = ModelConfig.from_folder(path)
        if layers is not None and config.num_hidden_layers != layers:
            raise ValueError(f"--layers {layers}: {path} already holds a checkpoint of {config.num_hidden_layers} "
                             f"layers; remove it or give another --model folder")
        return {"made": False}
    if not make_preset:
        raise FileNotFoundError(f"--model {path}: no config.json there; give --make-tiny PRESET to write one")
    from specdec_tools.tiny import make_tiny
    overrides = {"num_hidden_layers": layers} if layers is not None else {}
    command = f"specdec make-tiny {path} --preset {make_preset} --seed {seed}" + (
        f" --set num_hidden_layers={layers}" if layers is not None else "") + ("" if weights else " --config-only")
    log.info("writing the checkpoint: %s", command)
    start = time.perf_counter()
    make_tiny(path, preset=make_preset, seed=seed, overrides=overrides, progress=True, weights=weights)
    seconds = round(time.perf_counter() - start, 1)
    log.info("checkpoint written in %.1f s", seconds)
    return {"made": True, "seconds": seconds, "command": command}


def describe(folder: str, dtype: str, traffic) -> dict:
    config = ModelConfig.from_folder(folder)
    return {"path": str(folder), "name": Path(folder).name, "model_type": config.model_type,
            "layers": config.num_hidden_layers, "attention_layers": len(config.attention_layers),
            "gdn_layers": len(config.gdn_layers), "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "dtype": dtype, "params": traffic.num_params,
            "weight_bytes_per_step": traffic.weight_bytes, "weight_gb": traffic.weight_bytes / 1e9,
            "kv_bytes_per_token": traffic.kv_bytes_per_token, "gdn_state_bytes_per_seq": traffic.gdn_state_bytes}
