"""Tool calls in a model's output → the OpenAI chat-completions ``content`` and ``tool_calls``, both for a
finished text (``parse_tool_calls``) and for a stream of text deltas (``ToolCallStream``).

Two output formats, named as xgrammar names them:

``qwen_3`` (Qwen3, Qwen3-Next; Hermes style): one JSON object per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``qwen_3_5`` (Qwen3.5, Qwen3-Coder; XML style): parameter values are raw text (one leading and one trailing
newline stripped), given JSON types from the tool's schema (``parameters.properties[name].type``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

    → name "get_weather", arguments '{"city": "Paris", "days": 3}' (when "days" is an integer)

Several calls may follow one another. Rules:
- Nothing the model wrote is lost: a call whose body does not parse (bad JSON, no name, an unknown structure)
  or a ``<tool_call>`` never closed keeps its raw text in ``content``.
- A call naming a function that is not in ``tools`` is still returned as a tool call: the client decides.
- Content is the text outside the calls, less the whitespace touching a call (around and between calls); when
  calls sit between two pieces of text, the whitespace before the calls separates them. With no call, content
  is the text exactly.
- The stream's content deltas joined, and its calls, equal ``parse_tool_calls``' for any split of the text
  (``parse_tool_calls`` is the stream fed the whole text). Streamed content is held back only while it may be
  the start of ``<tool_call>``, or is whitespace that a following call would drop.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from .stop_strings import partial_tag_length
from .tool_arguments import parameter_schemas, parse_json_call, parse_xml_call

QWEN_3, QWEN_3_5 = "qwen_3", "qwen_3_5"
FORMATS = (QWEN_3, QWEN_3_5)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    id: str            # "call_" + 24 hex digits
    name: str
    arguments: str     # JSON text of the arguments object


@dataclass
class ParsedMessage:
    content: str       # "" when there is none
    tool_calls: list[ToolCall]


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallDelta:
    index: int         # 0, 1, 2 ... in the order of the calls
    id: str
    name: str
    arguments: str


StreamEvent = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def detect_format(chat_template_source: str | None) -> str | None:
    """The tool-call format a chat template teaches its model; None when it teaches none."""
    if not chat_template_source:
        return None
    if "<function=" in chat_template_source:
        return QWEN_3_5
    if CALL_OPEN in chat_template_source:
        return QWEN_3
    return None


def parse_tool_calls(text: str, fmt: str, tools: list[dict] | None) -> ParsedMessage:
    """A finished output's content and tool calls (``fmt``: "qwen_3" or "qwen_3_5"; ``tools``: OpenAI tools)."""
    stream = ToolCallStream(fmt, tools)
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [ToolCall(e.id, e.name, e.arguments) for e in events if isinstance(e, ToolCallDelta)]
    return ParsedMessage(content, calls)


class ToolCallStream:
    """Feed an output's text deltas; get content deltas as soon as they are certain, and each tool call whole
    once its ``</tool_call>`` has arrived. ``finish()`` once at the end releases what is held."""

    def __init__(self, fmt: str, tools: list[dict] | None):
        if fmt not in FORMATS:
            raise ValueError(f"tool call format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
        self._fmt = fmt
        self._schemas = parameter_schemas(tools)
        # Outside a call: a suffix that may be the start of "<tool_call>". Inside: the call's body so far.
        self._held = ""
        self._in_call = False
        self._searched = 0   # inside a call: no "</tool_call>" starts before this offset of _held
        self._content = _ContentAroundCalls()
        self._calls = 0

    def feed(self, text: str) -> list[StreamEvent]:
        self._held += text
        events: list[StreamEvent] = []
        while True:
            if self._in_call:
                end = self._held.find(CALL_CLOSE, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._held) - len(CALL_CLOSE) + 1)
                    return events
                self._close_call(self._held[:end], events)
                self._held, self._in_call = self._held[end + len(CALL_CLOSE):], False
            else:
                start = self._held.find(CALL_OPEN)
                if start < 0:
                    settled = len(self._held) - partial_tag_length(self._held, CALL_OPEN)
                    self._add_text(self._held[:settled], events)
                    self._held = self._held[settled:]
                    return events
                self._add_text(self._held[:start], events)
                self._held, self._in_call, self._searched = self._held[start + len(CALL_OPEN):], True, 0

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        unfinished = CALL_OPEN + self._held if self._in_call else self._held   # an unclosed call stays content
        self._held, self._in_call = "", False
        self._add_text(unfinished, events)
        self._add_content(self._content.finish(), events)
        return events

    def _close_call(self, body: str, events: list[StreamEvent]) -> None:
        if self._fmt == QWEN_3:
            call = parse_json_call(body)
        else:
            call = parse_xml_call(body, self._schemas)
        if call is None:
            self._add_text(CALL_OPEN + body + CALL_CLOSE, events)
            return
        name, arguments = call
        self._content.call()
        events.append(ToolCallDelta(self._calls, new_call_id(), name, json.dumps(arguments, ensure_ascii=False)))
        self._calls += 1

    def _add_text(self, text: str, events: list[StreamEvent]) -> None:
        self._add_content(self._content.text(text), events)

    @staticmethod
    def _add_content(text: str, events: list[StreamEvent]) -> None:
        if not text:
            return
        if events and isinstance(events[-1], ContentDelta):
            events[-1].text += text
        else:
            events.append(ContentDelta(text))


class _ContentAroundCalls:
    """The content text around calls: whitespace touching a call is dropped, except that when calls sit between
    two pieces of text the whitespace before the calls separates them. Trailing whitespace is held until the
    next text, call or the end decides it, so the result does not depend on how the text arrives."""

    def __init__(self) -> None:
        self._space = ""          # whitespace after the last text emitted (before the calls, after a call)
        self._after_call = False  # a call came after the last non-whitespace text
        self._any_text = False    # non-whitespace text has been emitted

    def text(self, text: str) -> str:
        core = text.strip()
        if not core:
            if not self._after_call:
                self._space += text
            return ""
        lead, trail = text[:len(text) - len(text.lstrip())], text[len(text.rstrip()):]
        if self._after_call:
            prefix = self._space if self._any_text else ""   # the calls' own surrounding whitespace is dropped
        else:
            prefix = self._space + lead
        self._space, self._after_call, self._any_text = trail, False, True
        return prefix + core

    def call(self) -> None:
        self._after_call = True   # _space keeps the whitespace before the first call of this run

    def finish(self) -> str:
        rest = "" if self._after_call else self._space
        self._space = ""
        return rest
