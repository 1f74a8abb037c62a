"""Builds the drafter a `specdec drafter` process serves, from its config."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .drafter import Drafter
from .ngram import NgramDrafter
from .synthetic import SyntheticDrafter, acceptance_rate_for

log = logging.getLogger(__name__)
KINDS = ("mtp", "ngram", "synthetic")


@dataclass(frozen=True)
class DrafterConfig:
    kind: str
    max_drafts: int = 3
    model_dir: str | None = None       # mtp: the checkpoint with mtp.* tensors
    device: str = "cpu"
    dtype: str = "float32"
    num_blocks: int = 4096             # mtp KV blocks
    block_size: int = 16
    references: str | None = None      # synthetic: JSON file, a list of token-id lists (prompt + continuation)
    mean_acceptance_length: float | None = None  # synthetic: target, sets the corruption rate
    vocab_size: int = 0                # synthetic: for corrupted tokens (0: from model_dir)
    seed: int = 0


class DrafterHolder:
    """The served drafter. An MTP drafter on a GPU waits for the verifier's shared weights (CUDA IPC) before it
    exists, so that it holds no second copy of embed_tokens / lm_head; anywhere else it loads them itself."""

    def __init__(self, config: DrafterConfig):
        if config.kind not in KINDS:
            raise ValueError(f"unknown drafter kind {config.kind!r}; choose one of {', '.join(KINDS)}")
        self.config = config
        self.drafter: Drafter | None = None
        self.mtp_parts = None
        if config.kind == "mtp":
            self._load_mtp_parts()
        else:
            self.drafter = self._build_model_free()

    @property
    def needs_hidden(self) -> bool:
        return self.config.kind == "mtp"

    @property
    def wants_shared_weights(self) -> bool:
        return self.config.kind == "mtp" and self.config.device.startswith("cuda")

    def _load_mtp_parts(self) -> None:
        from specdec.models.loader import load_drafter_weights
        if not self.config.model_dir:
            raise ValueError("the mtp drafter needs --model (a checkpoint with mtp.* tensors)")
        config, mtp, shared = load_drafter_weights(self.config.model_dir, self.config.dtype, self.config.device,
                                                   shared=not self.wants_shared_weights)
        if not mtp:
            raise ValueError(f"{self.config.model_dir} has no mtp.* tensors: serve --kind ngram instead")
        self.mtp_parts = (config, mtp)
        if shared:
            self.attach(shared["embed_tokens.weight"], shared["lm_head.weight"])

    def attach(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        from .mtp.mtp_drafter import MTPDrafter
        config, mtp = self.mtp_parts
        c = self.config
        self.drafter = MTPDrafter.from_parts(config, mtp, embed_weight, lm_head_weight, c.max_drafts,
                                             c.num_blocks, c.block_size, c.device)
        log.info("mtp drafter ready: %d layer(s), k=%d, %s", len(self.drafter.head.layers), c.max_drafts, c.device)

    def load_shared_from_folder(self) -> None:
        """The verifier could not share weights (not the same GPU): read them from the folder after all."""
        from specdec.models.loader import load_drafter_weights
        _, _, shared = load_drafter_weights(self.config.model_dir, self.config.dtype, self.config.device)
        self.attach(shared["embed_tokens.weight"], shared["lm_head.weight"])

    def _build_model_free(self) -> Drafter:
        c = self.config
        if c.kind == "ngram":
            return NgramDrafter(c.max_drafts)
        if not c.references:
            raise ValueError("the synthetic drafter needs --references FILE (prompt + recorded continuation)")
        references = json.loads(Path(c.references).read_text())
        vocab = c.vocab_size or _vocab_of(c.model_dir)
        rate = acceptance_rate_for(c.mean_acceptance_length, c.max_drafts) if c.mean_acceptance_length else 1.0
        return SyntheticDrafter(references, c.max_drafts, vocab, accept_rate=rate, seed=c.seed)


def _vocab_of(model_dir: str | None) -> int:
    if not model_dir:
        raise ValueError("the synthetic drafter needs --vocab-size or --model")
    from specdec.models.model_config import ModelConfig
    return ModelConfig.from_folder(model_dir).vocab_size
