"""Request bodies of the OpenAI API as we accept them (types only: values are checked by the one validation,
SamplingParams.validate, that gRPC requests go through too).

Types are strict (``"0.5"`` is not a number, ``true`` is not an integer). Fields we do not know are ignored, as
the OpenAI API's many optional fields come and go; fields we know but cannot honour (``n`` > 1, ``echo``,
``logit_bias``, ``tools`` ...) are refused by name in ``unsupported``. Beyond OpenAI's fields, vLLM's sampling
extras are accepted: ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``structured_outputs`` (one of ``json`` (a schema), ``json_object``, ``regex``, ``grammar`` (EBNF),
``structural_tag``), ``cache_salt`` (a prefix cache namespace) and (chat) ``chat_template_kwargs``; and ours,
``speculation`` (false: this request verifies no drafts). ``response_format`` (``text``, ``json_object``, ``json_schema``) works on both endpoints.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None              # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    speculation: bool | None = None       # ours: false = no drafts verified for this request
    cache_salt: str | None = None         # vLLM's: prefixes are shared only between requests of the same salt
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def sampling_fields(self) -> dict:
        """SamplingParams fields that were set (max_tokens and logprobs are the endpoints' business); ValueError
        (starting with the field's name) for a response format we cannot read."""
        names = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "speculation",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "cache_salt")
        values = {name: getattr(self, name) for name in names}
        values["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        values["grammar"] = self.grammar()
        return values

    def grammar(self) -> dict | None:
        """{"kind", "text"} of response_format or structured_outputs (not both); None: unconstrained."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("response_format: give response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            return _structured_outputs(self.structured_outputs)
        if self.response_format is not None:
            return _response_format(self.response_format)
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to something we cannot do; None if none is."""
        if self.n not in (None, 1):
            return "n", f"only n = 1 is supported (one completion per request), got {self.n}"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", f"only best_of = 1 is supported, got {self.best_of}"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return "prompt", f"one prompt per request is supported, got a batch of {len(self.prompt)}"
        return super().unsupported()

    def prompt_parts(self) -> tuple[str, tuple[int, ...]]:
        """(text, token ids): one of them set (or neither, for an empty prompt: refused later)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]            # a batch of one
        return (prompt, ()) if isinstance(prompt, str) else ("", tuple(prompt))


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")   # name, tool_calls, reasoning_content ... reach the template
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None   # false: tool_choice "required" makes exactly one call
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def template_messages(self) -> list[dict]:
        """Messages as the chat template sees them: text parts joined into one string (ValueError names a part
        that is not text)."""
        out = []
        for i, message in enumerate(self.messages):
            data = message.model_dump(exclude_none=True)
            if isinstance(message.content, list):
                texts = []
                for j, part in enumerate(message.content):
                    if part.type != "text" or part.text is None:
                        raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, got "
                                         f"{part.type!r}")
                    texts.append(part.text)
                data["content"] = "\n".join(texts)
            out.append(data)
        return out


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUTS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "grammar": "ebnf",
                      "structural_tag": "structural_tag"}


def _response_format(value: dict) -> dict | None:
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ValueError("response_format.json_schema.schema: a JSON Schema object is required")
    return {"kind": "json_schema", "text": json.dumps(spec["schema"])}


def _structured_outputs(value: dict) -> dict:
    given = {k: v for k, v in value.items() if k in STRUCTURED_OUTPUTS and v not in (None, False)}
    if len(given) != 1:
        raise ValueError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_OUTPUTS)}")
    (name, text), = given.items()
    if name == "json_object":
        return {"kind": "json_object"}
    if name in ("json", "structural_tag") and isinstance(text, (dict, list)):
        text = json.dumps(text)
    if not isinstance(text, str):
        raise ValueError(f"structured_outputs.{name}: a string is required")
    return {"kind": STRUCTURED_OUTPUTS[name], "text": text}
