"""Per-token logprobs (``TokenLogprob`` from the verifier) in the two shapes of the OpenAI API.

Token strings are each token decoded alone with special tokens kept (a token that is part of a multi-byte
character decodes to U+FFFD, as in vLLM); ``bytes`` are that string's UTF-8. Without tokenizer files a token is
named ``token_id:<id>``.
"""
from __future__ import annotations

from functools import lru_cache

from ..tokenizer import TextTokenizer


class TokenText:
    """token id → its string, cached (the same few thousand tokens come back again and again)."""

    def __init__(self, tokenizer: TextTokenizer | None, cache_size: int = 1 << 16):
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=cache_size)(self._decode)

    def _decode(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(entries, token_text: TokenText, text_offset: int) -> dict:
    """The legacy completions shape for `entries` (TokenLogprob); offsets count on from `text_offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        text = token_text.text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        alternatives = {token_text.text(t): lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
        alternatives.setdefault(text, entry.logprob)   # the chosen token is always listed
        top.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries, token_text: TokenText) -> list[dict]:
    """The chat shape: one {token, logprob, bytes, top_logprobs} per entry."""
    return [dict(_token(entry.token_id, entry.logprob, token_text),
                 top_logprobs=[_token(t, lp, token_text) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)])
            for entry in entries]


def _token(token_id: int, logprob: float, token_text: TokenText) -> dict:
    text = token_text.text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
