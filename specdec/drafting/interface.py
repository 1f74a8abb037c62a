"""The drafter interface: what the verifier tells a drafter each engine step, and what a drafter answers.

Both services import these types (the verifier's engine and drafter client, the drafter service and every
drafter, built-in or plugin); neither service imports the other.

What a drafter may assume
-------------------------
- One `propose` call per engine step, for the whole batch, never concurrently with another call. A drafter
  that can answer later (`AnswersLater`: the remote drafter link) is asked at the end of a step and its
  answer is read at the start of the next, so the verifier streams that step's tokens in the meantime.
- Per sequence (`DraftInput`) the verifier sends the tokens committed since the previous call:
      token_ids = committed tokens at positions start_pos .. start_pos + n   (n + 1 tokens)
  Consecutive calls for one sequence overlap by one token: the last token of a call (the newest committed
  one, which the target has not run yet) is the first token of the next. A new sequence starts at
  start_pos = 0. A sequence the verifier recomputes (preemption) starts again at start_pos = 0: the drafter
  must then forget what it held for it. `num_drafts` = 0 means "ingest only" (prompt chunks).
- With `needs_hidden`, `DraftBatch.hidden` holds the target's hidden states (after its final norm) for the
  positions start_pos .. start_pos + n - 1 of every sequence, rows in `seqs` order ([Σ n_i, hidden]); pair i
  of a sequence is (token at start_pos + i + 1, hidden at start_pos + i): the MTP input convention. The
  tensor may be a view of a buffer the verifier's next step overwrites: use or copy it within the call.
- A sequence whose output is grammar-constrained carries `DraftInput.grammar` on its calls from start_pos = 0:
  the grammar and the position where its output starts. A drafter may keep its proposals inside the grammar
  (drafting/draft_masks.py); one that ignores it loses only the drafts the verifier's mask rejects.
- `release(seq_ids)` when sequences end (or are preempted); `clear()` when the verifier (re)connects.
- Prefix caching (`PrefixBlocks` in `DraftBatch.prefixes` / `DeviceDraftStep.prefixes`, by sequence): a
  sequence the verifier resumed from its prefix cache first arrives at start_pos = resumed * block_size - 1 (the
  tokens before it are those its hashes name). A drafter that takes hidden states either keeps its own state for
  those hashes (the MTP drafter: its KV blocks) or reports the sequence missing, and the verifier then recomputes
  it from position 0 without the cache; a drafter of tokens alone gets it from position 0, all tokens. A
  `checkpoint` says where a prompt chunk ends at a state the verifier keeps: the drafter may keep its own there.

What a drafter must guarantee
-----------------------------
- `DraftOutput.drafts` has one list per `DraftInput`, in order, each with at most `num_drafts` ids, each id in
  [0, target vocabulary). Anything else is a drafter failure: the verifier drops ALL drafts of that step
  (it decodes with k = 0), logs it, and carries on. Output is never wrong because of a drafter: the target
  verifies every token, so a bad drafter only costs speed.
- `probs`, when given, are the drafter's distributions q for every proposed token ([Σ len(drafts_i), V] rows,
  in order): acceptance then uses min(1, p/q), so q(d) must be > 0 for each proposed d. Without probs the
  proposals are treated as argmax (one-hot q), which is exact for greedy drafters.
- `facts` describe the drafter's own model (zeros for model-free drafters); the verifier refuses, at the
  handshake, a drafter whose facts do not fit its target (see handshake.refusal_reason).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, runtime_checkable

import torch

from specdec.sampling_params import GrammarSpec


@dataclass(frozen=True)
class OutputGrammar:
    """The grammar a sequence's output (its tokens at positions >= output_start) follows."""
    spec: GrammarSpec
    output_start: int


@dataclass
class DraftInput:
    seq_id: int
    start_pos: int
    token_ids: list[int]          # committed tokens at positions start_pos .. start_pos + n
    num_drafts: int               # proposals wanted (0: ingest only)
    grammar: OutputGrammar | None = None  # with start_pos = 0 for a constrained sequence; None otherwise


@dataclass(frozen=True)
class PrefixBlocks:
    """The verifier's prefix cache and one sequence of a step (specdec/prefix_cache.py): the chain hashes of its
    first blocks of `block_size` tokens, the checkpoint it resumed from (this is its first call) and / or the
    checkpoint its chunk ends at, each a count of blocks m naming position m * block_size - 1."""
    seq_id: int
    hashes: list[int]             # h_0 .. h_{max(resumed, checkpoint) - 1}
    block_size: int
    resumed: int = 0              # > 0: it starts at the checkpoint of this many blocks (positions before it are
                                  # what it would have computed; the last block's last position is its own)
    checkpoint: int = 0           # > 0: after this call its positions < checkpoint * block_size - 1 are final


@dataclass
class DraftBatch:
    step: int                     # strictly increasing per connection
    seqs: list[DraftInput]
    hidden: torch.Tensor | None = None  # [Σ n_i, H] rows in seqs order; None when the drafter needs none
    prefixes: list[PrefixBlocks] = field(default_factory=list)   # prefix caching, for some of seqs


@dataclass
class DraftOutput:
    drafts: list[list[int]]                               # per sequence, at most num_drafts tokens
    probs: torch.Tensor | None = field(default=None)      # [Σ len(drafts_i), V] or None: argmax (one-hot q)
    failure: str = ""                                     # non-empty: this step failed (no drafts), and why
    missing: list[int] = field(default_factory=list)      # seq ids whose earlier context the drafter lacks:
    #                                                       the verifier re-sends it (or recomputes it)
    compute_seconds: float | None = None                  # time spent drafting, as the drafter measured it
    #                                                       (a remote drafter reports it; in-process: None)

    @staticmethod
    def failed(num_seqs: int, reason: str) -> "DraftOutput":
        return DraftOutput(drafts=[[] for _ in range(num_seqs)], failure=reason)


@dataclass(frozen=True)
class ModelFacts:
    """One side's own model, as exchanged at the handshake. Zero / empty fields mean "no model" or "unknown"."""
    hidden_size: int = 0
    vocab_size: int = 0
    dtype: str = ""               # "float32" | "bfloat16" | "float16"
    model_type: str = ""          # config.json model_type, e.g. "qwen3_5_text"
    vocab_fingerprint: str = ""   # hash of the tokenizer's vocabulary (handshake.vocabulary_fingerprint)


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter tells the verifier about itself at the handshake (plain form of DrafterInfoResponse)."""
    kind: str
    max_drafts: int
    needs_hidden: bool
    facts: ModelFacts = ModelFacts()
    needs_shared_weights: bool = False  # maps the target's embed_tokens / lm_head (MTP on a GPU)


class Drafter(Protocol):
    """A drafter, in process. The drafter service serves one over gRPC; the verifier's engine talks to a
    `RemoteDrafter` (or, in tests and benchmarks, to an in-process drafter) through the same methods."""
    kind: str                     # the name users pick it by (`specdec drafter --kind NAME`)
    needs_hidden: bool            # wants the target's hidden states (DraftBatch.hidden)
    max_drafts: int               # most proposals per sequence per step (k); 0 = cannot draft right now
    facts: ModelFacts             # its own model, for the handshake; ModelFacts() when it has none

    def propose(self, batch: DraftBatch) -> DraftOutput: ...

    def release(self, seq_ids: list[int]) -> None: ...

    def clear(self) -> None: ...


@runtime_checkable
class AnswersLater(Protocol):
    """A drafter whose answer can be read later than it is asked for (the remote drafter link: the request is
    sent at once, the reply read when the caller needs it). `propose(batch)` equals `propose_later(batch)()`;
    the caller reads each answer once, in order, before asking again."""

    def propose_later(self, batch: DraftBatch) -> Callable[[], DraftOutput]: ...


@dataclass(frozen=True)
class DrafterOptions:
    """What `specdec drafter` hands a plugin's factory: `factory(options) -> Drafter`."""
    max_drafts: int = 3           # -k
    device: str = "cpu"           # --device
    dtype: str = "float32"        # --dtype
    model_dir: str | None = None  # --model: the target's checkpoint folder, if given
    options: Mapping[str, str] = field(default_factory=dict)  # --option KEY=VALUE, plugin-specific

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.options.get(key, default)
