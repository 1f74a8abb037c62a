"""The grammar cases of bench/grammar_mask_bench.py, each a Grammar(name, xgr, llg, text): how xgrammar compiles it
(`xgr(compiler)`), its llguidance grammar string (`llg()`) and a valid output to walk (`text`). grammars() makes them:
any JSON and a {"type": "object"} schema (output ANY_DOC), a 9-property schema (SCHEMA) with and without its
maxLength (output SCHEMA_DOC), a date-time regex (DATE_RE), and a Qwen3 `<tool_call>` of the function TOOL with
arguments TOOL_ARGS (xgrammar's "qwen_3" structural tag; llguidance: TOOL_LARK; output TOOL_TEXT)."""
from __future__ import annotations

import collections
import json

TOOL_ARGS = {"type": "object", "additionalProperties": False, "required": ["origin", "destination", "date"],
             "properties": {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                            "cabin": {"enum": ["economy", "premium", "business", "first"]},
                            "flexible": {"type": "boolean"}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "name", "status", "orders", "address"],
          "properties": {"id": {"type": "integer", "minimum": 1}, "name": {"type": "string", "maxLength": 64},
                         "email": {"type": "string"}, "status": {"enum": ["active", "suspended", "deleted"]},
                         "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
                         "orders": {"type": "array", "items": {
                             "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                             "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                            "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}}}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
                         "verified": {"type": "boolean"}}}
SCHEMA_DOC = {"id": 48213, "name": "Zoë Müller-Okafor", "email": "zoe.mueller@example.org", "status": "active",
              "score": 87.25, "tags": ["priority", "eu-west", "returning customer"],
              "orders": [{"sku": "KBD-1042", "qty": 2, "price": 49.99}, {"sku": "MSE-0007", "qty": 1},
                         {"sku": "USB-3310", "qty": 12, "price": 3.5}],
              "address": {"street": "Hauptstraße 12", "city": "Köln", "zip": "50667"}, "verified": True}
ANY_DOC = {"service": "specdec", "version": "0.4.1", "replicas": 3, "gpu": {"kind": "H100", "memory_gib": 80.0},
           "features": ["speculative decoding", "paged attention", None, True], "limits": {"max_tokens": 8192,
           "timeout_s": 30.5, "retry": {"attempts": 5, "backoff": [0.1, 0.2, 0.4]}}, "owner": "infra-team",
           "description": "Serves Qwen3.5 with MTP drafts; 日本語もOK.", "labels": {"env": "prod", "tier": 1}}
DATE_RE = (r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
           r"(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})")
TOOL = {"type": "function", "function": {"name": "search_flights", "description": "Find flights",
                                         "parameters": TOOL_ARGS}}
TOOL_TEXT = ('<tool_call>\n{"name": "search_flights", "arguments": ' + json.dumps(
    {"origin": "SFO", "destination": "NRT", "date": "2026-12-19", "passengers": 2, "cabin": "business"})
    + "}\n</tool_call>")
# llguidance, as xgrammar's "qwen_3" tag with tool_choice="required": the call at once, `<name>`: a special token
TOOL_LARK = ('start: <tool_call> "\\n{\\"name\\": \\"search_flights\\", \\"arguments\\": " %json '
             + json.dumps(TOOL_ARGS) + ' "}\\n" </tool_call>\n')


Grammar = collections.namedtuple("Grammar", "name xgr llg text")  # xgr(compiler) -> compiled; llg() -> grammar str


def grammars(xgr) -> list[Grammar]:
    ll = __import__("llguidance").LLMatcher
    obj, no_max = {"type": "object", "additionalProperties": True}, json.loads(json.dumps(SCHEMA))
    del no_max["properties"]["name"]["maxLength"]
    tag = xgr.get_model_structural_tag("qwen_3", tools=[TOOL], tool_choice="required", reasoning="disabled",
                                       parallel_tool_calls=False)
    any_doc, doc = json.dumps(ANY_DOC, ensure_ascii=False), json.dumps(SCHEMA_DOC, ensure_ascii=False)
    return [Grammar("any JSON", lambda c: c.compile_builtin_json_grammar(), lambda: ll.grammar_from_json_schema({}),
                    any_doc),
            Grammar('{"type": "object"}', lambda c: c.compile_json_schema(obj), lambda: ll.grammar_from_json_schema(
                obj), any_doc),
            Grammar("schema, 9 props", lambda c: c.compile_json_schema(SCHEMA), lambda: ll.grammar_from_json_schema(
                SCHEMA), doc),
            Grammar("same, no maxLength", lambda c: c.compile_json_schema(no_max),
                    lambda: ll.grammar_from_json_schema(no_max), doc),
            Grammar("regex date-time", lambda c: c.compile_regex(DATE_RE), lambda: ll.grammar_from_regex(DATE_RE),
                    "2026-11-26T14:03:59.123456+01:00"),
            Grammar("qwen3 tool call", lambda c: c.compile_structural_tag(tag), lambda: ll.grammar_from_lark(TOOL_LARK),
                    TOOL_TEXT)]
