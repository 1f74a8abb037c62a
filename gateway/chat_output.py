"""A chat reply's text → what the client reads: reasoning, answer text and tool calls, as deltas while it streams.

The text the verifier's tokens decode to (stop strings applied) goes through two parsers in turn: the reasoning
split (reasoning.py: `<think> ... </think>`, when the chat template has a thinking form) and then, on the answer
part only, the tool-call parser of the template's format (tool_calls.py, when the request gave tools and its
tool_choice is not "none"). Each message of the stream carries the pieces completed since the last; `finish`
flushes what a parser held back (a partial tag). Nothing the model wrote is lost: text that does not parse as a
call stays in the answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import ReasoningStream
from .tool_calls import ContentDelta, ToolCallDelta, ToolCallStream


@dataclass(frozen=True)
class ChatShape:
    """How one chat reply is parsed (decided when its prompt is rendered)."""
    thinks: bool = False                 # the template has a thinking form: split reasoning out
    starts_in_reasoning: bool = False    # the prompt ends inside <think>: the reply starts as reasoning
    tool_format: str | None = None       # "qwen_3" | "qwen_3_5" when the reply is parsed for calls
    tools: list[dict] = field(default_factory=list)
    named_call: bool = False             # tool_choice named a function (its reply ends "stop", as OpenAI's)

    @property
    def plain(self) -> bool:
        return not self.thinks and self.tool_format is None


@dataclass
class ChatDelta:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChatOutput:
    def __init__(self, shape: ChatShape):
        self.shape = shape
        self.reasoning = ReasoningStream(shape.starts_in_reasoning) if shape.thinks else None
        self.calls = ToolCallStream(shape.tool_format, shape.tools) if shape.tool_format else None
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> ChatDelta:
        """The pieces of `text` (the reply's next text) that are certain; `final`: the reply ended, flush all."""
        delta = ChatDelta()
        pieces = self.reasoning.feed(text) if self.reasoning is not None else [("content", text)]
        if final and self.reasoning is not None:
            pieces += self.reasoning.finish()
        answer = ""
        for kind, piece in pieces:
            if kind == "reasoning":
                delta.reasoning += piece
            else:
                answer += piece
        if self.calls is None:
            delta.text = answer
            return delta
        events = self.calls.feed(answer) + (self.calls.finish() if final else [])
        for event in events:
            if isinstance(event, ContentDelta):
                delta.text += event.text
            else:
                delta.tool_calls.append(event)
        self.num_calls += len(delta.tool_calls)
        return delta
