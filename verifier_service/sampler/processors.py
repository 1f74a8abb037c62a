"""Logits → the distribution each verify row samples from (penalties, temperature, top-k, top-p, min-p).

Vectorised over rows with per-row parameters, no host sync: the same ops run on CPU and inside a CUDA graph.
A verify row's penalties count the request's output so far plus the drafts before that row in the same step
(they are generated tokens whenever that row matters, i.e. when all of them were accepted). Semantics are
documented in specdec/sampling_params.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    """Sampling parameters per verify row (a sequence's values repeated over its k + 1 rows). All [R]."""
    greedy: torch.Tensor              # bool
    temperature: torch.Tensor         # float32 (1 on greedy rows)
    top_k: torch.Tensor               # int64, 0: off
    top_p: torch.Tensor               # float32, 1: off
    min_p: torch.Tensor               # float32, 0: off


@dataclass
class Penalties:
    """Present when some row of the step is penalised. Counts include the drafts before each row."""
    output_counts: torch.Tensor       # [R, V] int32 occurrences among generated tokens
    prompt_mask: torch.Tensor         # [R, V] bool tokens of the prompt
    repetition: torch.Tensor          # [R] float32, 1: off
    presence: torch.Tensor            # [R] float32, 0: off
    frequency: torch.Tensor           # [R] float32, 0: off


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """logits [R, V] fp32 → penalised logits. Repetition (vLLM / HF): a token seen in the prompt or the output
    has a positive logit divided by the penalty, a negative one multiplied. Presence / frequency (OpenAI):
    minus presence · [count > 0] minus frequency · count, over output tokens."""
    counts = pen.output_counts.float()
    seen = pen.prompt_mask | (pen.output_counts > 0)
    rep = pen.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - pen.presence[:, None] * (counts > 0).float() - pen.frequency[:, None] * counts


def processed_logits(logits: torch.Tensor, rows: RowParams, sort: bool = True) -> torch.Tensor:
    """Penalised logits [R, V] fp32 → logits after temperature, top-k, top-p and min-p, cut tokens at −inf; their
    softmax is the distribution to sample from. Greedy rows are processed at temperature 1 (their logprobs);
    they emit the argmax. `sort=False` (the caller knows no row uses top-k or top-p) skips the vocabulary sort:
    min-p needs only the row maximum."""
    logits = logits / rows.temperature[:, None]
    if not sort:
        keep = logits >= logits.max(-1, keepdim=True).values + torch.log(rows.min_p)[:, None]  # p >= min_p · p_max
        return logits.masked_fill(~keep, float("-inf"))
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)                 # [R, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= torch.where(rows.top_k > 0, rows.top_k, vocab)[:, None]      # top-k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= (mass_before >= rows.top_p[:, None]) & (rows.top_p < 1)[:, None]    # top-p: the smallest prefix
    drop |= sorted_probs < rows.min_p[:, None] * sorted_probs[:, :1]            # min-p (the top token stays)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def processed_probs(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """The distribution to sample from: softmax of processed_logits; cut tokens are exactly 0."""
    return processed_logits(logits, rows).softmax(-1)
