"""Grammar masks on a drafter's proposals: a constrained sequence's drafts stay inside its grammar.

The verifier samples every verify row of a constrained sequence from the target's distribution masked to the
grammar (specdec/grammar.py), so a draft the grammar refuses is always rejected. A drafter that masks its own
logits the same way proposes the likeliest token the grammar allows instead (where an unmasked head guesses free
text, a JSON Schema's keys and punctuation or a tool call's tags are forced). Masking changes which tokens are
proposed, never the output: the verifier verifies under the grammar either way (a drafter that reports q must
report the masked one; an argmax drafter's one-hot q already is).

`DraftMasks` keeps one matcher per constrained sequence, standing after its committed output. It learns the
grammar from the sequence's first DraftInput (`DraftInput.grammar`), compiles it off the drafting thread (a
large schema takes seconds: a drafting step waits COMPILE_WAIT_S for it, then the sequence drafts unmasked until
it is ready, its output tokens kept meanwhile), and takes the committed tokens as they arrive. A drafting step
gets a `DraftWalk`: before draft step j it masks the logits of the constrained rows to what the grammar allows
after the committed output and drafts 0..j-1, which it walks on the host (one sync per draft step, only in
batches with a constrained sequence) and rolls back when the step closes. A row stops drafting after a stop
token, or when nothing the drafter may propose is allowed.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from specdec.grammar import Grammars, TokenMatcher, mask_rows, masks_array

from .interface import DraftInput

log = logging.getLogger(__name__)
COMPILE_WAIT_S = 0.05    # how long a sequence's first drafting step waits for its grammar (then: drafts unmasked)


@dataclass
class _Tracked:
    """A constrained sequence: its matcher once compiled, and the output tokens it has not taken yet."""
    compiling: Future
    next_pos: int                            # the next committed position to take (>= the output's start)
    matcher: TokenMatcher | None = None
    backlog: list[int] = field(default_factory=list)   # output tokens that arrived while it compiled
    waited: bool = False                     # a drafting step has waited for its compile once

    def ready(self, wait_s: float = 0.0) -> TokenMatcher | None:
        """The matcher after the committed output, or None while it compiles (waiting at most `wait_s`, once). A
        compile error, or a matcher the output put in an error state, raises: the caller forgets the sequence."""
        if self.matcher is None:
            wait_s, self.waited = (0.0 if self.waited else wait_s), True
            try:
                self.matcher = self.compiling.result(timeout=wait_s)
            except FutureTimeout:
                return None
            self.matcher.accept(self.backlog)
            self.backlog = []
        if self.matcher.error:
            raise RuntimeError(self.matcher.error)
        return self.matcher


class DraftMasks:
    """The constrained sequences a drafter holds, and a `DraftWalk` per drafting step."""

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self.tracked: dict[int, _Tracked] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="draft-grammar")
        self._loading = self._compiler.submit(grammars.load)   # the tokenizer, seconds at 248k ids: before any
        self.failure: str | None = None                        # request needs it; its error turns masks off

    @staticmethod
    def wanted(setting: str, device: str, eager: bool) -> bool:
        """`setting` on | off | auto. auto: on where the drafter runs eagerly anyway (the CPU, --enforce-eager);
        off for a GPU drafter that replays CUDA graphs, which a masked step cannot (bench/README.md, "Grammar
        cost": there the eager masked step costs more than the acceptance it adds)."""
        if setting not in ("on", "off", "auto"):
            raise ValueError(f"draft masks must be on, off or auto, not {setting!r}")
        return setting == "on" or (setting == "auto" and (not str(device).startswith("cuda") or eager))

    @classmethod
    def for_folder(cls, model_dir: str | None, vocab_size: int, stop_token_ids: list[int]) -> "DraftMasks | None":
        """Masks over the model folder's tokenizer; None (drafts unmasked, logged) when it has none."""
        grammars = Grammars.from_folder(model_dir, vocab_size, stop_token_ids) if model_dir else None
        if grammars is None:
            log.info("no tokenizer.json in %s: constrained sequences draft without their grammar's mask", model_dir)
            return None
        return cls(grammars)

    def ingest(self, seqs: list[DraftInput]) -> None:
        """Take each sequence's committed tokens (a sequence sent from position 0 with a grammar starts over; one first
        seen later, resumed from a cached prefix, is tracked if it starts before its output)."""
        if self._loading.done() and self._loading.exception() is not None and self.failure is None:
            self.failure = str(self._loading.exception())
            self.tracked.clear()
            log.error("grammar masks off: %s", self.failure)
        if self.failure is not None:
            return
        for s in seqs:
            resumed = s.grammar is not None and s.seq_id not in self.tracked and s.start_pos <= s.grammar.output_start
            if s.start_pos == 0 or resumed:
                self.tracked.pop(s.seq_id, None)
                if s.grammar is not None:
                    self.tracked[s.seq_id] = _Tracked(self._compiler.submit(self.grammars.matcher, s.grammar.spec),
                                                      s.grammar.output_start)
            t = self.tracked.get(s.seq_id)
            end = s.start_pos + len(s.token_ids)
            if t is None or end <= t.next_pos:
                continue
            if s.start_pos > t.next_pos:   # tokens this drafter never saw: its place in the grammar is lost
                self.forget(s.seq_id, "a gap in its committed tokens")
                continue
            tokens = s.token_ids[t.next_pos - s.start_pos:]
            t.next_pos = end
            try:
                matcher = t.ready()
            except Exception as e:   # GrammarError, or a matcher in error: this sequence drafts unmasked
                self.forget(s.seq_id, str(e))
                continue
            if matcher is None:
                t.backlog.extend(tokens)
            else:
                matcher.accept(tokens)
                if matcher.error:
                    self.forget(s.seq_id, matcher.error)

    def walk(self, seq_ids: list[int], device: torch.device, vocab_ids: torch.Tensor | None = None
             ) -> "DraftWalk | None":
        """The masks of one drafting step over a batch whose rows are `seq_ids`; None when none is constrained
        (or ready). `vocab_ids`: the target ids of the drafter's logit columns, when it drafts over a subset."""
        rows, matchers = [], []
        for row, seq_id in enumerate(seq_ids):
            t = self.tracked.get(seq_id)
            try:
                matcher = t.ready(COMPILE_WAIT_S) if t is not None else None
            except Exception as e:
                self.forget(seq_id, str(e))
                continue
            if matcher is not None and not matcher.terminated:
                rows.append(row)
                matchers.append(matcher)
        if not rows:
            return None
        return DraftWalk(self.grammars, rows, matchers, device, vocab_ids)

    def forget(self, seq_id: int, reason: str) -> None:
        self.tracked.pop(seq_id, None)
        log.warning("sequence %d drafts without its grammar's mask from now on: %s", seq_id, reason)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.tracked.pop(seq_id, None)

    def clear(self) -> None:
        self.tracked.clear()


class DraftWalk:
    """One drafting step's grammar masks. Call `masked(logits, previous)` before each draft step's argmax
    (`previous`: the last step's drafts [B] on the device, None at step 0), then `counts` and `close`."""

    def __init__(self, grammars: Grammars, rows: list[int], matchers: list[TokenMatcher], device: torch.device,
                 vocab_ids: torch.Tensor | None):
        self.grammars, self.rows, self.matchers = grammars, rows, matchers
        self.device, self.vocab_ids = device, vocab_ids
        self.live = list(range(len(rows)))      # indices (into rows) still drafting
        self.walked = [0] * len(rows)
        self.limit: dict[int, int] = {}          # row -> drafts it keeps, once it stopped
        self.step = 0
        self.bits: torch.Tensor | None = None    # [L, W] the last step's host bitmasks, a row per live index
        self.masked_live: list[int] = []         # the live indices those rows belong to

    def masked(self, logits: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """logits [B, V'] → the same with the constrained rows' disallowed ids at −inf."""
        if previous is not None:
            self._take(previous[self.rows].tolist())            # the host sync of this draft step
        self.step += 1
        if not self.live:
            self.masked_live = []
            return logits
        bits = masks_array(len(self.live), self.grammars.vocab_size)
        self.grammars.fill_masks([(self.matchers[i], n, []) for n, i in enumerate(self.live)], bits)
        self.bits, self.masked_live = bits, list(self.live)
        rows = torch.tensor([self.rows[i] for i in self.live], device=self.device)
        return mask_rows(logits, rows, bits.to(self.device), self.vocab_ids)

    def _take(self, tokens: list[int], walk: bool = True) -> None:
        """Check each live row's last draft (step - 1) against the mask it was drawn under: one the grammar refuses
        (nothing allowed in the drafter's vocabulary: the argmax of −inf) is dropped and the row stops; a stop
        token is kept and the row stops (not walked: llguidance takes it only as the end); any other is walked
        (with `walk`)."""
        still = []
        for n, i in enumerate(self.masked_live):
            token = tokens[i]
            allowed = bool((int(self.bits[n, token // 32]) >> (token % 32)) & 1)
            if not allowed or (walk and token not in self.grammars.stop_token_ids
                               and not self.matchers[i].walk(token)):
                self.limit[self.rows[i]] = self.step - 1
            elif token in self.grammars.stop_token_ids:
                self.limit[self.rows[i]] = self.step
            else:
                self.walked[i] += walk
                still.append(i)
        self.live = still

    def counts(self, wanted: list[int], last: list[int]) -> list[int]:
        """Each row's draft count (`wanted` per row of the batch) cut where its row stopped; `last`: each row's
        draft of the final step, checked against its mask as the others were."""
        if self.live:
            self._take([last[r] for r in self.rows], walk=False)
        return [min(k, self.limit.get(row, k)) for row, k in enumerate(wanted)]

    def close(self) -> None:
        """Roll each matcher back to the committed output."""
        for matcher, walked in zip(self.matchers, self.walked):
            matcher.unwalk(walked)
