"""Builds engines over a loaded tiny model for tests."""
import torch

from drafter_service.draft_model import DraftModelDrafter
from drafter_service.mtp.mtp_drafter import MTPDrafter
from drafter_service.ngram import NgramDrafter
from drafter_service.synthetic import SyntheticDrafter
from verifier_service.block_manager import PrefixCaching
from verifier_service.engine import EngineConfig, SpecEngine
from verifier_service.executor import Executor
from verifier_service.scheduler import SchedulerConfig

BLOCK = 4


def make_engine(loaded, drafter=None, k=0, num_blocks=256, max_running=8, forced=None, chunk=8, budget=64,
                overlap=True, lone_chunk=0, prefix=None, mixed_chunk=0):
    """prefix: a PrefixCaching (default: off)."""
    executor = Executor.build(loaded, num_blocks=num_blocks, block_size=BLOCK, max_seqs=max_running, max_drafts=k,
                              device=loaded.model.embed_tokens.weight.device, max_batched_tokens=budget,
                              prefix=prefix or PrefixCaching(enabled=False))
    config = EngineConfig(num_drafts=k, forced_acceptance=forced, overlap=overlap,
                          scheduler=SchedulerConfig(max_running=max_running, max_batched_tokens=budget,
                                                    prefill_chunk=chunk, mixed_prefill_chunk=mixed_chunk,
                                                    lone_prefill_chunk=lone_chunk))
    return SpecEngine(executor, drafter, config)


def make_drafter(kind, loaded, k, references=None, draft_model=None, num_blocks=256):
    """A drafter for `loaded` (the target); draft_model: the LoadedModel that drafts for kind "draft_model"."""
    vocab = loaded.config.vocab_size
    if kind == "mtp":
        return MTPDrafter(loaded, k, num_blocks=num_blocks, block_size=BLOCK)
    if kind == "draft_model":
        return DraftModelDrafter(draft_model, k, num_blocks=num_blocks, block_size=BLOCK, max_seqs=8)
    if kind == "ngram":
        return NgramDrafter(k)
    rate = {"synthetic": 0.6, "all-accept": 1.0, "all-reject": 0.0}[kind]
    return SyntheticDrafter(references, k, vocab, accept_rate=rate, seed=1)


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def synchronous_launches(engine) -> list[int]:
    """Counts the steps `engine` launches synchronously (read right after their launch: not overlapped)."""
    calls, launch = [], engine._launch

    def spy(entries, previous, overlap):
        if not overlap:
            calls.append(1)
        return launch(entries, previous, overlap)
    engine._launch = spy
    return calls
