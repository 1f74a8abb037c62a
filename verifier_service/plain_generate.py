"""Plain (non-speculative) greedy decoding of a fixed batch: the reference the engine must equal."""
from __future__ import annotations

from .executor import Executor
from .sequence import Sequence


def greedy_generate(executor: Executor, prompts: list[list[int]], max_new_tokens: int,
                    prefill_chunk: int | None = None) -> list[list[int]]:
    """Decode all prompts together; prompts are prefilled in pieces of `prefill_chunk` tokens if given."""
    seqs = [Sequence(seq_id=i, token_ids=list(p), num_prompt=len(p)) for i, p in enumerate(prompts)]
    try:
        while any(len(s.output_ids) < max_new_tokens for s in seqs):
            live = [s for s in seqs if len(s.output_ids) < max_new_tokens]
            chunks = [s.token_ids[s.num_cached: s.num_cached + (prefill_chunk or len(s.token_ids))] for s in live]
            _, logits = executor.forward(live, chunks)
            next_ids = logits.argmax(-1).tolist()  # one host sync per step
            for seq, chunk, tok in zip(live, chunks, next_ids):
                seq.launched(len(chunk), 0, samples=False, decoding=False)
                if seq.num_cached == len(seq.token_ids):  # prompt fully in cache: the logit is a new token
                    seq.emitted([tok])
        return [s.output_ids for s in seqs]
    finally:
        for s in seqs:
            executor.blocks.release(s)
