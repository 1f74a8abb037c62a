"""Qwen3 / Qwen3.5 thinking: a model's output → its reasoning and its content, for a finished text
(``split_reasoning``) and for a stream of text deltas (``ReasoningStream``).

A thinking model writes::

    <think>
    The user wants the capital of France.
    </think>

    Paris.

    → reasoning "The user wants the capital of France.", content "Paris."

When thinking is on, Qwen3.5's chat template ends the generation prompt with ``<think>\\n`` itself, so the output
starts inside the reasoning and holds only ``</think>`` (``starts_in_reasoning``; ``prompt_opens_reasoning``
tells it from the rendered prompt). Qwen3's output may start with ``<think>``. Rules:
- ``<think>`` at the start of the output (after optional whitespace) opens the reasoning; ``</think>`` closes
  it. A ``<think>`` anywhere else is content, and so is everything when no reasoning is open (reasoning None).
- The reasoning is trimmed of the newlines around it, the content of the newlines before it.
- An output that ends inside the reasoning (max_tokens hit) is all reasoning, with content "".
- The stream's pieces joined per kind equal ``split_reasoning``'s fields for any split of the text. It holds
  back only what may be a tag (or whitespace before a possible opening ``<think>``) and newlines that may
  precede ``</think>``. Its "content" pieces may be fed on to ``ToolCallStream``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .stop_strings import partial_tag_length

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TURN_START = "<|im_start|>"
REASONING, CONTENT = "reasoning", "content"


@dataclass
class SplitText:
    reasoning: str | None   # None when the output had no reasoning part
    content: str


def split_reasoning(text: str, starts_in_reasoning: bool) -> SplitText:
    """A finished output's reasoning and content."""
    after_space = text.lstrip()
    if after_space.startswith(THINK_OPEN):
        body = after_space[len(THINK_OPEN):]
    elif starts_in_reasoning:
        body = text
    else:
        return SplitText(None, text)
    reasoning, _, content = body.partition(THINK_CLOSE)
    return SplitText(reasoning.strip("\n"), content.lstrip("\n"))


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>``: in its last turn (after the last
    ``<|im_start|>``, so a ``<think>`` quoted in a user message does not count), the last ``<think>`` comes
    after the last ``</think>``."""
    turn_start = prompt_text.rfind(TURN_START)
    last_turn = prompt_text[turn_start:] if turn_start >= 0 else prompt_text
    opened = last_turn.rfind(THINK_OPEN)
    return opened >= 0 and opened > last_turn.rfind(THINK_CLOSE)


class ReasoningStream:
    """Feed an output's text deltas; get ``("reasoning" | "content", text)`` pieces in order. ``finish()`` once
    at the end releases what is held."""

    def __init__(self, starts_in_reasoning: bool):
        self._starts_in_reasoning = starts_in_reasoning
        self._opening = True             # still deciding whether the output opens with <think>
        self._in_reasoning = False
        self._held = ""
        self._reasoning_begun = False    # a reasoning character other than a newline has been sent
        self._content_begun = False      # a content character other than a newline has been sent (or no
                                         # reasoning came: then content is the text as it is)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        pieces: list[tuple[str, str]] = []
        if self._opening:
            self._decide_opening(final=False)
        if not self._opening:
            self._advance(pieces, final=False)
        return pieces

    def finish(self) -> list[tuple[str, str]]:
        pieces: list[tuple[str, str]] = []
        if self._opening:
            self._decide_opening(final=True)
        self._advance(pieces, final=True)
        return pieces

    def _decide_opening(self, final: bool) -> None:
        after_space = self._held.lstrip()
        if after_space.startswith(THINK_OPEN):
            self._held, self._in_reasoning = after_space[len(THINK_OPEN):], True
        elif not final and THINK_OPEN.startswith(after_space):   # whitespace, or part of "<think>": wait
            return
        elif self._starts_in_reasoning:
            self._in_reasoning = True
        else:
            self._content_begun = True
        self._opening = False

    def _advance(self, pieces: list[tuple[str, str]], final: bool) -> None:
        if self._in_reasoning:
            end = self._held.find(THINK_CLOSE)
            if end >= 0:
                self._send_reasoning(self._held[:end].rstrip("\n"), pieces)
                self._held, self._in_reasoning = self._held[end + len(THINK_CLOSE):], False
            elif final:
                self._send_reasoning(self._held.rstrip("\n"), pieces)
                self._held = ""
            else:
                # Hold a possible start of "</think>" and the newlines before it, which go if it comes.
                ready = self._held[:len(self._held) - partial_tag_length(self._held, THINK_CLOSE)]
                settled = ready.rstrip("\n")
                self._send_reasoning(settled, pieces)
                self._held = self._held[len(settled):]
                return
        text, self._held = self._held, ""
        if not self._content_begun:
            text = text.lstrip("\n")
        if text:
            self._content_begun = True
            pieces.append((CONTENT, text))

    def _send_reasoning(self, text: str, pieces: list[tuple[str, str]]) -> None:
        if not self._reasoning_begun:
            text = text.lstrip("\n")
        if text:
            self._reasoning_begun = True
            pieces.append((REASONING, text))
