"""The verdict of a verify step at the 4B vocabulary: the one-launch Triton sampler against the torch path it
replaces (speculative_sample_ref, whose races already run the Triton race kernel on CUDA) and, for all-greedy
batches, against greedy_accept_ref. Each b sequences with k drafts (k + 1 rows each); the argmax every path takes
as input is computed once outside the timing. Rows: graph replay (device time) and eager launches (what the
host pays per call as well)."""
from __future__ import annotations

import torch
from timing import row, time_ms

from kernels.sampling import greedy_accept_ref, speculative_sample_ref
from kernels.sampling.speculative_triton import SPLIT, speculative_sample_triton

VOCAB_4B = 248320


def verdict_case(batch: int, k: int, vocab: int, device, mode: str) -> tuple:
    g = torch.Generator(device=device).manual_seed(batch)
    rows = batch * (k + 1)
    logits = torch.randn(rows, vocab, device=device, generator=g) * 2
    argmax = logits.argmax(-1)
    num_drafts = torch.full((batch,), k, dtype=torch.long, device=device)
    cu_rows = torch.arange(0, rows + 1, k + 1, device=device)
    drafts = argmax.view(batch, k + 1)[:, :k].clone()       # the target's argmax: greedy rows accept all
    greedy = torch.full((batch,), mode == "all greedy", device=device)
    uses_q = torch.full((batch,), mode == "with q", device=device)
    seeds = torch.randint(0, 2 ** 62, (batch,), device=device, generator=g)
    offsets = torch.randint(0, 2 ** 20, (batch,), device=device, generator=g)
    q = torch.softmax(torch.randn(rows, vocab, device=device, generator=g), -1) if mode == "with q" else None
    return (None if mode == "all greedy" else logits, argmax, q, drafts, num_drafts, cu_rows, greedy, uses_q,
            seeds, offsets)


def sampling_rows(batch: int, k: int, device, copy_bw, vocab: int = VOCAB_4B) -> list[dict]:
    rows = []
    for mode in ("all greedy", "coupled", "with q"):
        args = verdict_case(batch, k, vocab, device, mode)
        case = f"b{batch} k{k} {mode}"
        impls = [("ours: one launch", lambda: speculative_sample_triton(*args)),
                 ("torch reference", lambda: speculative_sample_ref(*args))]
        if mode == "all greedy":
            impls.append(("greedy_accept_ref (torch)", lambda: greedy_accept_ref(args[1], args[3], args[4], args[5])))
        logit_rows = batch * (k + 1)
        splits = -(-vocab // SPLIT)
        # coupled: each row's logits once; with q: also q once and the logits again once per split (each
        # q-row program normalises p over the whole row first)
        moved = 0 if mode == "all greedy" else logit_rows * vocab * 4 * (1 if mode == "coupled" else 3 + splits)
        for impl, fn in impls:
            for graph in (True, False):
                ms, how = time_ms(fn, device, reps=20, graph=graph)
                rows.append(row("sampling", case, impl, ms, how, moved or None, copy_bw))
    return rows
