"""The sampler: a verify step's logits → accepted drafts and emitted tokens on the device (`sample`: greedy, the
coupled draw, min(1, p/q)), its sampling state (`SamplingBatch`) and logits processors (penalties, temperature,
top-k, top-p, min-p). See sampler.py for the rule and docs/sampling.md for why it is exact."""
from .batch import SamplingBatch, draft_probs_rows, grammar_row_masks
from .processors import Penalties, RowParams, apply_penalties, processed_logits, processed_probs
from .sampler import DeviceLogprobs, DeviceVerdict, TokenLogprob, VerifyRows, sample

__all__ = ["DeviceLogprobs", "DeviceVerdict", "Penalties", "RowParams", "SamplingBatch", "TokenLogprob", "VerifyRows",
           "apply_penalties", "draft_probs_rows", "grammar_row_masks", "processed_logits", "processed_probs", "sample"]
