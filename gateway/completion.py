"""One request's output as the client sees it: the verifier's token messages turned into text deltas, cut at
the first stop string, with the tokens counted up to that point.

With stop strings, tokens are fed one at a time, so the token that completes a stop string is known: it is the
last token sent (as in vLLM, the stop string's own tokens are part of ``token_ids`` while its text is not) and
``completion_tokens`` counts exactly the tokens sent. Without stop strings each message is decoded at once.
"""
from __future__ import annotations

from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStringMatcher
from .tokenizer import TextTokenizer


class CompletionStream:
    def __init__(self, tokenizer: TextTokenizer | None, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")  # refused earlier, at validation
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer else None
        self._stops = StopStringMatcher(list(stop)) if stop else None
        self.completion_tokens = 0

    def step(self, token_ids: list[int], finished: bool) -> tuple[list[int], str, bool]:
        """One verifier message → (tokens to send, text to send, whether a stop string ended the stream)."""
        detokenizer, stops = self._detokenizer, self._stops
        if stops is None:
            text = ""
            if detokenizer is not None:
                text = detokenizer.add(token_ids) + (detokenizer.flush() if finished else "")
            self.completion_tokens += len(token_ids)
            return token_ids, text, False
        text = ""
        for i, token in enumerate(token_ids):
            safe, hit = stops.feed(detokenizer.add([token]))
            text += safe
            if hit:
                self.completion_tokens += i + 1
                return token_ids[:i + 1], text, True
        self.completion_tokens += len(token_ids)
        if finished:
            safe, hit = stops.feed(detokenizer.flush())
            text += safe if hit else safe + stops.flush()
            return token_ids, text, hit
        return token_ids, text, False
