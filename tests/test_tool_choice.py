"""tool_choice → grammar (gateway/tool_choice.py): the structural tags we write are the ones xgrammar's own model
templates write for Qwen3 / Qwen3-Next and Qwen3.5, they compile, take a well-formed call and refuse anything
else; bad tools and choices are refused by field."""
import json
from pathlib import Path

import pytest
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from gateway.tool_choice import ToolRequestError, plan_tools, template_tool_calls
from specdec.demo import demo_model_dir

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
CALLS = {"qwen_3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
         "qwen_3_5": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def compiler():
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(demo_model_dir()) / "tokenizer.json"))
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096, stop_token_ids=[0]))


def _tags(node) -> list[tuple]:
    """Every call tag of a structural tag: (begin, schema, style, end)."""
    if isinstance(node, dict):
        if node.get("type") == "tag" and node.get("content", {}).get("type") == "json_schema":
            content = node["content"]
            return [(node["begin"], content["json_schema"], content["style"], node["end"])]
        return [t for value in node.values() for t in _tags(value)]
    if isinstance(node, list):
        return [t for value in node for t in _tags(value)]
    return []


@pytest.mark.parametrize("fmt", ["qwen_3", "qwen_3_5"])
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_our_call_tags_are_xgrammars(fmt, choice):
    ours = json.loads(plan_tools(TOOLS, choice).grammar(fmt, in_reasoning=False).text)
    theirs = xgr.get_model_structural_tag(fmt, tools=TOOLS, tool_choice=choice, reasoning=False).model_dump()
    assert _tags(ours) == _tags(theirs) and len(_tags(ours)) == (2 if choice == "required" else 1)


@pytest.mark.parametrize("fmt", ["qwen_3", "qwen_3_5"])
def test_required_takes_calls_and_nothing_else(compiler, fmt):
    grammar = compiler.compile_structural_tag(json.loads(plan_tools(TOOLS, "required").grammar(fmt, False).text))
    two = xgr.GrammarMatcher(grammar)
    assert two.accept_string(CALLS[fmt] + "\n" + CALLS[fmt]) and two.accept_token(0) and two.is_terminated()
    assert not xgr.GrammarMatcher(grammar).accept_string("Sure, " + CALLS[fmt])        # no text before
    single = plan_tools(TOOLS, "required", parallel=False).grammar(fmt, False)
    one = xgr.GrammarMatcher(compiler.compile_structural_tag(json.loads(single.text)))
    assert one.accept_string(CALLS[fmt]) and not one.accept_string("\n<")            # exactly one call
    wrong = CALLS[fmt].replace("3", "three")                                         # days must be an integer
    assert not xgr.GrammarMatcher(grammar).accept_string(wrong)


@pytest.mark.parametrize("fmt", ["qwen_3", "qwen_3_5"])
def test_reasoning_comes_first_when_the_prompt_opened_it(compiler, fmt):
    grammar = compiler.compile_structural_tag(json.loads(plan_tools(TOOLS, NAMED).grammar(fmt, True).text))
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string("Rain in Paris?\n</think>\n\n" + CALLS[fmt]) and matcher.accept_token(0)
    now = xgr.GrammarMatcher(grammar)
    assert now.accept_string("x</think>\n\n") and not now.accept_string("Hello")


def test_auto_and_none_make_no_grammar():
    assert plan_tools(TOOLS, "auto").grammar("qwen_3", False) is None
    none = plan_tools(TOOLS, "none")
    assert none.tools == [] and not none.parses and plan_tools(TOOLS, None).parses


@pytest.mark.parametrize("tools, choice, words", [
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a>b"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "parameters"),
    (TOOLS + TOOLS[:1], None, "unique"),
    (TOOLS, "sometimes", "tool_choice must be one of"),
    ([], "required", "needs tools"),
    (TOOLS, {"type": "function", "function": {"name": "fly"}}, "'fly' is not among the tools"),
    (TOOLS, {"type": "function"}, "tool_choice: give"),
])
def test_bad_tools_are_refused_by_field(tools, choice, words):
    with pytest.raises(ToolRequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        plan_tools(tools, choice)


def test_assistant_call_arguments_reach_the_template_as_a_mapping():
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}]
    calls = template_tool_calls(messages)[0]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"a": 1} and calls[1]["function"]["arguments"] == "not json"
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'         # the request is not changed
