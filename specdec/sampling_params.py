"""Per-request sampling parameters and their one validation (the gateway and the verifier both call it).

Semantics (the order they apply in, per verify row; docs/sampling.md):
  1. penalties on the logits, counting the output so far plus the drafts before this row in the same step:
     repetition (prompt and output tokens: positive logits divided, negative multiplied, as in vLLM / HF),
     presence (minus `presence_penalty` once per output token seen), frequency (minus `frequency_penalty`
     times its count), as in the OpenAI API;
  2. temperature (0, or below 1e-5: greedy, i.e. argmax of the penalised logits);
  3. top-k, then top-p (the smallest prefix of the sorted distribution with mass >= top_p), then min-p (drop
     tokens below min_p × the largest probability); the rest renormalised. Tokens cut here are never emitted.
`grammar` constrains the output: before step 1, the tokens the grammar does not allow next get logit −inf
(specdec/grammar.py), so every verify row samples from the masked distribution and the output follows the grammar
exactly, with or without drafts.
`logprobs` (n in 0..20) streams each emitted token's log-probability under that processed distribution (for
greedy requests: the same processing at temperature 1) and its n most likely alternatives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

DEFAULT_MAX_TOKENS = 256
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
GREEDY_BELOW = 1e-5                   # temperatures under this sample as greedy (logits / T would overflow)
SEED_LIMIT = 2 ** 63
TOP_K_LIMIT = 2 ** 31 - 1             # the wire's int32; any larger value would overflow the device tensors
PENALTY_LIMIT = 2.0                   # presence / frequency penalties in [-2, 2], as the OpenAI API
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "structural_tag")
MAX_GRAMMAR_CHARS = 1 << 20
MAX_CACHE_SALT_CHARS = 256


class SamplingError(ValueError):
    """A bad sampling field; the message names it."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. `kind`: "json_object" (any JSON object; `text` unused), "json_schema" (`text`: the
    schema as JSON), "regex", "ebnf" (xgrammar's EBNF, rule `root`), "structural_tag" (`text`: an xgrammar
    structural tag as JSON, e.g. a model's tool-call format)."""
    kind: str
    text: str = ""

    def validate(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise SamplingError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text) > MAX_GRAMMAR_CHARS:
            raise SamplingError(f"grammar text must be a string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.kind != "json_object" and not self.text.strip():
            raise SamplingError(f"grammar ({self.kind}) needs its text")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0                # 1: off
    top_k: int = 0                    # 0: off
    min_p: float = 0.0                # 0: off
    repetition_penalty: float = 1.0   # 1: off
    presence_penalty: float = 0.0     # 0: off
    frequency_penalty: float = 0.0    # 0: off
    seed: int | None = None           # None: a fresh seed per request
    logprobs: int | None = None       # None: none; n: the emitted token's logprob and the top n alternatives
    stop: tuple[str, ...] = ()        # stop strings (the gateway applies them to text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculation: bool = True          # False: this request verifies no drafts (others in its batch still do)
    grammar: GrammarSpec | None = None  # None: unconstrained
    cache_salt: str | None = None     # prefix-cache namespace: prefixes are shared only under the same salt
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def argmax_only(self) -> bool:
        """Verification needs only each row's argmax (a grammar's mask applies before it): greedy, no penalties,
        no logprobs."""
        return self.greedy and not self.penalised and self.logprobs is None

    @property
    def decided_on_device(self) -> bool:
        """Verification needs nothing of the request that only the host has: no penalties (they count the
        output tokens), no logprobs (read per token), no grammar (its matcher walks the host's tokens).
        Temperature, top-k, top-p and min-p are per-row parameters and the draws are keyed by output position,
        which the device can count on from an unread step."""
        return not self.penalised and self.logprobs is None and self.grammar is None

    @staticmethod
    def from_fields(values: dict) -> "SamplingParams":
        """From a dict of set fields (absent or None: the default); SamplingError on unknown fields or types."""
        known = {f.name for f in fields(SamplingParams)} - {"extra"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SamplingError(f"sampling: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        given = {k: v for k, v in values.items() if v is not None}
        for name in ("stop", "stop_token_ids"):
            if name in given:
                if isinstance(given[name], (str, bytes)) or not isinstance(given[name], (list, tuple)):
                    raise SamplingError(f"{name} must be a list, got {type(given[name]).__name__}")
                given[name] = tuple(given[name])
        if isinstance(given.get("grammar"), dict):
            grammar = given["grammar"]
            if set(grammar) - {"kind", "text"}:
                raise SamplingError(f"grammar: unknown field(s) {', '.join(sorted(set(grammar) - {'kind', 'text'}))}")
            given["grammar"] = GrammarSpec(grammar.get("kind"), grammar.get("text", ""))
        return SamplingParams(**given)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise SamplingError naming the first bad field; return self."""
        _integer("max_tokens", self.max_tokens, low=1)
        _number("temperature", self.temperature, low=0.0)
        _number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _integer("top_k", self.top_k, low=0, high=TOP_K_LIMIT)
        _number("min_p", self.min_p, low=0.0, high=1.0)
        _number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _number("presence_penalty", self.presence_penalty, low=-PENALTY_LIMIT, high=PENALTY_LIMIT)
        _number("frequency_penalty", self.frequency_penalty, low=-PENALTY_LIMIT, high=PENALTY_LIMIT)
        if self.seed is not None:
            _integer("seed", self.seed, low=0, high=SEED_LIMIT - 1)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        for name in ("ignore_eos", "speculation"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._validate_stops(vocab_size)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            raise SamplingError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                f"characters, got {self.cache_salt!r:.60}")
        if self.grammar is not None:
            if not isinstance(self.grammar, GrammarSpec):
                raise SamplingError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
            self.grammar.validate()
        return self

    def _validate_stops(self, vocab_size: int | None) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise SamplingError(f"stop[{i}] must be a non-empty string, got {s!r}")
            if len(s) > MAX_STOP_LEN:
                raise SamplingError(f"stop[{i}] is {len(s)} characters long, the limit is {MAX_STOP_LEN}")
        for i, t in enumerate(self.stop_token_ids):
            _integer(f"stop_token_ids[{i}]", t)
            if vocab_size is not None and not 0 <= t < vocab_size:
                raise SamplingError(f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def token_ids_in_vocab(ids: list, vocab_size: int) -> bool:
    """Every id an int (not a bool) in [0, vocab_size), checked in C loops: a long prompt's fast path; callers
    that must name a bad id (or accept other numbers) walk the ids themselves when this is False."""
    return set(map(type, ids)) <= {int} and (not ids or (min(ids) >= 0 and max(ids) < vocab_size))


def _integer(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise SamplingError(f"{name} must be {'in ' if high is not None else ''}{bounds}, got {value}")


def _number(name: str, value, low: float, high: float | None = None, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(f"{name} must be a number, got {value!r}")
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        left = "(" if low_open else "["
        bounds = f"in {left}{low}, {high}]" if high is not None else f"a finite number {'>' if low_open else '>='} {low}"
        raise SamplingError(f"{name} must be {bounds}, got {value}")
