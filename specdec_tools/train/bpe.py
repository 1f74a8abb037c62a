"""A byte-level BPE tokenizer trained on the corpus, and the token stream it turns the corpus into.

Deterministic: the same files and vocabulary size give a byte-identical `tokenizer.json` (the
`tokenizers` trainer breaks count ties by pair id, and the input order is the sorted file order).
`<|endoftext|>` is id 0 and serves as eos, pad and the separator between files.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import read_text

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte tokens + <|endoftext|>


def train_tokenizer(files: list[Path], vocab_size: int = 4096) -> Tokenizer:
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE (needs >= {MIN_VOCAB})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise RuntimeError(f"{EOS_TOKEN} did not get id 0")
    return tok


def save_tokenizer(tok: Tokenizer, out: str | Path, model_max_length: int = 4096) -> None:
    """tokenizer.json (for `tokenizers` alone) + tokenizer_config.json (for transformers.AutoTokenizer)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   model_max_length=model_max_length)
    fast.save_pretrained(str(out))
    if not (Path(out) / "tokenizer.json").is_file():
        raise RuntimeError(f"{out}: save_pretrained wrote no tokenizer.json")


def encode_files(tok: Tokenizer, files: list[Path]) -> tuple[torch.Tensor, int]:
    """One int64 stream: the files' tokens joined with <|endoftext|> between files; also the byte count."""
    texts = [read_text(f) for f in files]
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for i, enc in enumerate(tok.encode_batch(texts, add_special_tokens=False)):
        if i:
            ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long), sum(len(t.encode("utf-8")) for t in texts)
