"""The checkpoint's README.md model card and training_log.json, both rendered from one log dict.

The log dict (built by train_demo) has the sections corpus, tokenizer, model, training, results, export,
history and evals; the card shows the same numbers that training_log.json stores.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .export import check_folder_size, folder_files


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _loss(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.4f} (ppl {math.exp(min(x, 50)):.2f})"


def _rows(pairs: list[tuple[str, object]]) -> list[str]:
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in pairs]


def render(log: dict) -> str:
    c, m, t, r, e = log["corpus"], log["model"], log["training"], log["results"], log["export"]
    shape = m["shape"]
    lines = [
        "# specdec demo model: Qwen3.5 (text) + MTP head, trained on the Python standard library",
        "",
        "A small hybrid Gated-DeltaNet / gated-attention model in the exact Hugging Face **Qwen3.5 text** layout",
        "(`Qwen3_5ForCausalLM`, `model_type: qwen3_5_text`) with one **multi-token-prediction (MTP)** layer",
        "(`mtp.*` tensors), trained from scratch by `python -m specdec_tools.train.train_demo`. It exists to exercise",
        "speculative decoding (MTP and n-gram drafters) on real, non-random weights; it is a toy, not a code model.",
        "",
        "## Results", "",
        *_rows([("final train loss (trunk, mean of last steps" + (", with dropout)" if t.get("dropout") else ")"),
                 _loss(r["final_train_loss"])),
                ("final train loss (MTP, token t+2)", _loss(r["final_train_mtp_loss"])),
                ("**held-out loss (trunk, next token)**", _loss(r["held_out_loss"])),
                ("**held-out loss (MTP, token t+2)**", _loss(r["held_out_mtp_loss"])),
                ("held-out windows evaluated", f"{r['held_out_windows']} x {r['window_tokens']} tokens")]),
        "", "Losses are mean cross-entropy in nats per token.", "",
        "## Corpus", "",
        *_rows([("source", f"CPython {c['python_version']} standard library `*.py` (`{c['stdlib_root']}`)"),
                ("excluded", "folders test/tests/idle_test/site-packages/__pycache__, files > 200 KB"),
                ("training files", f"{c['train_files']} ({_mb(c['train_bytes'])}, {c['train_tokens']:,} tokens)"),
                ("held-out files", f"{c['held_out_files']} ({_mb(c['held_out_bytes'])}, "
                                   f"{c['held_out_tokens']:,} tokens)"),
                ("tokenizer", f"byte-level BPE, vocab {log['tokenizer']['vocab_size']}, trained on "
                              f"{log['tokenizer']['trained_on_files']} training files; `<|endoftext|>` = 0")]),
        "", "Held-out files (never trained on): " + ", ".join(f"`{n}`" for n in c["held_out_names"]) + ".", "",
        "## Model", "",
        *_rows([("parameters", f"{m['parameters']:,} (trunk {m['trunk_parameters']:,}, MTP {m['mtp_parameters']:,}; "
                               "tied embedding counted once)"),
                ("layers", f"{shape['layers']}: " + ", ".join(m["layer_types"])),
                ("hidden / intermediate", f"{shape['hidden']} / {shape['intermediate']}"),
                ("attention", f"{shape['heads']} heads, {shape['kv_heads']} kv heads, head dim {shape['head_dim']}, "
                              "output gate, rope theta 10000, partial rotary 0.25"),
                ("gated deltanet", f"{shape['gdn_key_heads']} key heads, {shape['gdn_value_heads']} value heads, "
                                   f"head dim {shape['gdn_head_dim']}, conv kernel 4"),
                ("MTP", "fc(cat[norm(embed(t+1)), norm(h_t)]) -> 1 full-attention layer -> norm -> shared lm_head"),
                ("vocab / tied embeddings", f"{shape['vocab_size']} / yes")]),
        "", "## Training", "",
        *_rows([("device", f"{t['device']} ({t['device_name']}), autocast {t['autocast_dtype']}, fp32 master weights"),
                ("steps", f"{t['steps_done']} of {t['steps']} planned" + (" (stopped by the time budget)"
                                                                          if t["stopped_early"] else "")),
                ("batch", f"{t['batch_size']} windows x {t['seq_len']} tokens; "
                          f"{t['tokens_seen']:,} tokens seen"),
                ("optimizer", f"AdamW lr {t['lr']} (warm-up {t['warmup_steps']} steps, cosine to "
                              f"{t['min_lr_ratio']}x), betas {tuple(t['betas'])}, weight decay {t['weight_decay']}, "
                              f"grad clip {t['grad_clip']}"),
                ("loss", f"next-token CE + {t['mtp_weight']} x MTP CE"),
                ("dropout (training only)", f"{t.get('dropout', 0.0)} on embedding, mixer and MLP outputs"),
                ("training time", f"{t['train_seconds']:.0f} s ({t['train_seconds'] / 60:.1f} min)"),
                ("seed / versions", f"{t['seed']} / torch {t['torch_version']}, "
                                    f"transformers {t['transformers_version']}")]),
        "", "## Files", "",
        *_rows([(name, _mb(size)) for name, size in e["files"].items()]
               + [("**total**", f"{_mb(e['folder_bytes'])} (limit {_mb(e['limit_bytes'])})"),
                  ("weights", f"{e['dtype']}, {e['tensors']} tensors ({e['mtp_tensors']} `mtp.*`)")]),
        "", "## Use", "",
        "```python",
        "from transformers import AutoTokenizer, Qwen3_5ForCausalLM   # ignores the mtp.* tensors",
        "model = Qwen3_5ForCausalLM.from_pretrained(folder)",
        "tok = AutoTokenizer.from_pretrained(folder)",
        "from specdec.models.loader import load_model                # trunk + mtp_weights for the MTP drafter",
        "loaded = load_model(folder)",
        "```", "",
        "Training data: the Python standard library, (c) Python Software Foundation, PSF License.", "",
    ]
    return "\n".join(lines)


def write_card_and_log(out: Path, log: dict, limit: int) -> int:
    """Write README.md and training_log.json, fill log["export"] with the final file sizes; returns the
    folder's total bytes (raises when over `limit`). Rendered twice so the card states its own size."""
    for _ in range(2):
        files = folder_files(out)
        log["export"].update(files=files, folder_bytes=sum(files.values()), limit_bytes=limit)
        (out / "README.md").write_text(render(log))
        (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    return check_folder_size(out, limit)
