"""Grammar-constrained decoding: a request's grammar → per-row token masks, with xgrammar as the engine.

A request may carry a `GrammarSpec` (sampling_params.py): any JSON value, a JSON Schema, a regex, an EBNF grammar
or an xgrammar structural tag (what tool calls compile to). `Grammars` compiles specs against the model's
tokenizer (compiled grammars are cached by xgrammar's compiler, so a schema sent twice compiles once) and makes a
`TokenMatcher` per sequence. The matcher always stands after the sequence's committed output:

    masks(drafts)   the allowed-token bitmask of each verify row of one step: row 0 after the committed output,
                    row j after drafts 1..j. It walks through the drafts and rolls back, so the matcher is where it
                    was. Rows after a draft the grammar refuses are left open: that draft is rejected whatever
                    follows (its target probability is 0 once masked), so those rows never emit.
    accept(tokens)  the step's emitted tokens (accepted drafts + recovered / bonus token) join the state.

Masks are bitmasks, int32 [rows, ceil(V / 32)], bit (t % 32) of word t // 32 set when token t is allowed (xgrammar's
layout); `unpack_mask` turns them into a bool mask on the device. Ids past the tokenizer (a vocabulary padded to a
multiple of 64) are never allowed. Every verify row samples from the target's distribution masked to the grammar, so
speculation stays exact: the output is the constrained distribution's, the same with and without drafts.
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch

from .sampling_params import GrammarSpec, SamplingError

log = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.json"
ALL_ALLOWED = -1          # an int32 word with every bit set


class GrammarError(SamplingError):
    """The grammar does not compile (bad JSON Schema, regex or EBNF): a bad request; the message says where."""


class TokenMatcher:
    """One sequence's place in its grammar, after its committed output."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size
        self.num_words = (vocab_size + 31) // 32

    @property
    def terminated(self) -> bool:
        """The grammar has ended (its stop token accepted): no token may follow."""
        return self._matcher.is_terminated()

    def masks(self, drafts: list[int], out: torch.Tensor) -> None:
        """Fill `out` ([len(drafts) + 1, num_words] int32, host) with the allowed tokens of each verify row."""
        out.fill_(ALL_ALLOWED)
        walked = 0
        for row in range(len(drafts) + 1):
            if self._matcher.is_terminated():
                break                                   # a stop token was drafted: later rows never emit
            self._matcher.fill_next_token_bitmask(out, row)
            if row == len(drafts) or not self._matcher.accept_token(drafts[row]):
                break
            walked += 1
        if walked:
            self._matcher.rollback(walked)

    def accept(self, tokens: list[int]) -> None:
        """The step's emitted tokens. Each was sampled under this matcher's mask, so a refusal is a bug."""
        for t in tokens:
            if self._matcher.is_terminated():
                return                                  # tokens after the stop token are cut by the engine
            if not self._matcher.accept_token(t):
                raise RuntimeError(f"token {t} was emitted against its grammar's mask")


class Grammars:
    """Compiles grammar specs for one tokenizer and vocabulary; thread-safe (requests are checked in gRPC threads
    before they queue, so a schema compiles there and the step thread finds it cached)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=True)

    @classmethod
    def from_folder(cls, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]) -> "Grammars | None":
        """For the model folder's tokenizer; None when it has no tokenizer.json (grammar requests are refused)."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            return None
        from transformers import PreTrainedTokenizerFast
        start = time.perf_counter()
        grammars = cls(PreTrainedTokenizerFast(tokenizer_file=str(path)), vocab_size, stop_token_ids)
        log.info("grammar engine: xgrammar over %d token ids (%.2f s)", vocab_size, time.perf_counter() - start)
        return grammars

    def compile(self, spec: GrammarSpec):
        """The compiled grammar (cached); GrammarError names what is wrong with the spec."""
        c = self.compiler
        try:
            if spec.kind == "json_object":
                return c.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.text, any_whitespace=True, max_whitespace_cnt=4)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.text)
            return c.compile_structural_tag(json.loads(spec.text))   # structural_tag
        except Exception as e:  # xgrammar raises RuntimeError, ValueError and its own (InvalidJSONError, ...)
            raise GrammarError(f"grammar ({spec.kind}) does not compile: {_first_line(e)}") from e

    def matcher(self, spec: GrammarSpec) -> TokenMatcher:
        return TokenMatcher(self._xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)


def unpack_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] bitmask (on the device) → bool [R, vocab_size], True where the token is allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1                                   # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def masks_array(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask of `num_rows` rows, all allowed (rows of unconstrained sequences stay so)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), ALL_ALLOWED, dtype=torch.int32)


_CPP_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: (\(error\.empty\(\)\) is false: )?)?")


def _first_line(e: Exception) -> str:
    """xgrammar's C++ errors start "[time] file.cc:line: Check failed: ...": keep the part a user can act on."""
    text = _CPP_PREFIX.sub("", str(e).strip())
    return text.splitlines()[0][:500] if text else type(e).__name__


__all__ = ["GrammarError", "Grammars", "TokenMatcher", "masks_array", "unpack_mask"]
