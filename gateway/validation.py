"""Checks on a Generate request before any work is queued; errors name the offending field.

``validate_request`` raises ``InvalidRequest`` (map to INVALID_ARGUMENT) or ``TooLong`` (prompt plus
completion exceed the context: map to RESOURCE_EXHAUSTED) and returns the validated SamplingParams. The
sampling fields are checked by ``SamplingParams.validate`` alone: the verifier runs the same check.

Text that reaches the tokenizer, the chat template or the stop-string matcher must be valid Unicode: JSON can
carry a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer can encode and no UTF-8 response can carry
(protobuf strings cannot hold one: gRPC requests never have it, ``wire.py`` names bad UTF-8 there).
"""
from __future__ import annotations

from specdec.sampling_params import SamplingError, SamplingParams, token_ids_in_vocab

NO_TOKENIZER = "this model has no tokenizer files: send prompt_token_ids"


class InvalidRequest(ValueError):
    """A malformed request (INVALID_ARGUMENT)."""


class TooLong(ValueError):
    """Prompt + max_tokens exceed the model's context (RESOURCE_EXHAUSTED)."""


def _token_ids(name: str, ids, vocab_size: int) -> list[int]:
    ids = list(ids)
    if token_ids_in_vocab(ids, vocab_size):
        return ids
    for i, t in enumerate(ids):   # find the first bad one for the message
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequest(f"{name}[{i}] = {t!r} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_text(name: str, value) -> None:
    """InvalidRequest naming the first string in `value` (a string, or JSON data: lists, dicts) that holds a
    lone surrogate, e.g. ``messages[0].content``. Walked without recursion: nesting depth is the client's."""
    todo = [(name, value)]
    while todo:
        where, item = todo.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:   # the only way a str fails UTF-8: a lone surrogate
                raise InvalidRequest(f"{where}: not valid Unicode text (a lone UTF-16 surrogate at character "
                                     f"{e.start}; \\ud800-\\udfff escapes must come in pairs)") from None
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):    # reversed: the stack pops the first key first
                key = str(key)
                check_text(f"{where} key", key)
                todo.append((f"{where}.{key}" if key.isidentifier() else f"{where}[{key!r}]", inner))
        elif isinstance(item, (list, tuple)):
            todo += [(f"{where}[{i}]", inner) for i, inner in reversed(list(enumerate(item)))]


def validate_sampling(sampling: SamplingParams | dict | None, vocab_size: int,
                      has_tokenizer: bool = True, max_tokens_limit: int | None = None) -> SamplingParams:
    """SamplingParams (or a dict of set fields) → validated SamplingParams; InvalidRequest naming the field.
    `max_tokens_limit`: the most a request may ask for (the gateway's --max-tokens-limit; None: no limit)."""
    try:
        params = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_fields(sampling or {})
        params.validate(vocab_size)
    except (SamplingError, TypeError) as e:
        raise InvalidRequest(str(e)) from e
    if max_tokens_limit is not None and params.max_tokens > max_tokens_limit:
        raise InvalidRequest(f"max_tokens = {params.max_tokens} is over this server's limit of {max_tokens_limit} "
                             "tokens per request (--max-tokens-limit)")
    check_text("stop", params.stop)
    if params.stop and not has_tokenizer:
        raise InvalidRequest(f"stop: stop strings need the model's tokenizer files ({NO_TOKENIZER}, "
                             "and stop_token_ids instead of stop strings)")
    return params


def validate_request(prompt: str, prompt_token_ids: list[int], sampling: SamplingParams | dict | None,
                     has_tokenizer: bool, vocab_size: int, max_context: int, *,
                     prompt_len: int | None = None, messages: list | None = None,
                     chat_template_kwargs: dict | None = None, max_tokens_limit: int | None = None) -> SamplingParams:
    """Validate a Generate request; return its SamplingParams.

    Exactly one of ``prompt`` (text) / ``prompt_token_ids`` / ``messages`` must be non-empty. The context check
    uses ``len(prompt_token_ids)``, or for a text prompt or messages ``prompt_len`` (its token count, once
    encoded; the check is skipped while it is None). Every string of ``prompt``, ``messages`` and
    ``chat_template_kwargs`` (what the template and the tokenizer see) must be valid Unicode.
    """
    prompt = prompt or ""
    ids = list(prompt_token_ids or [])
    given = [name for name, value in (("prompt", prompt), ("prompt_token_ids", ids), ("messages", messages))
             if value]
    if len(given) > 1:
        raise InvalidRequest(f"{' and '.join(given)} are both set: send exactly one of prompt, prompt_token_ids, "
                             "messages")
    if not given:
        raise InvalidRequest("neither prompt, prompt_token_ids nor messages is set: send exactly one")
    if (prompt or messages) and not has_tokenizer:
        raise InvalidRequest(f"{given[0]}: {NO_TOKENIZER}")
    check_text("prompt", prompt)
    check_text("messages", messages)
    check_text("chat_template_kwargs", chat_template_kwargs)
    if ids:
        _token_ids("prompt_token_ids", ids, vocab_size)
        prompt_len = len(ids)
    params = validate_sampling(sampling, vocab_size, has_tokenizer, max_tokens_limit)
    check_context(prompt_len, params.max_tokens, max_context)
    return params


def check_context(prompt_len: int | None, max_tokens: int, max_context: int) -> None:
    """TooLong when prompt + completion exceed the context (nothing to check while prompt_len is None)."""
    if prompt_len is not None and prompt_len + max_tokens > max_context:
        raise TooLong(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                      f"{prompt_len + max_tokens} exceeds the model context of {max_context} tokens")
