"""The engine's requests: each checked and admitted as a Sequence (given to the scheduler), found by its id, its
step's tokens cut where it stops, and ended (finished or aborted: out of the scheduler and the drafter); and what a
step gives back to it (RequestOutput)."""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass

from specdec.grammar import GrammarError, Grammars
from specdec.sampling_params import SamplingParams, token_ids_in_vocab

from .acceptance_stats import AcceptanceStats
from .drafting_stage import DraftingStage
from .sampler import TokenLogprob
from .scheduler import ScheduledSeq, Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None               # None while running
    stats: AcceptanceStats
    num_prompt: int
    forced_acceptance: bool = False
    logprobs: list[TokenLogprob] | None = None   # [len(new_token_ids)] when the request asked
    queue_seconds: float = 0.0              # the request's wait before its first admission
    cached_tokens: int = 0                  # prompt tokens its first admission took from the prefix cache


class Requests:
    """The running requests by id, and the admission, stop and end of each (the engine's; one thread but for
    check_grammar)."""

    def __init__(self, scheduler: Scheduler, drafting: DraftingStage, grammars: Grammars | None, vocab_size: int,
                 eos: set[int], max_len: int, drafting_configured: bool, forced_acceptance: bool):
        """`grammars` None: the model folder has no tokenizer, grammars are refused. `max_len`: the longest
        prompt + max_tokens admitted. `drafting_configured`: a request starts in the drafter (k > 0)."""
        self.scheduler, self.drafting, self.grammars = scheduler, drafting, grammars
        self.vocab_size, self.eos, self.max_len = vocab_size, eos, max_len
        self.drafting_configured, self.forced_acceptance = drafting_configured, forced_acceptance
        self.by_id: dict[str, Sequence] = {}
        self.ids = itertools.count()           # sequence ids (and the ids of generate()'s requests)
        self._seeds = random.Random()

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar, if any (any thread: the compiled grammar is cached for add); GrammarError
        when it does not compile or the model has no tokenizer to compile it for."""
        if params.grammar is None:
            return
        if self.forced_acceptance:
            raise GrammarError("grammar: not with forced acceptance (--forced-acceptance-length accepts drafts the "
                               "grammar refuses)")
        if self.grammars is None:
            raise GrammarError("grammar: this model folder has no tokenizer.json, which constrained decoding needs")
        self.grammars.compile(params.grammar)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Admit a request (ValueError / OverflowError / GrammarError when it cannot be served: not admitted)."""
        vocab = self.vocab_size
        params.validate(vocab)
        self.check_grammar(params)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if not token_ids_in_vocab(prompt_ids, vocab) and any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if request_id in self.by_id:
            raise ValueError(f"request_id {request_id!r} is already running: request ids must be unique")
        # Drafts never reach past prompt + max_tokens (a sequence asks for at most remaining - 1 of them), so
        # the limit is the same as the gateway's: no request passes there and fails here.
        if len(prompt_ids) + params.max_tokens > self.max_len:
            raise OverflowError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                                f"maximum context of {self.max_len} tokens")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        seq = Sequence(next(self.ids), list(prompt_ids), len(prompt_ids), params, seed, request_id,
                       in_drafter=self.drafting_configured)
        if params.grammar is not None:
            seq.grammar = self.grammars.matcher(params.grammar)
        self.by_id[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.by_id.get(request_id)
        if seq is None:
            return False
        self.end(seq, "abort")
        return True

    def emit(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """Give `seq` a step's tokens up to where it stops: (the tokens kept, why it stops or None)."""
        kept, reason = [], None
        for t in tokens:
            kept.append(t)
            # (a grammar allows the stop token only where it may end: then it ends, ignore_eos or not)
            ends = t in self.eos and (not seq.params.ignore_eos or seq.grammar is not None)
            if ends or t in seq.params.stop_token_ids:
                reason = "stop"
                break
            if len(seq.output_ids) + len(kept) >= seq.params.max_tokens:
                reason = "length"
                break
        seq.emitted(kept)
        if seq.grammar is not None and seq.grammar.error:   # the grammar engine failed (e.g. a parser limit)
            log.error("request %s: its grammar failed (%s); the request ends with an error", seq.request_id,
                      seq.grammar.error)
            reason = "error"
        return kept, reason

    def commit(self, p: ScheduledSeq, tokens: list[int], num_accepted: int, logprobs: list[TokenLogprob] | None,
               stats: AcceptanceStats) -> RequestOutput:
        """A read step's tokens for one sequence: kept up to its stop (emit), a verify step counted in its stats and
        `stats` (the step that completes a prefill is not one), the request ended where it stopped."""
        seq = p.seq
        kept, reason = self.emit(seq, tokens)
        if p.decoding:
            seq.verified(p.num_drafts, num_accepted, len(kept))
            stats.record(p.num_drafts, num_accepted, len(kept))
        if reason:
            self.end(seq, reason)
        return RequestOutput(seq.request_id, kept, reason, seq.stats, seq.num_prompt,
                             forced_acceptance=self.forced_acceptance,
                             logprobs=logprobs[:len(kept)] if logprobs is not None else None,
                             queue_seconds=seq.queue_seconds or 0.0, cached_tokens=seq.cached_tokens)

    def end(self, seq: Sequence, reason: str) -> None:
        seq.finished(reason)
        self.by_id.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        self.drafting.forget([seq])
