"""The body of one tool call → (function name, arguments), in either format tool_calls.py reads: a JSON object
(``qwen_3``) or ``<function=NAME><parameter=KEY>value</parameter>...</function>`` (``qwen_3_5``), whose raw text
values take the JSON types the tool's schema declares. None when a body is not a call: the stream keeps its text."""
from __future__ import annotations

import json
import math
import re
from typing import Any

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_INTEGER = re.compile(r"[-+]?\d+", re.ASCII)
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", re.ASCII)


def parse_json_call(body: str) -> tuple[str, dict] | None:
    """``{"name": ..., "arguments": {...}}`` → (name, arguments); None when it is not that."""
    parsed, call = _loads(body)
    if not parsed or not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):   # the arguments object written as JSON text
        parsed, arguments = _loads(arguments)
        if not parsed:
            return None
    if not isinstance(arguments, dict):
        return None
    return name.strip(), arguments


def parse_xml_call(body: str, schemas: dict[str, dict]) -> tuple[str, dict] | None:
    """``<function=NAME><parameter=KEY>value</parameter>...</function>`` → (name, arguments); None when the body
    is anything else (text outside the tags, a repeated parameter, a second function)."""
    function = _FUNCTION.fullmatch(body.strip())
    if function is None or not function[1].strip():
        return None
    name, inner = function[1].strip(), function[2]
    properties = schemas.get(name, {})
    arguments: dict[str, Any] = {}
    at = 0
    while (parameter := _PARAMETER.match(inner, at)) is not None:
        key = parameter[1].strip()
        if not key or key in arguments:
            return None
        arguments[key] = _typed_value(_strip_one_newline(parameter[2]), properties.get(key))
        at = parameter.end()
    if inner[at:].strip():
        return None
    return name, arguments


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name → its parameters' ``properties`` schema ({} when it declares none)."""
    schemas: dict[str, dict] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


def _typed_value(text: str, schema: Any) -> Any:
    """A raw parameter value as the JSON type its schema declares; the text itself when it is not one.

    Parameters the schema does not type (or does not name) are JSON when the text parses as JSON. With a list of
    types (``["integer", "null"]``) the first non-string type that fits wins, else the text. An ``enum`` or
    ``const`` value is matched with the whitespace around it stripped (grammars allow some there)."""
    choices = _choices(schema)
    for choice in choices:
        if text.strip() == (choice if isinstance(choice, str) else json.dumps(choice)):
            return choice
    declared = schema.get("type") if isinstance(schema, dict) else None
    types = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    if not types:
        parsed, value = _loads(text)
        return value if parsed else text
    for type_name in types:
        if type_name != "string" and isinstance(type_name, str):
            converted, value = _convert(text, type_name)
            if converted:
                return value
    return text


def _choices(schema: Any) -> list:
    if not isinstance(schema, dict):
        return []
    if "const" in schema:
        return [schema["const"]]
    return list(schema["enum"]) if isinstance(schema.get("enum"), list) else []


def _convert(text: str, type_name: str) -> tuple[bool, Any]:
    """(whether ``text`` is a ``type_name``, the value). object, array, null and unknown types: any JSON."""
    if type_name in ("integer", "number"):
        number = text.strip()
        try:   # int() refuses over 4300 digits
            if _INTEGER.fullmatch(number):
                return True, int(number)
            if _FLOAT.fullmatch(number) and math.isfinite(float(number)):
                return True, float(number)
        except ValueError:
            pass
        return False, None
    if type_name == "boolean":
        word = text.strip().lower()
        return word in ("true", "false"), word == "true"
    return _loads(text)


def _loads(text: str) -> tuple[bool, Any]:
    """(whether ``text`` is strict JSON, its value): NaN, Infinity and overflowing numbers are not JSON."""
    try:
        return True, json.loads(text, parse_constant=_finite, parse_float=_finite)
    except (ValueError, RecursionError):
        return False, None


def _finite(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"{number} is not a finite number")
    return value
