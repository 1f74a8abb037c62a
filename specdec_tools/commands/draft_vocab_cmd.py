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
                                   "(tokenized with the model's tokenizer) and/or take the counts a drafter "
                                   "gathered over served traffic (`specdec drafter --count-tokens FILE`), keep the "
                                   "SIZE most frequent, and write them for `specdec drafter --draft-vocab FILE`. "
                                   "Speculation stays lossless; only acceptance can drop, when the target's next "
                                   "token is outside the subset.")
    p.add_argument("--model", default=None, help="the target's folder (tokenizer and vocabulary size; default: "
                                                 "the embedded demo model)")
    p.add_argument("--corpus", action="append", default=[], metavar="PATH",
                   help="a text file or a folder of them (repeatable)")
    p.add_argument("--counts", action="append", default=[], metavar="FILE",
                   help="a token-counts file written by `specdec drafter --count-tokens` for this model "
                        "(repeatable; added to the corpus counts)")
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


def count_corpus(files: list[Path], model: str, counts) -> None:
    """Add the token ids of `files` (the model's tokenizer) to `counts`."""
    import numpy as np
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from specdec.drafting.draft_vocab import count_tokens
    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    for f in tqdm(files, desc="counting tokens", unit="file"):
        text = f.read_text(encoding="utf-8", errors="replace")
        count_tokens(np.asarray(tokenizer.encode(text).ids, np.int64), counts.shape[0], counts)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from specdec.demo import demo_model_dir
    from specdec.drafting.draft_vocab import most_frequent, save_draft_vocab
    from specdec.drafting.token_counts import load_token_counts
    from specdec.models.model_config import ModelConfig
    if not args.corpus and not args.counts:
        raise ValueError("nothing to count: give --corpus PATH (text) and/or --counts FILE (from "
                         "`specdec drafter --count-tokens`)")
    model = args.model or demo_model_dir()
    vocab = ModelConfig.from_folder(model).vocab_size
    counts = np.zeros(vocab, np.int64)
    files = corpus_files(args.corpus)
    if args.corpus and not files:
        raise ValueError(f"--corpus {' '.join(args.corpus)}: no text files ({' '.join(sorted(TEXT_SUFFIXES))})")
    if files:
        count_corpus(files, model, counts)
    corpus_tokens = int(counts.sum())
    for path in args.counts:
        counts += load_token_counts(path, vocab)
    record = save_draft_vocab(args.output, most_frequent(counts, min(args.size, vocab)), counts)
    summary = {k: v for k, v in record.items() if k != "token_ids"} | {
        "size": len(record["token_ids"]), "files": len(files), "corpus_tokens": corpus_tokens,
        "counts_files": len(args.counts), "served_tokens": record["tokens_counted"] - corpus_tokens}
    print(json.dumps(summary))
    return 0
