"""Checks on a Generate request before any work is queued; errors name the offending field.

``validate_request`` raises ``InvalidRequest`` (map to INVALID_ARGUMENT) or ``TooLong`` (prompt plus
completion exceed the context: map to RESOURCE_EXHAUSTED), and returns the sampling dict with every
field present and proto3 "unset" zeros replaced by their defaults.
"""
from __future__ import annotations

import math

from gateway.stop_strings import MAX_STOP_LEN, MAX_STOP_STRINGS

DEFAULT_MAX_TOKENS = 256
SEED_LIMIT = 2 ** 63
DEFAULTS: dict = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None,
                  "stop": [], "stop_token_ids": [], "ignore_eos": False}
NO_TOKENIZER = "this model has no tokenizer files: send prompt_token_ids"


class InvalidRequest(ValueError):
    """A malformed request (INVALID_ARGUMENT)."""


class TooLong(ValueError):
    """Prompt + max_tokens exceed the model's context (RESOURCE_EXHAUSTED)."""


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    return value


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def _token_ids(name: str, ids, vocab_size: int) -> list[int]:
    ids = list(ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequest(f"{name}[{i}] = {t!r} is outside the vocabulary [0, {vocab_size})")
    return ids


def normalize_sampling(sampling: dict | None, vocab_size: int) -> dict:
    """The sampling dict with defaults filled in; InvalidRequest naming the first bad field."""
    sampling = dict(sampling or {})
    unknown = sorted(set(sampling) - set(DEFAULTS))
    if unknown:
        raise InvalidRequest(f"sampling: unknown field(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    s = {k: (DEFAULTS[k] if sampling.get(k) is None else sampling[k]) for k in DEFAULTS}

    s["max_tokens"] = _int("max_tokens", s["max_tokens"]) or DEFAULT_MAX_TOKENS  # 0: the default
    if s["max_tokens"] < 1:
        raise InvalidRequest(f"max_tokens must be >= 1 (or 0 for the default {DEFAULT_MAX_TOKENS}), "
                             f"got {s['max_tokens']}")
    s["temperature"] = _float("temperature", s["temperature"])
    if not s["temperature"] >= 0.0 or math.isinf(s["temperature"]):  # NaN fails the comparison
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {s['temperature']}")
    s["top_p"] = _float("top_p", s["top_p"]) or 1.0  # 0: off
    if not 0.0 < s["top_p"] <= 1.0:
        raise InvalidRequest(f"top_p must be in (0, 1] (or 0 for off), got {s['top_p']}")
    s["top_k"] = _int("top_k", s["top_k"])
    if s["top_k"] < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0: off), got {s['top_k']}")
    if s["seed"] is not None and not 0 <= _int("seed", s["seed"]) < SEED_LIMIT:
        raise InvalidRequest(f"seed must be in [0, 2^63), got {s['seed']}")

    stop = s["stop"]
    if isinstance(stop, str) or not isinstance(stop, (list, tuple)):
        raise InvalidRequest(f"stop must be a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, x in enumerate(stop):
        if not isinstance(x, str) or not x:
            raise InvalidRequest(f"stop[{i}] must be a non-empty string, got {x!r}")
        if len(x) > MAX_STOP_LEN:
            raise InvalidRequest(f"stop[{i}] is {len(x)} characters long, the limit is {MAX_STOP_LEN}")
    s["stop"] = list(stop)
    if isinstance(s["stop_token_ids"], (str, bytes)):
        raise InvalidRequest("stop_token_ids must be a list of token ids")
    s["stop_token_ids"] = _token_ids("stop_token_ids", s["stop_token_ids"], vocab_size)
    if not isinstance(s["ignore_eos"], bool):
        raise InvalidRequest(f"ignore_eos must be a boolean, got {s['ignore_eos']!r}")
    return s


def validate_request(prompt: str, prompt_token_ids: list[int], sampling: dict, has_tokenizer: bool,
                     vocab_size: int, max_context: int, *, prompt_len: int | None = None) -> dict:
    """Validate a Generate request; return the normalised sampling dict.

    Exactly one of ``prompt`` (text) / ``prompt_token_ids`` must be non-empty. The context check
    uses ``len(prompt_token_ids)``, or for a text prompt ``prompt_len`` (its token count, once
    encoded; the check is skipped while it is None).
    """
    prompt = prompt or ""
    ids = list(prompt_token_ids or [])
    if prompt and ids:
        raise InvalidRequest("prompt and prompt_token_ids are both set: send exactly one")
    if not prompt and not ids:
        raise InvalidRequest("neither prompt nor prompt_token_ids is set: send exactly one")
    if prompt and not has_tokenizer:
        raise InvalidRequest(f"prompt: {NO_TOKENIZER}")
    if ids:
        _token_ids("prompt_token_ids", ids, vocab_size)
        prompt_len = len(ids)
    s = normalize_sampling(sampling, vocab_size)
    if prompt_len is not None and prompt_len + s["max_tokens"] > max_context:
        raise TooLong(f"prompt ({prompt_len} tokens) + max_tokens ({s['max_tokens']}) = "
                      f"{prompt_len + s['max_tokens']} exceeds the model context of {max_context} tokens")
    return s
