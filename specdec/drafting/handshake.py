"""Does a drafter fit a target? The rule the verifier applies at the handshake, on facts each side reports
about ITSELF (never an echo of the other side's), and the vocabulary fingerprint both sides compute.

A refused drafter is not used: the verifier logs why, decodes without drafts and keeps retrying the address,
so a fitting drafter started there later is picked up without a restart.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .interface import DrafterInfo, ModelFacts


def refusal_reason(target: ModelFacts, drafter: DrafterInfo) -> str:
    """Why `drafter` cannot draft for `target` ("" when it fits)."""
    d, name = drafter.facts, f"drafter {drafter.kind!r}"
    if drafter.max_drafts < 1:
        return f"{name} proposes no drafts (max_drafts {drafter.max_drafts})"
    if d.vocab_size > target.vocab_size:
        return (f"{name} has a vocabulary of {d.vocab_size} ids, larger than the target's {target.vocab_size}: "
                "it could propose ids the target cannot score")
    if d.vocab_fingerprint and target.vocab_fingerprint and d.vocab_fingerprint != target.vocab_fingerprint:
        return (f"{name} uses another tokenizer vocabulary (fingerprint {d.vocab_fingerprint}, the target's is "
                f"{target.vocab_fingerprint}): its token ids would mean other tokens")
    if drafter.needs_hidden:
        if d.hidden_size != target.hidden_size:
            return (f"{name} reads hidden states of size {d.hidden_size}, the target's are "
                    f"{target.hidden_size}: it belongs to another model")
        if d.model_type != target.model_type:
            return f"{name} was built for model_type {d.model_type!r}, the target is {target.model_type!r}"
        if d.vocab_size != target.vocab_size:
            return (f"{name} drafts over {d.vocab_size} ids from the target's hidden states, the target has "
                    f"{target.vocab_size}: it belongs to another model")
    if drafter.needs_shared_weights and d.dtype != target.dtype:
        return (f"{name} computes in {d.dtype} but would map the target's {target.dtype} embedding and lm_head: "
                f"start it with --dtype {target.dtype}")
    return ""


def vocabulary_fingerprint(model_dir: str | Path | None) -> str:
    """A short hash of the tokenizer's token -> id table (tokenizer.json: model.vocab + added_tokens), or ""
    when the folder has no tokenizer.json. Equal fingerprints: the same ids mean the same tokens."""
    path = Path(model_dir) / "tokenizer.json" if model_dir else None
    if path is None or not path.is_file():
        return ""
    spec = json.loads(path.read_text(encoding="utf-8"))
    vocab = spec.get("model", {}).get("vocab", {})
    pairs = dict(vocab) if isinstance(vocab, dict) else {t: i for i, (t, *_rest) in enumerate(vocab)}
    pairs.update({a["content"]: a["id"] for a in spec.get("added_tokens", [])})
    table = json.dumps(sorted((i, t) for t, i in pairs.items()), ensure_ascii=False)
    return hashlib.sha256(table.encode("utf-8")).hexdigest()[:16]
