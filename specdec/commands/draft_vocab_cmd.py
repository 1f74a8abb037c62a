"""`specdec draft-vocab`: build a reduced draft vocabulary (the most frequent target ids) for the MTP drafter."""
import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)
TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".html", ".js", ".ts", ".go", ".rs"}


def add_parser(sub) -> None:
    p = sub.add_parser("draft-vocab", help="build a reduced draft vocabulary for the mtp drafter",
                       description="Count target token ids over a text corpus like the traffic you serve "
                                   "(tokenized with the model's tokenizer), keep the SIZE most frequent, and "
                                   "write them for "
                                   "`specdec drafter --draft-vocab FILE`. Speculation stays lossless; only "
                                   "acceptance can drop, when the target's next token is outside the subset.")
    p.add_argument("--model", default=None, help="the target's folder (tokenizer and vocabulary size; default: "
                                                 "the embedded demo model)")
    p.add_argument("--corpus", action="append", required=True, metavar="PATH",
                   help="a text file or a folder of them (repeatable)")
    p.add_argument("--size", type=int, default=32768, help="ids to keep (capped at the vocabulary size)")
    p.add_argument("-o", "--output", required=True, help="the draft-vocab JSON file to write")
    p.set_defaults(run=run)


def corpus_files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"--corpus {p}: no such file or folder")
        files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES) if p.is_dir() else [p]
    return files


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from specdec.demo import demo_model_dir
    from specdec.drafting.draft_vocab import count_tokens, most_frequent, save_draft_vocab
    from specdec.models.model_config import ModelConfig
    model = args.model or demo_model_dir()
    vocab = ModelConfig.from_folder(model).vocab_size
    counts = np.zeros(vocab, np.int64)
    files = corpus_files(args.corpus)
    if not files:
        raise ValueError(f"--corpus {' '.join(args.corpus)}: no text files ({' '.join(sorted(TEXT_SUFFIXES))})")
    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    for f in tqdm(files, desc="counting tokens", unit="file"):
        text = f.read_text(encoding="utf-8", errors="replace")
        count_tokens(np.asarray(tokenizer.encode(text).ids, np.int64), vocab, counts)
    record = save_draft_vocab(args.output, most_frequent(counts, min(args.size, vocab)), counts)
    summary = {k: v for k, v in record.items() if k != "token_ids"} | {"size": len(record["token_ids"]),
                                                                        "files": len(files)}
    print(json.dumps(summary))
    return 0
