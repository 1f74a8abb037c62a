"""What `specdec bench` runs: one Workload per (path, drafter, concurrency, prompt length, temperature), and the
token ids it sends (prompts, conversations, their salted rotations); presets.py holds the named matrices.

Paths: `inproc` (SpecEngine in this process, drafter in-process), `gateway` (the three services as processes,
N concurrent gRPC streams through the gateway), `colocated` (the same through the gateway, with the drafter inside
the verifier's process: `specdec verifier --in-process-drafter`; gateway / colocated is what the service split
costs), `peer` (transformers `generate` on the same checkpoint).
Conversations (gateway and colocated paths, turns > 0): `concurrency` conversations at once, each `turns` requests in
order, the next sent once the last has finished; turn t's prompt is the conversation so far, token by token (a
system prompt of `prompt_tokens` ids, shared by every conversation or each conversation's own, then each earlier
turn's user tokens and the tokens the model gave back, then this turn's `turn_tokens` new user tokens): what a
prefix cache serves.
Drafters: none, ngram, mtp (its own acceptance; or forced to a mean acceptance length: mtp@3.39, what a random
checkpoint's benchmarks use), and on the inproc path the synthetic
drafter at a per-token acceptance rate (syn@0.9: k random drafts a step, nearly free to make, their acceptance
forced at 0.9 per token: the mean length (1 - 0.9^(k+1)) / (1 - 0.9)). Each drafter runs with the fixed draft
policy (k every step) or the adaptive one (label +adaptive: draft_policy.py's k per step, its step costs measured
first).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PATHS = ("inproc", "gateway", "colocated", "peer")
STACK_PATHS = ("gateway", "colocated")   # a stack of processes, measured through the gateway
FORCED_LENGTHS = (1.5, 2.5, 3.39)   # mean acceptance lengths forced on the real MTP drafter (k = 3)
K = 3


@dataclass(frozen=True)
class Workload:
    path: str                       # inproc | gateway | colocated | peer
    drafter: str                    # none | ngram | mtp
    concurrency: int
    prompt_tokens: int
    max_tokens: int
    temperature: float = 0.0
    forced_length: float | None = None  # mtp only: forced mean acceptance length (benchmarks only)
    k: int = K
    draft_vocab: str | None = None      # mtp only: a `specdec draft-vocab` file (drafts over those ids only)
    accept_rate: float | None = None    # synthetic only: per-token acceptance
    draft_policy: str = "fixed"         # fixed | adaptive
    long_prompt: int = 0                # interference: the last request has this many prompt tokens and is sent
    #                                     once the others decode (gateway / colocated paths)
    turns: int = 0                      # > 0: `concurrency` conversations of this many turns (prompt_tokens: the
    #                                     system prompt), gateway / colocated paths
    turn_tokens: int = 0                # conversations: new user tokens in each turn
    shared_system: bool = True          # conversations: one system prompt for all (False: each its own, so that
    #                                     turn 1 is a cold prefill)
    prefix_cache: bool = True           # False: the verifier's --no-prefix-caching (label +nocache)

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, not {self.path!r}")
        if self.drafter not in ("none", "ngram", "mtp", "synthetic"):
            raise ValueError(f"drafter must be none | ngram | mtp | synthetic, not {self.drafter!r}")
        if (self.drafter == "synthetic") != (self.accept_rate is not None) or (
                self.drafter == "synthetic" and self.path != "inproc"):
            raise ValueError("the synthetic drafter runs on the inproc path, with an acceptance rate (and only it)")
        if self.draft_policy not in ("fixed", "adaptive") or (self.draft_policy == "adaptive"
                                                               and self.drafter == "none"):
            raise ValueError(f"draft_policy must be fixed, or adaptive with a drafter: {self}")
        if self.path == "peer" and self.drafter != "none":
            raise ValueError("the peer (transformers generate) runs without a drafter")
        if self.path == "colocated" and self.drafter == "none":
            raise ValueError("the colocated path is the gateway path's control for a drafter: it needs one")
        if self.draft_vocab and self.drafter != "mtp":
            raise ValueError("a draft vocabulary goes with the mtp drafter")
        if min(self.concurrency, self.prompt_tokens, self.max_tokens) < 1:
            raise ValueError(f"concurrency, prompt_tokens and max_tokens must be >= 1: {self}")
        if self.long_prompt and (not self.on_stack or self.concurrency < 2 or self.long_prompt < 0):
            raise ValueError(f"a long prompt joins other requests through the gateway (concurrency >= 2): {self}")
        if (self.turns or self.turn_tokens) and (not self.on_stack or self.turns < 1 or self.turn_tokens < 1
                                                 or self.long_prompt):
            raise ValueError(f"conversations run through the gateway, with turns >= 1 and turn_tokens >= 1 (and no "
                             f"long prompt): {self}")
        if not self.shared_system and not self.turns:
            raise ValueError(f"system prompts of their own are a conversation workload's: {self}")
        if not self.prefix_cache and not self.on_stack:
            raise ValueError(f"the prefix cache is the verifier service's: +nocache runs through the gateway: {self}")

    @property
    def prompt_lengths(self) -> list[int]:
        """Each request's prompt tokens (the interfering long one last); conversations: each conversation's longest,
        its last turn's (what the stack is sized for)."""
        if self.turns:
            return [self.turn_prompt_tokens(self.turns)] * self.concurrency
        if not self.long_prompt:
            return [self.prompt_tokens] * self.concurrency
        return [self.prompt_tokens] * (self.concurrency - 1) + [self.long_prompt]

    def turn_prompt_tokens(self, turn: int) -> int:
        """A conversation's prompt tokens at turn `turn` (1-based): the system prompt, `turn` user messages and the
        `turn` - 1 answers before it (each exactly max_tokens: ignore_eos)."""
        return self.prompt_tokens + turn * self.turn_tokens + (turn - 1) * self.max_tokens

    @property
    def requests(self) -> int:
        """Requests in one pass: one per stream, or one per turn of each conversation."""
        return self.concurrency * (self.turns or 1)

    @property
    def mean_context(self) -> float:
        """Mean cached tokens of a decoding sequence (prompt + half the output), over the requests."""
        if not self.turns:
            return self.prompt_tokens + self.max_tokens / 2
        return sum(self.turn_prompt_tokens(t) for t in range(1, self.turns + 1)) / self.turns + self.max_tokens / 2

    @property
    def num_drafts(self) -> int:
        return self.k if self.drafter != "none" else 0

    @property
    def drafter_label(self) -> str:
        """none | ngram | mtp | mtp@3.39 (forced acceptance length) | syn@0.9 (synthetic, per-token acceptance); +dv:
        with the reduced draft vocabulary; +nocache: the verifier's prefix cache off; +adaptive: the adaptive draft
        policy."""
        label = f"mtp@{self.forced_length:g}" if self.forced_length else self.drafter
        label = f"syn@{self.accept_rate:g}" if self.accept_rate is not None else label
        label += "+dv" if self.draft_vocab else ""
        label += "" if self.prefix_cache else "+nocache"
        return label + "+adaptive" if self.draft_policy == "adaptive" else label

    @property
    def on_stack(self) -> bool:
        """Measured through the gateway of a running stack of processes."""
        return self.path in STACK_PATHS

    @property
    def plain_path(self) -> str:
        """The path whose drafter-less rows are this one's plain decoding (colocated: the gateway's)."""
        return "gateway" if self.path == "colocated" else self.path

    @property
    def stack_key(self) -> tuple:
        """Workloads with the same key share one running stack (gateway and colocated paths)."""
        return (self.path, self.drafter, self.forced_length, self.num_drafts, self.draft_vocab, self.draft_policy,
                self.prefix_cache)

    @property
    def name(self) -> str:
        return (f"{self.path}/{self.drafter_label}/c{self.concurrency}/p{self.prompt_tokens}"
                f"/o{self.max_tokens}/T{self.temperature:g}" + (f"/L{self.long_prompt}" if self.long_prompt else "")
                + (f"/turns{self.turns}x{self.turn_tokens}" if self.turns else "")
                + ("/own-system" if not self.shared_system else ""))

    def to_json(self) -> dict:
        return {"path": self.path, "drafter": self.drafter, "drafter_label": self.drafter_label,
                "forced_acceptance_length": self.forced_length, "k": self.num_drafts,
                "draft_vocab": self.draft_vocab, "accept_rate": self.accept_rate, "draft_policy": self.draft_policy,
                "concurrency": self.concurrency, "prompt_tokens": self.prompt_tokens,
                "max_tokens": self.max_tokens, "temperature": self.temperature, "long_prompt": self.long_prompt,
                "turns": self.turns, "turn_tokens": self.turn_tokens, "shared_system": self.shared_system,
                "prefix_cache": self.prefix_cache, "requests": self.requests}


def salted(prompts, salt: int):
    """The same prompts rotated by `salt` tokens (0: themselves): other token sequences of the same lengths and ids,
    so that a pass sent after another (the warm-up, earlier timed passes) finds nothing of it in the verifier's
    prefix cache. Conversations: their system prompt and user turns rotated alike."""
    if isinstance(prompts, Conversations):
        return prompts.salted(salt)
    return [_rotate(p, salt) for p in prompts]


def _rotate(tokens: list[int], salt: int) -> list[int]:
    k = salt % len(tokens) if tokens else 0
    return list(tokens[k:]) + list(tokens[:k])


@dataclass(frozen=True)
class Conversations:
    """The token ids a conversation workload sends, apart from the model's answers: each conversation's system
    prompt (`system[c]`: the same for all, or each its own) and its user tokens of each turn (`user[c][t]`)."""
    system: tuple[tuple[int, ...], ...]
    user: tuple[tuple[tuple[int, ...], ...], ...]

    def prompt(self, c: int, turn: int, history: list[int]) -> list[int]:
        """Conversation c's prompt at `turn` (0-based): the conversation so far (turn 0: its system prompt; later:
        the last turn's prompt followed by its output), then this turn's user tokens."""
        return (list(self.system[c]) if turn == 0 else list(history)) + list(self.user[c][turn])

    def salted(self, salt: int) -> "Conversations":
        return Conversations(tuple(tuple(_rotate(s, salt)) for s in self.system),
                             tuple(tuple(tuple(_rotate(u, salt)) for u in conv) for conv in self.user))


def conversations_for(w: Workload, vocab_size: int, seed: int = 0) -> Conversations:
    """w's conversations: a system prompt of w.prompt_tokens random ids in [1, vocab) (one for all, or one per
    conversation: w.shared_system) and w.turn_tokens random ids per conversation and turn, the same for every path
    and drafter (conversation c's the same at any concurrency)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7_777 + w.prompt_tokens)
    shared = torch.randint(1, vocab_size, (w.prompt_tokens,), generator=g).tolist()
    g = torch.Generator().manual_seed(seed * 1_000_003 + 9_999 + w.prompt_tokens)
    own = [shared] + torch.randint(1, vocab_size, (w.concurrency - 1, w.prompt_tokens), generator=g).tolist()
    system = [tuple(shared)] * w.concurrency if w.shared_system else [tuple(s) for s in own]
    g = torch.Generator().manual_seed(seed * 1_000_003 + 8_888 + w.turn_tokens)
    user = torch.randint(1, vocab_size, (w.concurrency, w.turns, w.turn_tokens), generator=g).tolist()
    return Conversations(tuple(system), tuple(tuple(tuple(t) for t in conv) for conv in user))


def prompts_for(w: Workload, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """w.concurrency prompts of w.prompt_tokens random ids in [1, vocab), the same for every path; the last of
    w.long_prompt ids when it has one."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + w.prompt_tokens)
    prompts = torch.randint(1, vocab_size, (w.concurrency, w.prompt_tokens), generator=g).tolist()
    if w.long_prompt:
        g = torch.Generator().manual_seed(seed * 1_000_003 + w.long_prompt)
        prompts[-1] = torch.randint(1, vocab_size, (w.long_prompt,), generator=g).tolist()
    return prompts
