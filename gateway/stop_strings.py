"""Stop strings over a stream of text deltas.

``StopStringMatcher(stop).feed(delta) -> (text_safe_to_emit, hit)``. Text that could still be the
beginning of a stop string is held back until the following text decides it; on a hit the output
ends right before the stop string, which is not emitted (vLLM's default), and the stream is over.

Semantics are those of checking after every character: the stream stops at the first character
that completes some stop string, and the output is cut before that occurrence (if several stop
strings end at that character, before the one that starts first). So for stop ``["abcd", "bc"]``
the text ``"abcd"`` stops at ``"bc"`` and emits ``"a"``. The result never depends on how the text
is split into deltas.
"""
from __future__ import annotations


class StopStringMatcher:
    """Feed text deltas; get back the text that is safe to emit and whether a stop string hit."""

    def __init__(self, stop: list[str] | tuple[str, ...] | None):
        stop = list(stop or [])
        for s in stop:
            if not isinstance(s, str):
                raise ValueError(f"stop: expected strings, got {type(s).__name__}")
            if not s:
                raise ValueError("stop: empty stop string")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the stream, once one has

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def held(self) -> str:
        """Text received but not yet emitted (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return (text safe to emit now, whether a stop string was hit).

        After a hit every further call returns ``("", True)``.
        """
        if self.matched is not None:
            return "", True
        if not self.stop:
            return delta, False
        buf = self._held + delta
        # The held text holds no complete stop string, so any occurrence ends inside ``delta``.
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self.matched = best[2]
            self._held = ""
            return buf[:best[1]], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """End of stream without a hit: release the held-back text."""
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        keep = 0
        for s in self.stop:
            i = buf.find(s[0], max(len(buf) - len(s) + 1, 0))
            while i != -1 and len(buf) - i > keep:
                if s.startswith(buf[i:]):
                    keep = len(buf) - i
                    break
                i = buf.find(s[0], i + 1)
        return keep


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (what a stream holds back)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
