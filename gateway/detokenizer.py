"""Streaming token ids -> text deltas that never split a UTF-8 character.

Prefix/read-offset technique (as in vLLM / TGI): keep two offsets into the token list,
``prefix_offset <= read_offset``. Text up to ``read_offset`` has been emitted; the tokens in
``[prefix_offset, read_offset)`` are re-decoded as context so that decoders that look at the
neighbouring token (byte-level merges of a multi-byte character, SentencePiece's leading-space
rule) see what they would see in a full decode. Each ``add`` decodes only that small window plus
the new tokens and emits ``decode(window + new)[len(decode(window)):]``, so its cost is
O(window), not O(sequence).

When the window's decode ends in U+FFFD, the last bytes may be an incomplete multi-byte
character: those tokens are held back (offsets stay put) until a later token completes it; only
the text before the trailing U+FFFD run, which later tokens cannot change, is emitted meanwhile.
``flush`` emits whatever is still held at the end (U+FFFD included if the stream truly ended
mid-character). Offsets advance only to points where the decode ends on a complete character,
where UTF-8 decoding restarts cleanly, so ``"".join(deltas) + flush() == decode(all ids)``.
If a decoder ever breaks the prefix assumption (``decode(window + new)`` does not start with
``decode(window)``), that step falls back to decoding the whole sequence.

Exact for byte-level BPE (GPT-2 / Qwen / Llama-3 style: lossy UTF-8 decoding resynchronises after
any byte). SentencePiece byte-fallback decoders are exact on well-formed text, but turn a whole run
of byte tokens into U+FFFDs once any byte in it is invalid, which no streaming decoder can foresee.
"""
from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens decoded as context for the first generated tokens (vLLM uses 5)


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """``add(new_ids) -> str`` text delta, ``flush() -> str`` the held-back rest at the end.

    ``tokenizer``: anything with ``decode(ids, skip_special_tokens=...)`` (a ``TextTokenizer``).
    ``prompt_ids``: tokens already in the sequence whose text is not part of the output; the last
    few are used as decode context. The output is ``decode(prompt + generated)`` after the prompt's
    own text, which is ``decode(prompt)`` less a trailing U+FFFD run: a character that a token-id
    prompt leaves incomplete comes out whole, with the first generated text, once completed.
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._n_prompt = len(self._ids)
        self._read = len(self._ids)
        self._prefix = max(0, self._read - PROMPT_CONTEXT)
        self._prefix_text = self._decode(self._prefix, self._read)
        self._emitted = 0                 # characters emitted so far (for the full-decode fallback)
        self._pending = 0                 # characters of tokens [read, end) already emitted
        if self._prefix_text.endswith(REPLACEMENT):
            # The prompt ends mid-character, or its last tokens alone look like it (orphan continuation
            # bytes, special tokens): no clean point to start from, so treat the whole prompt as held
            # tokens whose text, less its trailing U+FFFD run, counts as already emitted. A character
            # that generation completes then comes out whole.
            self._prefix = self._read = 0
            self._prefix_text = ""
            self._pending = len(self._prompt_text())

    def _prompt_text(self) -> str:
        """The prompt's own text: its decode less any trailing U+FFFD run."""
        return self._decode(0, self._n_prompt).rstrip(REPLACEMENT)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    @property
    def token_ids(self) -> list[int]:
        """All tokens seen (prompt included)."""
        return self._ids

    @property
    def num_held_tokens(self) -> int:
        """Tokens received whose text has not been emitted yet."""
        return len(self._ids) - self._read

    def add(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; return the newly complete text (possibly "")."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (end of stream); U+FFFD stays if a character was cut."""
        if self._read == len(self._ids) or len(self._ids) == self._n_prompt:
            return ""                     # nothing held, or nothing generated
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        text = self._decode(self._prefix)             # the window: context + unemitted tokens
        if text.startswith(self._prefix_text):
            visible = text[len(self._prefix_text):]   # text of tokens [read, end)
        else:                                         # decoder not prefix-stable here: decode it all
            visible = self._decode(0)[len(self._prompt_text()) + self._emitted - self._pending:]
        if visible.endswith(REPLACEMENT) and not final:
            # The trailing U+FFFD run may be an incomplete character that later tokens complete: hold
            # the tokens; text before the run cannot change any more, so emit it now.
            stable = visible.rstrip(REPLACEMENT)
            delta = stable[self._pending:]
            self._pending = max(self._pending, len(stable))
            self._emitted += len(delta)
            return delta
        delta = visible[self._pending:]
        self._emitted += len(delta)
        self._pending = 0
        # The decode ends on a complete character: a clean point to advance the offsets to. Keep the
        # older context when the new tokens show no text (e.g. skipped special tokens).
        tail = self._decode(self._read)
        if tail:
            self._prefix, self._prefix_text = self._read, tail
        else:
            self._prefix_text = text
        self._read = len(self._ids)
        return delta
