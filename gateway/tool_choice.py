"""A chat request's `tools` and `tool_choice`: checked, and turned into what the verifier constrains.

    auto      the tools are rendered into the prompt; the output is free and parsed for calls afterwards
    none      the tools are not rendered and the output is not parsed (the model answers in text)
    required  the output is one or more calls of the given tools, and nothing else (a grammar); exactly one
              when the request sets parallel_tool_calls to false
    {"type": "function", "function": {"name": N}}   exactly one call of N (a grammar)

The grammar is an xgrammar structural tag (JSON) written here, so the gateway needs no grammar engine: each call
is a tag whose begin and end are the model's wrapper text and whose content is the tool's JSON Schema, in the
model's style: JSON arguments for the Qwen3 / Qwen3-Next format, `<parameter=...>` blocks for the Qwen3.5 one
(the same tags xgrammar's own model templates produce; tests compare them). When the prompt leaves the model
inside `<think>`, the reasoning comes first, free text up to `</think>`, then the calls.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specdec.sampling_params import GrammarSpec

from .tool_calls import QWEN_3, QWEN_3_5

CHOICES = ("auto", "none", "required")
# format → (call begin before the name, between name and arguments, call end, xgrammar's json_schema style)
WRAPPERS = {
    QWEN_3: ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "json"),
    QWEN_3_5: ("<tool_call>\n<function=", ">\n", "\n</function>\n</tool_call>", "qwen_xml"),
}
THINK_TAGS = ["<think>", "</think>"]
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's rule for function names (they go into the grammar's text)
MAX_WHITESPACE = 4       # whitespace runs inside the arguments (a model that loops on newlines cannot run away)


class ToolRequestError(ValueError):
    """A bad `tools` / `tool_choice` (the message starts with the field's name)."""


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its output and its grammar."""
    tools: list[dict]              # rendered into the prompt and used to parse the output ([] for none)
    choice: str                    # "auto" | "none" | "required" | "named"
    name: str | None = None        # the named function
    parallel: bool = True          # required: several calls allowed (else exactly one)

    @property
    def parses(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def grammar(self, fmt: str, in_reasoning: bool) -> GrammarSpec | None:
        """The structural tag forcing the calls (required, named); None for auto and none."""
        if self.choice not in ("required", "named"):
            return None
        begin, middle, end, style = WRAPPERS[fmt]
        tags = [{"type": "tag", "begin": f"{begin}{t['function']['name']}{middle}",
                 "content": {"type": "json_schema", "json_schema": _parameters(t), "style": style,
                             "max_whitespace_cnt": MAX_WHITESPACE},
                 "end": end}
                for t in self.tools if self.choice == "required" or t["function"]["name"] == self.name]
        calls = tags[0] if self.choice == "named" else {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                                                        "at_least_one": True, "stop_after_first": not self.parallel}
        if in_reasoning:
            thinking = {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": THINK_TAGS},
                        "end": "</think>"}
            calls = {"type": "sequence", "elements": [thinking, {"type": "const_string", "value": "\n\n"}, calls]}
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": calls}))


NO_TOOLS = ToolPlan([], "auto")


def plan_tools(tools: list | None, tool_choice, parallel: bool | None = None) -> ToolPlan:
    """Check the request's tools and choice; ToolRequestError names the bad field."""
    tools = list(tools or [])
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolRequestError(f"tools[{i}]: a {{\"type\": \"function\", \"function\": {{...}}}} object is "
                                   f"required")
        if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
            raise ToolRequestError(f"tools[{i}].function.name: 1 to 64 letters, digits, underscores or dashes are "
                                   f"required, got {function.get('name')!r}")
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolRequestError(f"tools[{i}].function.parameters: a JSON Schema object is required")
        names.append(function["name"])
    if len(set(names)) != len(names):
        raise ToolRequestError("tools: function names must be unique")
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolRequestError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, "
                                   f"got {tool_choice!r}")
        if tool_choice == "required" and not tools:
            raise ToolRequestError("tool_choice: \"required\" needs tools")
        return ToolPlan(tools if tool_choice != "none" else [], tool_choice, parallel=parallel is not False)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolRequestError("tool_choice: give auto, none, required or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in names:
        raise ToolRequestError(f"tool_choice: function {name!r} is not among the tools")
    return ToolPlan(tools, "named", name)


def template_tool_calls(messages: list[dict]) -> list[dict]:
    """Messages for the chat template: an assistant's tool_calls carry their arguments as JSON text (OpenAI's
    form); templates iterate them as a mapping (as Qwen's do), so they are parsed here. Unparseable arguments
    stay text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_with_parsed_arguments(c) for c in calls]}
        out.append(message)
    return out


def _with_parsed_arguments(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}
