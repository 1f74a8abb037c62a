"""Grammar-constrained decoding: a request's grammar → per-row token masks.

A request may carry a `GrammarSpec` (sampling_params.py). Two engines serve the kinds, each where
bench/grammar_mask_bench.py measured it ahead (bench/README, "Grammar engines"): llguidance for JSON (`json_object`,
`json_schema`), xgrammar for `regex`, `ebnf` and `structural_tag` (tool calls). `Grammars` checks specs against the
model's tokenizer and makes a `TokenMatcher` per sequence. The matcher always stands after the sequence's committed output:

    masks           the allowed-token bitmask of each verify row of one step: row 0 after the committed output,
                    row j after drafts 1..j. The matcher walks through the drafts and rolls back, so it is where it
                    was. Rows after a draft the grammar refuses are left open: that draft is rejected whatever
                    follows (its target probability is 0 once masked), so those rows never emit.
    accept(tokens)  the step's emitted tokens (accepted drafts + recovered / bonus token) join the state.

`Grammars.fill_masks` does one step's sequences at once: llguidance's in parallel on its thread pool, drafts
included, xgrammar's one after another. Masks are bitmasks, int32 [rows, ceil(V / 32)], bit (t % 32) of word t // 32
set when token t is allowed (both engines' layout); `unpack_mask` turns them into a bool mask on the device. Ids past
the tokenizer (a vocabulary padded to a multiple of 64) are never allowed. Every verify row samples from the target's
distribution masked to the grammar, so speculation stays exact: the output is the constrained distribution's, the
same with and without drafts.
"""
from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .sampling_params import GrammarSpec, SamplingError

log = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.json"
ALL_ALLOWED = -1                  # an int32 word with every bit set
JSON_KINDS = ("json_object", "json_schema")
# JSON whitespace: at most 4 characters between two tokens (a model that loops on newlines cannot run away)
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,4}"}
JSON_CACHE = 256                    # checked JSON grammars kept (llguidance's text; its matchers compile lazily)
XGRAMMAR_CACHE_BYTES = 512 << 20    # xgrammar's compiled grammars kept (tool sets differ per chat)


class GrammarError(SamplingError):
    """The grammar does not compile (bad JSON Schema, regex or EBNF): a bad request; the message says where."""


class TokenMatcher:
    """One sequence's place in its grammar, after its committed output (xgrammar's matcher). `error` is set, and
    the matcher stops, when a token it must take is refused (the engine then ends the request with "error")."""

    def __init__(self, matcher):
        self._matcher = matcher
        self.error: str | None = None

    @property
    def terminated(self) -> bool:
        """The grammar has ended (its stop token accepted): no token may follow."""
        return self._matcher.is_terminated()

    def masks(self, drafts: list[int], out: torch.Tensor) -> None:
        """Fill `out` ([len(drafts) + 1, words] int32, host, all allowed) with each verify row's tokens."""
        walked = 0
        for row in range(len(drafts) + 1):
            if self._matcher.is_terminated():
                break                                   # a stop token was drafted: later rows never emit
            self._matcher.fill_next_token_bitmask(out, row)
            if row == len(drafts) or not self.walk(drafts[row]):
                break
            walked += 1
        self.unwalk(walked)

    def walk(self, token: int) -> bool:
        """Take a drafted token, to be undone (`unwalk`); False when the grammar refuses it (nothing taken)."""
        return self._matcher.accept_token(token)

    def unwalk(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def accept(self, tokens: list[int]) -> None:
        """The step's emitted tokens. Each was sampled under this matcher's mask, so a refusal is a fault."""
        for t in tokens:
            if self.terminated or self.error:
                return                                  # tokens after the stop token are cut by the engine
            if not self._matcher.accept_token(t):
                self.error = f"token {t} was emitted against the grammar's mask"


class GuidanceMatcher(TokenMatcher):
    """The same over llguidance's matcher. It stops as soon as only a stop token can follow; `terminated` is
    after that token, as xgrammar's. A parser limit puts it in an error state, which `error` reports."""

    def __init__(self, matcher, stop_token_ids: set[int], executor):
        super().__init__(matcher)
        self._stop_ids, self._ended, self._executor = stop_token_ids, False, executor

    @property
    def terminated(self) -> bool:
        return self._ended

    def masks(self, drafts: list[int], out: torch.Tensor) -> None:
        _fill_guided(self._executor, [(self._matcher, 0, drafts)], out)

    def walk(self, token: int) -> bool:
        # checked first: a refused consume_token leaves llguidance's matcher in an error state for good
        return self._matcher.validate_tokens([token]) == 1 and self._matcher.consume_token(token)

    def accept(self, tokens: list[int]) -> None:
        for t in tokens:
            if self._ended or self.error:
                return
            if not self._matcher.consume_token(t) or self._matcher.is_error():
                self.error = _first_line(RuntimeError(self._matcher.get_error() or
                                                      f"token {t} was emitted against the grammar's mask"))
                return
            self._ended = t in self._stop_ids


class Grammars:
    """Checks grammar specs for one tokenizer and vocabulary and makes matchers. Thread-safe: requests are checked
    in gRPC threads before they queue, so a grammar compiles there and the step thread finds it cached. The
    engines load the tokenizer on the first grammar request (bench/README: seconds at Qwen3.5's vocabulary), not at
    start-up."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        self.tokenizer_file, self.vocab_size = tokenizer_file, vocab_size
        self.stop_token_ids, self.max_threads = set(stop_token_ids), max_threads
        self._lock = threading.Lock()
        self._loaded = False
        self._json_grammars = functools.lru_cache(maxsize=JSON_CACHE)(self._json_grammar)

    @classmethod
    def from_folder(cls, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]) -> "Grammars | None":
        """For the model folder's tokenizer; None when it has no tokenizer.json (grammar requests are refused)."""
        path = Path(model_dir) / TOKENIZER_FILE
        return cls(path, vocab_size, stop_token_ids) if path.is_file() else None

    def load(self) -> None:
        """Load the tokenizer into both engines (once; GrammarError if they cannot read it)."""
        with self._lock:
            if self._loaded:
                return
            import llguidance
            import llguidance.hf
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast
            start = time.perf_counter()
            try:
                tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_file))
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=sorted(self.stop_token_ids))
                self.guidance = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                             eos_token=sorted(self.stop_token_ids))
            except Exception as e:  # a tokenizer either engine cannot read: grammar requests are refused
                raise GrammarError(f"grammar: the grammar engines cannot read {self.tokenizer_file} "
                                   f"({_first_line(e)})") from e
            self._xgr, self._llg = xgr, llguidance
            self.compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=True,
                                                cache_limit_bytes=XGRAMMAR_CACHE_BYTES)
            self.executor = llguidance.LLExecutor(self.max_threads)
            self._loaded = True
            log.info("grammar engines loaded over %d token ids in %.2f s: llguidance (JSON), xgrammar (regex, EBNF, "
                     "structural tags)", self.vocab_size, time.perf_counter() - start)

    def compile(self, spec: GrammarSpec):
        """xgrammar: the compiled grammar; llguidance: its grammar text, checked (both cached). GrammarError names
        what is wrong with the spec."""
        self.load()
        try:
            if spec.kind in JSON_KINDS:
                return self._json_grammars(spec)
            c = self.compiler
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.text)
            return c.compile_structural_tag(json.loads(spec.text))   # structural_tag
        except Exception as e:  # both engines raise RuntimeError, ValueError and their own kinds
            raise GrammarError(f"grammar ({spec.kind}) does not compile: {_first_line(e)}") from e

    def _json_grammar(self, spec: GrammarSpec) -> str:
        schema = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        error = self._llg.LLMatcher.validate_grammar(grammar, self.guidance)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, spec: GrammarSpec) -> TokenMatcher:
        compiled = self.compile(spec)
        if spec.kind in JSON_KINDS:
            return GuidanceMatcher(self._llg.LLMatcher(self.guidance, compiled), self.stop_token_ids, self.executor)
        return TokenMatcher(self._xgr.GrammarMatcher(compiled))

    def fill_masks(self, jobs: list[tuple[TokenMatcher, int, list[int]]], out: torch.Tensor) -> None:
        """One step's masks: for each (matcher, first row, drafts), rows first .. first + len(drafts) of `out`
        ([R, words] int32, host, all allowed)."""
        _fill_guided(self.executor, [(m._matcher, row, drafts) for m, row, drafts in jobs
                                     if isinstance(m, GuidanceMatcher)], out)
        for matcher, row, drafts in jobs:
            if not isinstance(matcher, GuidanceMatcher):
                matcher.masks(drafts, out[row:row + len(drafts) + 1])


def _fill_guided(executor, jobs: list[tuple], out: torch.Tensor) -> None:
    """llguidance matchers' rows, in parallel: (matcher, first row, drafts); with drafts it walks them and rolls
    back. The row after a drafted stop token allows the stop token only; rows after a refused draft are left as
    they were (those rows never emit)."""
    import llguidance.torch
    with_drafts = [job for job in jobs if job[2]]
    if with_drafts:
        llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(executor, with_drafts, out)
    plain = [(matcher, row) for matcher, row, drafts in jobs if not drafts]
    if plain:
        llguidance.torch.fill_next_token_bitmask_par(executor, plain, out)


@dataclass
class RowMasks:
    """The grammar masks of a step's constrained verify rows (on the device)."""
    rows: torch.Tensor                # [Rg] int64: the rows of the step's logits they mask
    bits: torch.Tensor                # [Rg, ceil(V / 32)] int32 bitmasks


def mask_rows(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor,
              columns: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` [R, V'] with the tokens `bits` ([Rg, W] int32 bitmasks, on the device) disallow in rows `rows`
    ([Rg] int64) set to −inf (a new tensor). `columns`: the target ids of the logits' columns when they are a
    subset of the vocabulary (a drafter's reduced vocabulary), else column j is token j."""
    if columns is None:
        allowed = unpack_mask(bits, logits.shape[-1])                                   # [Rg, V]
    else:
        allowed = unpack_mask(bits, bits.shape[1] * 32)[:, columns]                     # [Rg, V'] (no sync)
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def unpack_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] bitmask → bool [R, vocab_size], True where the token is allowed. Read as bytes (little-endian:
    token t is bit t % 8 of byte t // 8), so the unpacked temporary is one byte per token."""
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    octets = bitmask.contiguous().view(torch.uint8)                              # [R, 4W]
    bits = (octets[:, :, None] >> shifts) & 1                                    # [R, 4W, 8]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def masks_array(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask of `num_rows` rows, all allowed (rows of unconstrained sequences stay so)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), ALL_ALLOWED, dtype=torch.int32)


_CPP_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: (\(error\.empty\(\)\) is false: )?)?")


def _first_line(e: Exception) -> str:
    """xgrammar's C++ errors start "[time] file.cc:line: Check failed: ...": keep the part a user can act on."""
    text = _CPP_PREFIX.sub("", str(e).strip())
    return text.splitlines()[0][:500] if text else type(e).__name__


__all__ = ["GrammarError", "Grammars", "GuidanceMatcher", "RowMasks", "TokenMatcher", "mask_rows", "masks_array",
           "unpack_mask"]
