"""The synthetic Qwen-like tokenizer of bench/grammar_mask_bench.py: a real byte-level BPE (`tokenizers`) behind
Qwen2's pre-tokenizer regex (PRETOKEN), its vocabulary the 256 bytes, then pieces of the Python standard library's
sources as that regex cuts them and the words with other leading characters, drawn by a seeded frequency-weighted
draw (corpus_candidates), each merged from two earlier tokens as in a trained BPE (build_vocab); build_hf_tokenizer
wraps it as a transformers fast tokenizer with Qwen's special (SPECIAL) and added (ADDED) tokens, EOS `<|im_end|>`."""
from __future__ import annotations

import collections
import pathlib
import sysconfig

import numpy as np
import regex

# Qwen2/Qwen3 pre-tokenizer: letters with one leading non-letter, single digits, punctuation runs, newlines
PRETOKEN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]      # special=True in Qwen's tokenizer.json
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]  # special=False there (llguidance: special anyway)
EOS = "<|im_end|>"


def corpus_candidates(max_mb: float, seed: int, cross: bool) -> list[bytes]:
    """Pre-tokens of the stdlib sources (with `cross`, also neighbour concatenations) and words with other leading
    characters, in a seeded frequency-weighted order (Efraimidis-Spirakis keys u ** (1 / count))."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    pat, counts, budget = regex.compile(PRETOKEN), collections.Counter(), max_mb * 2 ** 20
    for i, path in enumerate(sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)):
        text = path.read_bytes()[:200_000].decode("utf-8", "ignore")
        budget -= len(text)
        if budget < 0:
            break
        pieces = pat.findall(text)
        counts.update(pieces)
        if cross and i % 3 == 0:
            counts.update(a + b for a, b in zip(pieces, pieces[1:]) if not (a.isspace() or b.isspace()))
    for w, c in list(counts.items()):
        if w.isalpha():
            for lead, share in ((" ", 2), (".", 8), ("_", 8), ("(", 16), ('"', 16), ("'", 16), ("-", 32), ("/", 32)):
                counts[lead + w] = max(counts[lead + w], c // share, 1)
    words = [w.encode() for w in counts]
    keys = np.log(np.random.default_rng(seed).random(len(words))) / np.fromiter(counts.values(), float, len(words))
    return [words[i] for i in np.argsort(-keys, kind="stable")]


def build_vocab(n_regular: int, max_mb: float, seed: int, cross: bool) -> tuple[list[bytes], list[tuple[int, int]]]:
    """256 bytes, then corpus pieces; each new token is a merge of two earlier ones (its longest known prefix and
    the rest, added first when missing), so the vocabulary and merge list form a consistent BPE."""
    tokens = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[int, int]] = []
    for stack in ([c] for c in corpus_candidates(max_mb, seed, cross) if 1 < len(c) <= 64):
        while stack and len(tokens) < n_regular:
            t = stack.pop()
            if t not in index:
                k = max(k for k in range(1, len(t)) if t[:k] in index)
                if t[k:] not in index:
                    stack += [t, t[k:]]
                    continue
                merges.append((index[t[:k]], index[t[k:]]))
                index[t] = len(tokens)
                tokens.append(t)
        if len(tokens) >= n_regular:
            break
    return tokens, merges


def build_hf_tokenizer(tokens: list[bytes], merges: list[tuple[int, int]], eos_id: int | None = None):
    """A transformers fast tokenizer over the synthetic BPE, set up like Qwen's tokenizer.json. `eos_id`: where EOS
    must sit (a checkpoint's eos_token_id): text tokens that no merge makes fill the ids before Qwen's specials."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    fill = 0 if eos_id is None else eos_id - len(tokens) - SPECIAL.index(EOS)
    if fill < 0:
        raise SystemExit(f"EOS cannot sit at {eos_id}: the vocabulary has {len(tokens)} tokens before the specials")
    tokens = tokens + [b"<unused_%d>" % i for i in range(fill)]     # plain text pieces no merge makes
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]   # GPT-2's byte -> printable character map
    b2u = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(sorted(set(range(256)) - set(keep)))}
    names = ["".join(b2u[b] for b in t) for t in tokens]
    bpe = models.BPE(vocab={n: i for i, n in enumerate(names)}, merges=[(names[a], names[b]) for a, b in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKEN), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in ADDED])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<|endoftext|>")
