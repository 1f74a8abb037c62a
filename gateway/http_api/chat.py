"""POST /v1/chat/completions responses: GenerateResponse messages → OpenAI `chat.completion` objects and chunks
(reasoning as `reasoning_content`, calls as `tool_calls`, each call whole in one chunk)."""
from __future__ import annotations

import time

from .logprobs import TokenText, chat_logprobs
from .usage import usage_json


class ChatFormat:
    def __init__(self, request_id: str, model: str, token_text: TokenText, logprobs: bool, include_usage: bool):
        self.request_id, self.model, self.token_text = request_id, model, token_text
        self.logprobs, self.include_usage = logprobs, include_usage
        self.created = int(time.time())
        self.num_calls = 0                 # tool calls streamed so far (each chunk's calls are indexed after them)

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _logprobs(self, entries) -> dict | None:
        return {"content": chat_logprobs(entries, self.token_text), "refusal": None} if self.logprobs else None

    def _chunk(self, delta: dict, entries=(), finish_reason: str = "") -> dict:
        extra = {"usage": None} if self.include_usage else {}
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(entries) if entries else None,
                  "finish_reason": finish_reason or None}
        return self._object("chat.completion.chunk", [choice], **extra)

    def opening(self) -> list[dict]:
        """The first chunk names the role, as OpenAI's does."""
        return [self._chunk({"role": "assistant", "content": ""})]

    def chunk(self, response) -> dict | None:
        """One streamed message as a chunk; None when it carries nothing to send."""
        if not (response.text or response.reasoning_text or response.tool_calls or response.finish_reason
                or (self.logprobs and response.logprobs)):
            return None
        delta = {"content": response.text} if response.text else {}
        if response.reasoning_text:
            delta["reasoning_content"] = response.reasoning_text
        if response.tool_calls:
            delta["tool_calls"] = [dict(_call(c), index=self.num_calls + i) for i, c in enumerate(response.tool_calls)]
            self.num_calls += len(response.tool_calls)
        return self._chunk(delta, response.logprobs if self.logprobs else (), response.finish_reason)

    def usage_chunk(self, usage) -> dict:
        return self._object("chat.completion.chunk", [], usage=usage_json(usage))

    def full(self, responses: list) -> dict:
        last = responses[-1]
        calls = [_call(c) for r in responses for c in r.tool_calls]
        content = "".join(r.text for r in responses)
        message = {"role": "assistant", "content": content if content or not calls else None}
        reasoning = "".join(r.reasoning_text for r in responses)
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        entries = [e for r in responses for e in r.logprobs]
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(entries),
                  "finish_reason": last.finish_reason}
        return self._object("chat.completion", [choice], usage=usage_json(last.usage))


def _call(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
