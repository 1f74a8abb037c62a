"""The one way to assemble a verifier's engine from its config: the server, the benchmarks and every script call
`build_engine` (what a drafter service, an in-process drafter or none needs is decided here)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch

from specdec.drafting import Drafter, vocabulary_fingerprint
from specdec.grammar import Grammars
from specdec.models.loader import LoadedModel, load_model
from specdec.models.model_config import ModelConfig
from specdec.step_thread import use_gpu_in_this_thread
from specdec.step_trace import StepTrace

from .block_manager import PrefixCaching
from .cache_sizing import CacheRequest, size_caches
from .draft_policy import POLICIES
from .drafter_client import RemoteDrafter
from .drafter_link import DrafterLinkConfig
from .engine import EngineConfig, SpecEngine
from .engine_loop import DEFAULT_MAX_QUEUED
from .executor import Executor
from .model_runner import ModelRunner
from .rank_group import RankSpec
from .forced_acceptance import ForcedAcceptance
from .scheduler import SchedulerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifierConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    num_drafts: int = 3
    draft_policy: str = "auto"             # fixed: every step verifies k | adaptive: draft_policy.py | auto: adaptive
                                           # on a GPU, fixed on the CPU
    drafter_address: str | None = None     # None: plain decoding (k = 0), or the in-process drafter
    in_process_drafter: str | None = None  # a drafter kind run inside this process (built by the caller)
    transport: str = "auto"
    drafter_timeout_s: float = 10.0
    drafter_wait_s: float = 10.0           # at start-up, how long SERVING waits for the drafter link
    step_channel: str = "auto"             # auto: the drafter's local lane on this host | grpc
    max_context: int = 0                   # 0: the model's max_position_embeddings (at most what the KV pool holds)
    max_running: int = 0                   # 0: the device's default (DEVICE_LIMITS), as are the two below
    max_queued: int = DEFAULT_MAX_QUEUED   # requests waiting beyond max_running; more: RESOURCE_EXHAUSTED
    max_batched_tokens: int = 0            # tokens per target forward
    prefill_chunk: int = 0                 # prompt tokens per sequence per step
    mixed_prefill_chunk: int = 0           # prompt tokens in all in a step that decoding sequences share
    lone_prefill_chunk: int = 0            # a prompt chunk this long runs alone, in turns with the others (0: off)
    block_size: int = 16
    prefix_caching: bool = True            # resume prompts from cached prefixes (block_manager.py)
    prefix_checkpoint_interval: int = 0    # tokens between two kept states of a prompt (one more at its end);
    #                                        0: the larger of 1024 and prefill_chunk (whole multiples of 16)
    prefix_checkpoints: int = 0            # GDN / conv states kept for the prefix cache (0: 2 x max_running)
    kv_blocks: int = 0                     # 0: sized by cache_sizing.py (from memory on a GPU)
    gpu_memory_utilization: float = 0.9    # the share of the GPU's memory this process may hold, caches included
    metrics_port: int = 0                  # 0: no Prometheus endpoint
    forced_acceptance_length: float = 0.0  # benchmarks only, with unsafe_forced_acceptance
    unsafe_forced_acceptance: bool = False
    enforce_eager: bool = False            # no CUDA graphs
    tensor_parallel_size: int = 1          # ranks the target is split over (rank r on cuda:r; gloo on the CPU)
    rank_stats_every_s: float = 60.0       # a rank r > 0 logs its host time per step this often (0: never)
    all_reduce: str = "one-shot"           # tensor parallel on GPUs: one-shot for small messages, or nccl only
    load_format: str = "safetensors"       # dummy: random weights of the config's shapes (benchmarks only)
    quantization: str = "none"             # fp8: the target's linears rounded through FP8 blocks at load time
    overlap: bool = True                   # launch a step before reading the last one's tokens (when it can)
    warm_up: bool = True                   # run verifier_service.warm_up before reporting SERVING
    trace_steps: str | None = None         # diagnostics: a specdec.step_trace file

    @property
    def adaptive_drafts(self) -> bool:
        if self.draft_policy not in POLICIES:
            raise ValueError(f"draft policy must be one of {', '.join(POLICIES)}, not {self.draft_policy!r}")
        return self.draft_policy == "adaptive" or (self.draft_policy == "auto"
                                                    and torch.device(self.device).type == "cuda")

    def with_device_limits(self) -> "VerifierConfig":
        """This config with every limit left at 0 (max_running, max_batched_tokens, prefill_chunk,
        mixed_prefill_chunk) set to the device's default, and the prefix checkpoint interval, left at 0, to the
        larger of 1024 tokens and the prefill chunk: a prompt chunk ends at a checkpoint, so a shorter interval
        would cut the chunks short."""
        limits = DEVICE_LIMITS["cuda" if torch.device(self.device).type == "cuda" else "cpu"]
        config = replace(self, **{name: getattr(self, name) or value for name, value in limits.items()})
        interval = config.prefix_checkpoint_interval or max(1024, config.prefill_chunk // 16 * 16)
        return replace(config, prefix_checkpoint_interval=interval)

    def cache_request(self, model: ModelConfig) -> CacheRequest:
        drafting = self.in_process_drafter == "mtp" and self.num_drafts > 0
        drafter_layers = (model.mtp_num_hidden_layers or 1) if drafting else 0
        return CacheRequest(self.max_context, self.max_running, self.max_batched_tokens, self.num_drafts,
                            self.block_size, self.kv_blocks, self.gpu_memory_utilization, self.dtype, drafter_layers,
                            self.prefix.num_checkpoints if self.prefix.enabled else 0)

    @property
    def prefix(self) -> PrefixCaching:
        """Prefix caching's settings (after with_device_limits: its default checkpoint count needs max_running)."""
        return PrefixCaching(self.prefix_caching, self.prefix_checkpoint_interval,
                             self.prefix_checkpoints or 2 * self.max_running)


# The defaults of --max-running, --max-batched-tokens, --prefill-chunk and --mixed-prefill-chunk. On a GPU: 64
# sequences, the largest decode graph bucket; a prompt chunk alone of up to 2048 tokens, which replays the
# 2048-token prefill graph (its GEMMs are larger than 1024-token ones: bench/README.md, "Prompt chunks alone of
# 2048 tokens"); beside decoders 512 prompt tokens a step, so that their gap while a long prompt prefills is that
# of a 512-token step (with up to 64 decoding tokens it replays the 576-token mixed graph; steps of several
# sequences past 1024 tokens, the largest mixed graph, run eagerly). On the CPU: small steps that keep a demo's
# streams moving.
DEVICE_LIMITS = {"cuda": {"max_running": 64, "max_batched_tokens": 2048, "prefill_chunk": 2048,
                          "mixed_prefill_chunk": 512},
                 "cpu": {"max_running": 16, "max_batched_tokens": 512, "prefill_chunk": 256,
                         "mixed_prefill_chunk": 256}}


# Builds the in-process drafter around the loaded target (the CLI passes one: this package imports no drafter).
DrafterFactory = Callable[[LoadedModel, VerifierConfig], Drafter]


def build_engine(config: VerifierConfig, make_drafter: DrafterFactory | None = None,
                 loaded: LoadedModel | None = None) -> SpecEngine:
    """The engine `config` describes. `make_drafter`: the factory of `config.in_process_drafter` (the composition
    layer passes one: this package imports no drafter). `loaded`: the target, when the caller loaded it already
    (a benchmark that builds several engines), else read from config.model_dir."""
    if config.in_process_drafter and (config.drafter_address or make_drafter is None):
        raise ValueError("an in-process drafter needs its factory and no --drafter-address")
    if config.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {config.tensor_parallel_size}")
    parallel = config.tensor_parallel_size > 1
    if parallel and ":" in config.device:
        raise ValueError(f"--tensor-parallel-size places rank r on cuda:r: give --device cuda, not {config.device}")
    if parallel and config.in_process_drafter not in (None, "ngram", "synthetic") and config.num_drafts > 0:
        raise ValueError(f"an in-process {config.in_process_drafter} drafter cannot run beside tensor-parallel ranks "
                         f"(no rank holds the whole embedding and LM head): serve it as a drafter service "
                         f"(specdec serve does)")
    use_gpu_in_this_thread(config.device)   # this thread loads the target and captures its graphs there
    config = config.with_device_limits()
    for name in ("max_running", "max_batched_tokens", "prefill_chunk", "mixed_prefill_chunk", "block_size",
                 "prefix_checkpoint_interval"):
        if getattr(config, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    model_config = loaded.config if loaded is not None else ModelConfig.from_folder(config.model_dir)
    if not parallel and loaded is None:
        loaded = load_model(config.model_dir, dtype=config.dtype, device=config.device,
                            load_format=config.load_format, quantization=config.quantization)
    cache = size_caches(config.cache_request(model_config), model_config, torch.device(config.device), loaded,
                        parallel)   # tensor parallel: the ranks build caches of this size
    log.info("%s", cache.summary)
    config = replace(config, max_context=cache.max_context, kv_blocks=cache.num_blocks)
    prefix = config.prefix
    sizes = dict(num_blocks=cache.num_blocks, block_size=config.block_size, max_seqs=cache.num_slots,
                 max_drafts=config.num_drafts, max_model_len=cache.max_context,
                 max_batched_tokens=config.max_batched_tokens, enforce_eager=config.enforce_eager,
                 num_checkpoints=prefix.num_checkpoints if prefix.enabled else 0)
    if parallel:
        executor = Executor.build_parallel(RankSpec(config.model_dir, config.tensor_parallel_size, config.device,
                                                    config.dtype, config.load_format, sizes,
                                                    quantization=config.quantization,
                                                    stats_every_s=config.rank_stats_every_s,
                                                    all_reduce=config.all_reduce), prefix)
        loaded = LoadedModel(model_config, executor.runner.model, {})
    else:
        executor = Executor(ModelRunner(loaded, device=config.device, **sizes), prefix=prefix)
    log.info("prefix caching: %s", f"on, a checkpoint every {prefix.checkpoint_interval} prompt tokens and at "
             f"each prompt's end, {prefix.num_checkpoints} kept" if prefix.enabled else "off")
    trace = StepTrace(config.trace_steps, "verifier")
    drafter = None
    if config.drafter_address and config.num_drafts > 0:
        model = loaded.model
        # a rank holds a slice of the vocabulary: the drafter service reads embed_tokens / lm_head itself
        shared = {} if parallel else {"embed_tokens": model.embed_tokens.weight, "lm_head": model.lm_head.weight}
        drafter = RemoteDrafter(
            DrafterLinkConfig(config.drafter_address, config.num_drafts, config.transport, config.drafter_timeout_s,
                              step_channel=config.step_channel),
            loaded.config.hidden_size, loaded.config.vocab_size, model.embed_tokens.weight.dtype,
            torch.device(config.device), config.max_batched_tokens,
            shared, loaded.config.model_type,
            vocabulary_fingerprint(config.model_dir), trace, max_seqs=config.max_running)
    elif config.in_process_drafter and config.num_drafts > 0:
        drafter = make_drafter(loaded, config)
        log.info("in-process drafter %s (%s), k=%d: no drafter service", config.in_process_drafter,
                 type(drafter).__name__, config.num_drafts)
    forced = None
    if config.forced_acceptance_length:
        forced = ForcedAcceptance(config.forced_acceptance_length, config.num_drafts,
                                  enabled=config.unsafe_forced_acceptance)
        log.warning("FORCED ACCEPTANCE (mean length %.2f): output is not the target's; benchmarks only",
                    config.forced_acceptance_length)
    scheduler = SchedulerConfig(config.max_running, config.max_batched_tokens, config.prefill_chunk,
                                config.mixed_prefill_chunk, config.lone_prefill_chunk)
    engine_config = EngineConfig(config.num_drafts, config.adaptive_drafts, scheduler, forced, config.max_context,
                                 config.overlap)
    if drafter is not None:
        log.info("draft policy: %s (--draft-policy %s)", "adaptive k in 0..%d" % config.num_drafts
                 if engine_config.adaptive_drafts else "fixed k = %d" % config.num_drafts, config.draft_policy)
    grammars = Grammars.from_folder(config.model_dir, model_config.vocab_size, list(model_config.eos_token_id))
    return SpecEngine(executor, drafter, engine_config, trace, grammars)
