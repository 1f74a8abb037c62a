"""A model folder's chat template: messages → prompt text, rendered as transformers' ``apply_chat_template`` does.

The template comes from ``chat_template.jinja`` or, failing that, the ``chat_template`` of
``tokenizer_config.json`` (a string, or a list of ``{name, template}`` of which "default" is used). It is
untrusted code (a checkpoint from anywhere), so it runs in Jinja2's ``ImmutableSandboxedEnvironment`` with the
same options and helpers transformers gives it: ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that does not escape HTML, ``raise_exception``, ``strftime_now``, and a ``dict``
and ``namespace`` that cannot reach Python internals. The template sees ``messages``,
``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) and any
``chat_template_kwargs`` (e.g. ``enable_thinking``); messages are plain JSON data, keys whose value is None
dropped. The rendered text is then tokenized without added special tokens (the template wrote them).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
RESERVED = ("messages", "add_generation_prompt")   # chat_template_kwargs cannot override these


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template refused it, or broke): a bad request."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                           namespace=_TemplateNamespace)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template: syntax error at line {e.lineno}: {e.message}") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_folder(cls, model_dir: str | Path, special_tokens: dict[str, str] | None = None) -> "ChatTemplate | None":
        """The folder's template; None when it has none. ValueError names a bad file."""
        source = find_template(Path(model_dir))
        return cls(source, special_tokens) if source is not None else None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, kwargs: dict | None = None) -> str:
        """Prompt text for `messages` (role / content dicts), with `kwargs` as extra template variables;
        ChatTemplateError when the template refuses them."""
        kwargs = kwargs or {}
        reserved = [k for k in RESERVED if k in kwargs]
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set there")
        plain = [{k: v for k, v in _plain(m).items() if v is not None} for m in messages]
        context = {**self.special_tokens, **_plain(kwargs), "messages": plain,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as e:  # raise_exception(...) included; SecurityError is one too
            raise ChatTemplateError(f"messages: the chat template refused them: {e}") from e
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            raise ChatTemplateError(f"messages: the chat template failed on them ({type(e).__name__}: {e})") from e


def find_template(model_dir: Path) -> str | None:
    path = model_dir / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        return None
    try:
        value = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{config_path}: cannot read its chat_template ({e})") from e
    if isinstance(value, list):  # named templates: transformers uses "default" for plain chat
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{config_path}: chat_template must be a string or a list of {{name, template}}")
    return value


def _plain(value):
    """JSON data only: what the template sees can carry no methods beyond those of str, int, list and dict."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for base in (str, int, float):  # a subclass (e.g. an enum) back to its base type
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    return f"<{type(value).__name__}>"


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without the dict type's own attributes."""
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (no way to CPython internals through it)."""
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")
