"""Builds the drafter a `specdec drafter` process serves, from its config: a built-in kind or a plugin
(entry point group `specdec.drafters`, see specdec/drafting/plugins.py)."""
from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specdec.drafting import (Drafter, DrafterInfo, DrafterOptions, DraftsOnDevice, ModelFacts, load_plugin,
                              plugin_entry_points, vocabulary_fingerprint)
from specdec.drafting.acceptance_rate import acceptance_rate_for
from specdec.drafting.draft_masks import DraftMasks
from specdec.models.caches import CacheShapes
from specdec.models.memory_budget import GIB, DeviceMemory
from specdec.models.model_config import ModelConfig

from .ngram import NgramDrafter
from .synthetic import SyntheticDrafter

log = logging.getLogger(__name__)
BUILTIN_KINDS = ("mtp", "draft_model", "ngram", "synthetic")
CPU_KV_BLOCKS = 4096   # a model drafter's KV blocks on the CPU (65,536 tokens of 16)
DRAFT_GRAPHS_ALLOWANCE = GIB // 2   # set aside on a GPU for the draft loop's CUDA graph pool and eager activations
DRAFTER_ATTRIBUTES = ("kind", "needs_hidden", "max_drafts", "facts", "propose", "release", "clear")


def kv_blocks_for(c: DrafterConfig, block_bytes: int, reserved: int) -> int:
    """KV blocks of a model drafter: on a GPU what `gpu_memory_utilization` leaves once its weights are loaded and
    `reserved` bytes are set aside (its other caches, warm-up peaks, DRAFT_GRAPHS_ALLOWANCE), else CPU_KV_BLOCKS
    (specdec/models/memory_budget.py)."""
    if not c.device.startswith("cuda"):
        return CPU_KV_BLOCKS
    memory = DeviceMemory.read(c.device)
    room, bound = memory.cache_bytes(c.gpu_memory_utilization, reserved + DRAFT_GRAPHS_ALLOWANCE)
    blocks = room // block_bytes
    if blocks < 1:
        raise ValueError(f"no GPU memory left for the drafter's KV cache "
                         f"({memory.describe(c.gpu_memory_utilization)}): raise its --gpu-memory-utilization or give "
                         f"--kv-blocks")
    log.info("drafter KV cache: %d blocks of %d (%d tokens, %.2f GiB) from %s%s", blocks, c.block_size,
             blocks * c.block_size, blocks * block_bytes / GIB, memory.describe(c.gpu_memory_utilization),
             "; bounded by FREE memory" if bound == "free memory" else "")
    return blocks


def available_kinds() -> list[str]:
    """Built-in kinds, then installed plugins (a plugin cannot replace a built-in)."""
    return list(BUILTIN_KINDS) + sorted(k for k in plugin_entry_points() if k not in BUILTIN_KINDS)


@dataclass(frozen=True)
class DrafterConfig:
    kind: str
    max_drafts: int = 3
    model_dir: str | None = None       # the target's checkpoint (mtp: its mtp.* tensors; plugins: options)
    device: str = "cpu"
    dtype: str = "float32"
    num_blocks: int = 0                # mtp / draft_model KV blocks (0: `kv_blocks_for`)
    gpu_memory_utilization: float = 0.05  # mtp / draft_model on a GPU: this process's share (caches included)
    block_size: int = 16
    references: str | None = None      # synthetic: JSON file, a list of token-id lists (prompt + continuation)
    mean_acceptance_length: float | None = None  # synthetic: target, sets the corruption rate
    vocab_size: int = 0                # the target's: synthetic's corrupted tokens (0: from model_dir), counting
    seed: int = 0
    draft_model_dir: str | None = None  # draft_model: the smaller model's checkpoint
    max_seqs: int = 64                 # draft_model: sequences it holds state for; mtp: largest CUDA graph
    max_context: int = 0               # mtp: longest sequence it drafts for (0: the model's max positions)
    enforce_eager: bool = False        # mtp: no CUDA graphs
    draft_vocab: str | None = None     # mtp: a `specdec draft-vocab` file (drafts over those ids only)
    options: tuple[tuple[str, str], ...] = ()  # plugins: --option KEY=VALUE
    count_tokens: str | None = None    # a token-counts file: count the served tokens into it (needs vocab_size)
    count_every_s: float = 60.0        # save the counts this often (and when the server stops)
    trace_steps: str | None = None     # diagnostics: a specdec.step_trace file
    load_format: str = "safetensors"   # mtp: dummy = random weights of the config's shapes (benchmarks only)
    draft_masks: str = "auto"          # mtp: on | off | auto: keep a constrained sequence's drafts inside its grammar


class DrafterHolder:
    """The served drafter and its handshake facts. An MTP drafter on a GPU waits for the verifier's shared
    weights (CUDA IPC) before it exists, so that it holds no second copy of embed_tokens / lm_head; anywhere
    else it loads them itself."""

    def __init__(self, config: DrafterConfig):
        if config.kind not in available_kinds():
            raise ValueError(f"unknown drafter kind {config.kind!r}; choose one of {', '.join(available_kinds())}")
        if config.max_drafts < 1:
            raise ValueError(f"--num-drafts must be >= 1, got {config.max_drafts}")
        self.config = config
        self.drafter: Drafter | None = None
        self.mtp_parts = None
        self.mtp_facts = ModelFacts()
        self.draft_masks: DraftMasks | None = None
        if config.kind == "mtp":
            self._load_mtp_parts()
        elif config.kind == "draft_model":
            self.drafter = self._build_draft_model()
        elif config.kind in BUILTIN_KINDS:
            self.drafter = self._build_model_free()
        else:
            self.drafter = self._build_plugin()

    @property
    def needs_hidden(self) -> bool:
        return self.config.kind == "mtp" or (self.drafter is not None and self.drafter.needs_hidden)

    @property
    def takes_device_steps(self) -> bool:
        """It drafts on the device (drafter.proto DeviceStep): the MTP head, or a drafter that says it does."""
        if self.config.kind == "mtp":
            return True
        return isinstance(self.drafter, DraftsOnDevice) and self.drafter.drafts_on_device

    @property
    def wants_shared_weights(self) -> bool:
        return self.config.kind == "mtp" and self.config.device.startswith("cuda")

    @property
    def info(self) -> DrafterInfo:
        """This drafter's own facts for the handshake."""
        if self.drafter is None:  # mtp waiting for the verifier's weights
            return DrafterInfo(self.config.kind, self.config.max_drafts, True, self.mtp_facts,
                               self.wants_shared_weights)
        d = self.drafter
        return DrafterInfo(self.config.kind, min(self.config.max_drafts, d.max_drafts), d.needs_hidden, d.facts,
                           self.wants_shared_weights)

    # ---- mtp -----------------------------------------------------------------------------
    def _load_mtp_parts(self) -> None:
        from specdec.drafting.device_schedule import START_POS_SLACK
        from specdec.drafting.draft_vocab import load_draft_vocab

        from .mtp.mtp_drafter import mtp_facts
        from .mtp.options import MTPOptions
        if not self.config.model_dir:
            raise ValueError("the mtp drafter needs --model (a checkpoint with mtp.* tensors)")
        config, mtp, shared = self._read_mtp_weights(shared=not self.wants_shared_weights)
        if not mtp:
            raise ValueError(f"{self.config.model_dir} has no mtp.* tensors: serve --kind ngram instead")
        self.mtp_parts = (config, mtp)
        dtype = next(iter(mtp.values())).dtype
        # the stand-in embed_tokens / lm_head of the warm-up (below) is its peak
        self.config = self._sized(config, config.mtp_num_hidden_layers or 1, dtype,
                                  reserved=config.vocab_size * config.hidden_size * dtype.itemsize)
        c = self.config
        self.draft_masks = DraftMasks.for_folder(c.model_dir, config.vocab_size, list(config.eos_token_id)) \
            if DraftMasks.wanted(c.draft_masks, c.device, c.enforce_eager) else None
        vocab = load_draft_vocab(c.draft_vocab, config.vocab_size) if c.draft_vocab else None
        # a device step sent as changes gives start positions up to START_POS_SLACK ahead: room for them
        self.mtp_options = MTPOptions(max_seqs=c.max_seqs, max_context=c.max_context + START_POS_SLACK,
                                      enforce_eager=c.enforce_eager, draft_vocab=vocab)
        self.mtp_facts = mtp_facts(config, dtype, vocabulary_fingerprint(self.config.model_dir))
        if shared:
            self.attach(shared["embed_tokens.weight"], shared["lm_head.weight"])
        if c.device.startswith("cuda"):
            self._warm_up_mtp(dtype)

    def _read_mtp_weights(self, shared: bool):
        """(config, mtp tensors, embed_tokens / lm_head unless `shared` is False) from the folder, or random ones
        of the same shapes with --load-format dummy."""
        from specdec.models.loader import SHARED_WITH_DRAFTER, dummy_tensors, load_drafter_weights, parse_dtype

        from .mtp.mtp_head import MTPHead
        c = self.config
        if c.load_format != "dummy":
            return load_drafter_weights(c.model_dir, c.dtype, c.device, shared=shared)
        config = ModelConfig.from_folder(c.model_dir)
        with torch.device("meta"):
            head = MTPHead(config, config.mtp_num_hidden_layers or 1)
        shapes = {k: p.shape for k, p in head.state_dict().items()}
        shapes |= {name: torch.Size((config.vocab_size, config.hidden_size)) for name in SHARED_WITH_DRAFTER} \
            if shared else {}
        tensors = dummy_tensors(shapes, parse_dtype(c.dtype), c.device, seed=1)
        log.warning("--load-format dummy: a random MTP head (benchmarks only: its drafts are noise)")
        return config, {k: v for k, v in tensors.items() if k not in SHARED_WITH_DRAFTER}, \
            {k: v for k, v in tensors.items() if k in SHARED_WITH_DRAFTER}

    def _warm_up_mtp(self, dtype: torch.dtype) -> None:
        """Compile the draft loop's kernels before this drafter reports SERVING (mtp/warm_up.py). Waiting for
        the verifier's weights, it warms up a stand-in of the same shapes (one [V, H] tensor for embed_tokens and
        lm_head, freed after): kernels compile per shape, so attaching the real weights compiles nothing."""
        from .mtp.mtp_drafter import MTPDrafter
        from .mtp.warm_up import warm_up
        drafter, c = self.drafter, self.config
        if drafter is None:
            config, mtp = self.mtp_parts
            stand_in = torch.zeros(config.vocab_size, config.hidden_size, dtype=dtype, device=c.device)  # [V, H]
            drafter = MTPDrafter.from_parts(config, mtp, stand_in, stand_in, c.max_drafts, c.num_blocks,
                                            c.block_size, c.device, self.mtp_options)
        report = warm_up(drafter)
        log.info("mtp drafter warm-up: %d eager runs (1 to %d sequences, up to %d rows) in %.1f s%s",
                 report.num_runs, report.max_seqs, report.max_tokens, report.seconds,
                 "" if drafter is self.drafter else " on stand-in weights, before the verifier's arrive")
        if drafter is not self.drafter:
            del drafter, stand_in
            torch.cuda.empty_cache()

    def attach(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """(Re)build the MTP drafter around these embed_tokens / lm_head weights (a new verifier's, too). Weights
        on another GPU (a verifier's, mapped over CUDA IPC) are copied to this drafter's, once, peer-to-peer."""
        from .mtp.mtp_drafter import MTPDrafter
        config, mtp = self.mtp_parts
        c = self.config
        if self.drafter is not None and c.device.startswith("cuda"):
            self.drafter = None   # its KV cache (and weight copies) fill this process's share: freed first
            gc.collect()
            torch.cuda.empty_cache()
        device = torch.device(c.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if embed_weight.device == device:
            log.info("mapped the target's embed_tokens and lm_head over CUDA IPC (no second copy)")
        else:
            tied = embed_weight.data_ptr() == lm_head_weight.data_ptr()
            source = embed_weight.device
            embed_weight = embed_weight.to(device)                                                 # [V, H]
            lm_head_weight = embed_weight if tied else lm_head_weight.to(device)                   # [V, H]
            log.info("copied the target's embed_tokens and lm_head from %s to %s (%.2f GB, once)", source, device,
                     embed_weight.nbytes * (1 if tied else 2) / 1e9)
        drafter = MTPDrafter.from_parts(config, mtp, embed_weight, lm_head_weight, c.max_drafts,
                                        c.num_blocks, c.block_size, c.device, self.mtp_options, self.draft_masks)
        drafter.facts = replace(drafter.facts, vocab_fingerprint=self.mtp_facts.vocab_fingerprint)
        self.drafter = drafter
        vocab = drafter.loop.vocab_ids
        log.info("mtp drafter ready: %d layer(s), k=%d, %s, %s, draft vocabulary %s, grammar masks %s",
                 len(drafter.head.layers), c.max_drafts, c.device, "CUDA graphs" if drafter.loop.graphs else "eager",
                 f"{vocab.numel()} of {config.vocab_size} ids" if vocab is not None else "full",
                 "on" if self.draft_masks is not None else "off")

    def load_shared_from_folder(self) -> None:
        """The verifier could not share weights (not the same GPU): read them from the folder after all."""
        _, _, shared = self._read_mtp_weights(shared=True)
        self.attach(shared["embed_tokens.weight"], shared["lm_head.weight"])

    def _sized(self, model: ModelConfig, num_layers: int, dtype: torch.dtype, reserved: int) -> DrafterConfig:
        """The config with max_context (0: the model's) and num_blocks (0: `kv_blocks_for`) filled in."""
        c = self.config
        block_bytes = CacheShapes(model, c.block_size).block_bytes(dtype, num_layers)
        blocks = c.num_blocks or kv_blocks_for(c, block_bytes, reserved)
        return replace(c, num_blocks=blocks, max_context=c.max_context or model.max_position_embeddings)

    # ---- the others ----------------------------------------------------------------------
    def _build_draft_model(self) -> Drafter:
        from specdec.models.loader import load_model

        from .draft_model import DraftModelDrafter
        c = self.config
        if not c.draft_model_dir:
            raise ValueError("the draft_model drafter needs --draft-model DIR (a smaller model of the same tokenizer)")
        loaded = load_model(c.draft_model_dir, dtype=c.dtype, device=c.device)
        c = self.config = self._sized(loaded.config, len(loaded.config.attention_layers),
                                      loaded.model.embed_tokens.weight.dtype,
                                      reserved=2 * c.max_seqs * CacheShapes(loaded.config, c.block_size).slot_bytes(
                                          loaded.model.embed_tokens.weight.dtype))   # its GDN state slot pairs
        log.info("draft model %s: %d layers, hidden %d, vocab %d", c.draft_model_dir,
                 loaded.config.num_hidden_layers, loaded.config.hidden_size, loaded.config.vocab_size)
        return DraftModelDrafter(loaded, c.max_drafts, c.num_blocks, c.block_size, c.max_seqs, device=c.device,
                                 vocab_fingerprint=vocabulary_fingerprint(c.draft_model_dir))

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

    def _build_plugin(self) -> Drafter:
        c = self.config
        factory = load_plugin(c.kind)
        drafter = factory(DrafterOptions(max_drafts=c.max_drafts, device=c.device, dtype=c.dtype,
                                         model_dir=c.model_dir, options=dict(c.options)))
        lacking = [a for a in DRAFTER_ATTRIBUTES if not hasattr(drafter, a)]
        if lacking:
            raise ValueError(f"drafter plugin {c.kind!r} returned {type(drafter).__name__}, which lacks "
                             f"{', '.join(lacking)} (see specdec.drafting.Drafter)")
        log.info("plugin drafter %s (%s): k=%d, hidden states %s", c.kind, type(drafter).__qualname__,
                 drafter.max_drafts, drafter.needs_hidden)
        return drafter


def _vocab_of(model_dir: str | None) -> int:
    if not model_dir:
        raise ValueError("the synthetic drafter needs --vocab-size or --model")
    from specdec.models.model_config import ModelConfig
    return ModelConfig.from_folder(model_dir).vocab_size
