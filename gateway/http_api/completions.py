"""POST /v1/completions responses: GenerateResponse messages → OpenAI `text_completion` objects and chunks."""
from __future__ import annotations

import time

from .logprobs import TokenText, completion_logprobs
from .usage import usage_json


class CompletionFormat:
    def __init__(self, request_id: str, model: str, token_text: TokenText, logprobs: bool, include_usage: bool):
        self.request_id, self.model, self.token_text = request_id, model, token_text
        self.logprobs, self.include_usage = logprobs, include_usage
        self.created = int(time.time())
        self._offset = 0                     # text_offset of the next token

    def _object(self, choices: list, **extra) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _choice(self, text: str, entries, finish_reason: str) -> dict:
        logprobs = None
        if self.logprobs:
            logprobs = completion_logprobs(entries, self.token_text, self._offset)
            self._offset += sum(len(t) for t in logprobs["tokens"])
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason or None}

    def opening(self) -> list[dict]:
        return []

    def chunk(self, response) -> dict | None:
        """One streamed message as a chunk; None when it carries nothing to send."""
        if not (response.text or response.finish_reason or (self.logprobs and response.logprobs)):
            return None
        extra = {"usage": None} if self.include_usage else {}
        return self._object([self._choice(response.text, response.logprobs, response.finish_reason)], **extra)

    def usage_chunk(self, usage) -> dict:
        return self._object([], usage=usage_json(usage))

    def full(self, responses: list) -> dict:
        last = responses[-1]
        entries = [e for r in responses for e in r.logprobs]
        choice = self._choice("".join(r.text for r in responses), entries, last.finish_reason)
        return self._object([choice], usage=usage_json(last.usage))
