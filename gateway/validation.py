"""Checks on a Generate request before any work is queued; errors name the offending field.

``validate_request`` raises ``InvalidRequest`` (map to INVALID_ARGUMENT) or ``TooLong`` (prompt plus
completion exceed the context: map to RESOURCE_EXHAUSTED) and returns the validated SamplingParams. The
sampling fields are checked by ``SamplingParams.validate`` alone: the verifier runs the same check.
"""
from __future__ import annotations

from specdec.sampling_params import SamplingError, SamplingParams

NO_TOKENIZER = "this model has no tokenizer files: send prompt_token_ids"


class InvalidRequest(ValueError):
    """A malformed request (INVALID_ARGUMENT)."""


class TooLong(ValueError):
    """Prompt + max_tokens exceed the model's context (RESOURCE_EXHAUSTED)."""


def _token_ids(name: str, ids, vocab_size: int) -> list[int]:
    ids = list(ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequest(f"{name}[{i}] = {t!r} is outside the vocabulary [0, {vocab_size})")
    return ids


def validate_sampling(sampling: SamplingParams | dict | None, vocab_size: int,
                      has_tokenizer: bool = True) -> SamplingParams:
    """SamplingParams (or a dict of set fields) → validated SamplingParams; InvalidRequest naming the field."""
    try:
        params = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_fields(sampling or {})
        params.validate(vocab_size)
    except (SamplingError, TypeError) as e:
        raise InvalidRequest(str(e)) from e
    if params.stop and not has_tokenizer:
        raise InvalidRequest(f"stop: stop strings need the model's tokenizer files ({NO_TOKENIZER}, "
                             "and stop_token_ids instead of stop strings)")
    return params


def validate_request(prompt: str, prompt_token_ids: list[int], sampling: SamplingParams | dict | None,
                     has_tokenizer: bool, vocab_size: int, max_context: int, *,
                     prompt_len: int | None = None) -> SamplingParams:
    """Validate a Generate request; return its SamplingParams.

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
    params = validate_sampling(sampling, vocab_size, has_tokenizer)
    if prompt_len is not None and prompt_len + params.max_tokens > max_context:
        raise TooLong(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
                      f"{prompt_len + params.max_tokens} exceeds the model context of {max_context} tokens")
    return params
