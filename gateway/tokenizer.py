"""Text <-> token ids for the gateway, from a model folder's tokenizer files, with `tokenizers` only.

The gateway never imports torch or transformers (``import transformers`` pulls torch). This module
reproduces what ``transformers.AutoTokenizer.from_pretrained(dir)`` (the ``TokenizersBackend`` path,
transformers 5) does to a ``tokenizer.json`` at load time, so that ``encode`` / ``decode`` give the
same ids / text as AutoTokenizer's ``encode(text)`` / ``decode(ids, skip_special_tokens=...)``:

* truncation and padding baked into ``tokenizer.json`` are switched off (``encode`` never truncates);
* the named special tokens of ``tokenizer_config.json`` (bos/eos/unk/sep/pad/cls/mask, plus
  ``extra_special_tokens`` / ``additional_special_tokens``) are registered as special added tokens,
  so that ``decode(skip_special_tokens=True)`` drops them and ``encode`` never splits them;
* BOS/EOS insertion is whatever ``tokenizer.json``'s post-processor says (e.g. a ``<s> $A`` template):
  transformers 5 drops ``add_bos_token`` / ``add_eos_token`` from the config whenever a
  ``tokenizer.json`` exists, so they are ignored here too;
* ``split_special_tokens`` from the config is honoured.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_content(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, an AddedToken dict, or null."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _extra_special(config: dict) -> list[str]:
    out: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for item in items:
            content = _token_content(item)
            if content is not None and content not in out:
                out.append(content)
    return out


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` set up like transformers' AutoTokenizer for the same folder."""

    def __init__(self, tokenizer: Tokenizer, config: dict | None = None, fallback_eos_id: int | None = None):
        config = dict(config or {})
        self._tok = tokenizer
        self._fallback_eos_id = fallback_eos_id
        self._tok.no_truncation()
        self._tok.no_padding()
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        # the named ones, as transformers' `special_tokens_map` (what chat templates see as bos_token, eos_token ...)
        self.special_tokens_map = {k: c for k in _NAMED_SPECIAL if (c := _token_content(config.get(k))) is not None}
        special = list(self.special_tokens_map.values())
        special += [c for c in _extra_special(config) if c not in special]
        known = self._tok.get_added_tokens_decoder()
        to_add = []
        for content in special:  # register as special unless already a special added token
            tid = self._tok.token_to_id(content)
            if tid is None or not (tid in known and known[tid].special):
                to_add.append(AddedToken(content, special=True, normalized=False))
        if to_add:
            self._tok.add_special_tokens(to_add)
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        clean = config.get("clean_up_tokenization_spaces", False)
        # transformers skips the (WordPiece-era) clean-up for BPE models, where it would corrupt text
        self._clean_up = bool(clean) and type(self._tok.model).__name__ != "BPE"

    @classmethod
    def from_folder(cls, model_dir: str | Path) -> "TextTokenizer | None":
        """Load from ``model_dir``; None when it has no ``tokenizer.json``. ValueError names a bad file."""
        model_dir = Path(model_dir)
        tok_path = model_dir / TOKENIZER_FILE
        if not tok_path.is_file():
            return None
        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON / schema
            raise ValueError(f"{tok_path}: not a valid tokenizer file ({e})") from e
        config: dict = {}
        cfg_path = model_dir / CONFIG_FILE
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
            if not isinstance(config, dict):
                raise ValueError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
        return cls(tokenizer, config, _model_eos_id(model_dir))

    # ---- ids -----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows: base vocabulary plus added tokens (``len(AutoTokenizer)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The config's ``eos_token``; without one, config.json's ``eos_token_id`` (first if a list)."""
        if self.eos_token is not None:
            return self.token_to_id(self.eos_token)
        return self._fallback_eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token) if self.bos_token is not None else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """A special added token: dropped by ``decode(skip_special_tokens=True)``."""
        return token_id in self.special_ids

    # ---- text ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids the tokenizer does not know (e.g. a model vocabulary padded past it) decode to nothing."""
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text


def _model_eos_id(model_dir: Path) -> int | None:
    try:
        value = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    value = value[0] if isinstance(value, list) and value else value
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (only for non-BPE models whose config asks for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
