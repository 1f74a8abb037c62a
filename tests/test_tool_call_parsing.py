"""Tool calls and reasoning parsed from model output (gateway.tool_calls, gateway.reasoning): exact content and
arguments for both tool-call formats, malformed and unclosed calls kept as content, schema typing of XML
parameters, thinking split with and without an opened prompt, and streams equal to the whole-text parse for any
split of the text into deltas."""
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.reasoning import ReasoningStream, SplitText, prompt_opens_reasoning, split_reasoning
from gateway.tool_calls import (ContentDelta, ToolCallDelta, ToolCallStream, detect_format, parse_tool_calls)

FAST = settings(max_examples=200, deadline=None)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
        "metric": {"type": "boolean"}, "options": {"type": "object"}, "hours": {"type": "array"},
        "note": {"type": "null"}, "code": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]


def hermes(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def xml(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


# --- qwen_3 (Hermes JSON) ---

def test_hermes_text_before_one_call():
    text = "Let me check the weather.\n\n" + hermes("get_weather", {"city": "Paris"})
    message = parse_tool_calls(text, "qwen_3", TOOLS)
    assert message.content == "Let me check the weather."
    assert calls_of(message) == [("get_weather", {"city": "Paris"})]
    assert message.tool_calls[0].arguments == '{"city": "Paris"}'
    assert re.fullmatch(r"call_[0-9a-f]{24}", message.tool_calls[0].id)


def test_hermes_several_calls_and_an_unknown_function():
    text = (hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("search", {"query": "café"}) + "\n\n"
            + hermes("not_a_tool", {"x": 1}) + "\n")
    message = parse_tool_calls(text, "qwen_3", TOOLS)
    assert message.content == ""
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("search", {"query": "café"}),
                                 ("not_a_tool", {"x": 1})]   # unknown functions are the client's to refuse
    assert '"café"' in message.tool_calls[1].arguments   # not \\u-escaped
    assert len({c.id for c in message.tool_calls}) == 3


@pytest.mark.parametrize("body", ['{"name": "get_weather", "arguments": {"city": "Par',   # bad JSON
                                  '{"arguments": {"city": "Paris"}}',                   # no name
                                  '["get_weather"]',                                   # not an object
                                  '{"name": "get_weather", "arguments": [1]}'])         # arguments not an object
def test_hermes_malformed_call_stays_content(body):
    bad = f"<tool_call>\n{body}\n</tool_call>"
    text = "Hi " + bad + "\n" + hermes("search", {"query": "q"})
    message = parse_tool_calls(text, "qwen_3", TOOLS)
    assert message.content == "Hi " + bad
    assert calls_of(message) == [("search", {"query": "q"})]


def test_hermes_arguments_as_json_text_and_missing_arguments():
    text = ('<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>'
            '<tool_call>{"name": "search"}</tool_call>')
    assert calls_of(parse_tool_calls(text, "qwen_3", TOOLS)) == [("search", {"query": "q"}), ("search", {})]


def test_unclosed_call_stays_content():
    text = "Sure.\n" + hermes("search", {"query": "q"}) + "\n<tool_call>\n{\"name\": \"search\", \"argum"
    message = parse_tool_calls(text, "qwen_3", TOOLS)
    assert message.content == "Sure.\n<tool_call>\n{\"name\": \"search\", \"argum"
    assert calls_of(message) == [("search", {"query": "q"})]


def test_text_without_calls_is_kept_exactly():
    for text in ["", "  Hello,\n world!\n\n", "a <tool_ca b", "</tool_call> <tool_call"]:
        message = parse_tool_calls(text, "qwen_3", TOOLS)
        assert (message.content, message.tool_calls) == (text, [])


def test_text_between_and_after_calls():
    text = "First.\n" + hermes("search", {"query": "a"}) + "\n" + hermes("search", {"query": "b"}) + "\n Then.\n"
    message = parse_tool_calls(text, "qwen_3", TOOLS)
    assert message.content == "First.\nThen.\n"   # the whitespace before the calls separates the two texts
    assert len(message.tool_calls) == 2


# --- qwen_3_5 (XML) ---

def test_xml_parameters_typed_by_schema():
    text = "Checking.\n\n" + xml("get_weather", city="Paris", days="3", scale="2.5", metric="True",
                                 options='{"units": "C"}', hours="[9, 12]", note="null", code="007",
                                 limit="null", extra='{"a": [1]}', other="plain words")
    message = parse_tool_calls(text, "qwen_3_5", TOOLS)
    assert message.content == "Checking."
    assert calls_of(message) == [("get_weather", {
        "city": "Paris", "days": 3, "scale": 2.5, "metric": True, "options": {"units": "C"}, "hours": [9, 12],
        "note": None, "code": "007", "limit": None, "extra": {"a": [1]}, "other": "plain words"})]


def test_xml_values_that_do_not_fit_their_type_stay_text():
    text = xml("get_weather", days="many", scale="nan", metric="yes", options="{broken", limit="soon")
    assert calls_of(parse_tool_calls(text, "qwen_3_5", TOOLS)) == [("get_weather", {
        "days": "many", "scale": "nan", "metric": "yes", "options": "{broken", "limit": "soon"})]


def test_xml_strips_exactly_one_newline_each_side():
    text = "<tool_call>\n<function=search>\n<parameter=query>\n\n  two\nlines \n\n</parameter>\n</function>\n</tool_call>"
    assert calls_of(parse_tool_calls(text, "qwen_3_5", TOOLS)) == [("search", {"query": "\n  two\nlines \n"})]


def test_xml_unknown_function_and_several_calls():
    text = xml("search", query="q") + "\n" + xml("launch", count="2", target="moon")
    message = parse_tool_calls(text, "qwen_3_5", TOOLS)
    assert message.content == ""
    assert calls_of(message) == [("search", {"query": "q"}), ("launch", {"count": 2, "target": "moon"})]


@pytest.mark.parametrize("body", ["<function=search>\n<parameter=query>\nq\n</parameter>\n",      # no </function>
                                  "<function=search>\nhello\n</function>",                         # stray text
                                  "<parameter=query>\nq\n</parameter>",                            # no function
                                  "<function=search>\n<parameter=query>\na\n</parameter>\n"
                                  "<parameter=query>\nb\n</parameter>\n</function>"])             # repeated key
def test_xml_malformed_call_stays_content(body):
    bad = f"<tool_call>\n{body}\n</tool_call>"
    message = parse_tool_calls(bad + xml("search", query="ok"), "qwen_3_5", TOOLS)
    assert message.content == bad
    assert calls_of(message) == [("search", {"query": "ok"})]


def test_detect_format_and_bad_format():
    assert detect_format("{% for t in tools %}<function=example_function_name>{% endfor %}") == "qwen_3_5"
    assert detect_format("{{- '<tool_call>\\n' }}{{ tool_call.arguments | tojson }}") == "qwen_3"
    assert detect_format("{{ messages[0].content }}") is None
    assert detect_format(None) is None
    with pytest.raises(ValueError):
        ToolCallStream("hermes", TOOLS)


# --- tool-call streams ---

def test_stream_sends_content_early_and_each_call_when_it_closes():
    stream = ToolCallStream("qwen_3", TOOLS)
    assert stream.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert stream.feed("ld <tool_") == [ContentDelta("ld")]        # " <tool_" may begin a call (or be dropped)
    assert stream.feed('call>{"name": "search", "arguments": {}}</tool_cal') == []
    [call] = stream.feed("l>")
    assert isinstance(call, ToolCallDelta) and (call.index, call.name, call.arguments) == (0, "search", "{}")
    assert stream.feed('\n<tool_call>{"name": "get_weather"') == []
    assert stream.finish() == [ContentDelta(' <tool_call>{"name": "get_weather"')]   # unclosed: content, after
    # the whitespace that preceded the calls


def stream_parse(fmt: str, deltas: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
    stream = ToolCallStream(fmt, TOOLS)
    events = [e for d in deltas for e in stream.feed(d)] + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [(e.index, e.name, e.arguments) for e in events if isinstance(e, ToolCallDelta)]


def whole_parse(fmt: str, text: str) -> tuple[str, list[tuple[int, str, str]]]:
    message = parse_tool_calls(text, fmt, TOOLS)
    return message.content, [(i, c.name, c.arguments) for i, c in enumerate(message.tool_calls)]


HERMES_OUTPUTS = [
    "I'll look that up.\n\n" + hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("search", {"query": "x"}),
    "Answer <tool_call> not a call</tool_call> then " + hermes("search", {"query": "<tool_call>"}) + "\n tail ",
    " \n" + hermes("nope", {}) + "\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"unfini",
    "plain text only, with < and </tool_ and <tool_call\n",
]
XML_OUTPUTS = [
    "Let me check.\n\n" + xml("get_weather", city="Paris", days="3", metric="false") + "\n" + xml("search", query="a b"),
    xml("search", query="<tool_call>?") + "\n<tool_call>\n<function=search>\nbroken\n</function>\n</tool_call>\nBye.",
    "Text " + xml("launch", count="2") + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
]
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "<", "\n", " ", "x",
             '{"name": "search", "arguments": {"query": "q"}}', "{bad", "<function=search>", "</function>",
             "<parameter=query>", "</parameter>", "\n3\n"]


@st.composite
def split_text(draw, texts: st.SearchStrategy[str]) -> tuple[str, list[str]]:
    text = draw(texts)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=16)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


fragment_text = st.lists(st.sampled_from(FRAGMENTS), max_size=14).map("".join)


@FAST
@given(split_text(st.sampled_from(HERMES_OUTPUTS) | fragment_text))
def test_hermes_stream_equals_whole_parse_for_any_split(case):
    text, deltas = case
    assert stream_parse("qwen_3", deltas) == whole_parse("qwen_3", text)


@FAST
@given(split_text(st.sampled_from(XML_OUTPUTS) | fragment_text))
def test_xml_stream_equals_whole_parse_for_any_split(case):
    text, deltas = case
    assert stream_parse("qwen_3_5", deltas) == whole_parse("qwen_3_5", text)


@pytest.mark.parametrize("fmt,text", [("qwen_3", t) for t in HERMES_OUTPUTS] + [("qwen_3_5", t) for t in XML_OUTPUTS])
def test_stream_character_by_character(fmt, text):
    assert stream_parse(fmt, list(text)) == whole_parse(fmt, text)


def test_representative_outputs_parse_as_intended():
    assert whole_parse("qwen_3", HERMES_OUTPUTS[1]) == (
        "Answer <tool_call> not a call</tool_call> then tail ", [(0, "search", '{"query": "<tool_call>"}')])
    assert whole_parse("qwen_3_5", XML_OUTPUTS[2]) == (
        "Text <tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [(0, "launch", '{"count": 2}')])


# --- reasoning ---

def test_split_reasoning_prompt_opened_the_thinking():
    assert split_reasoning("The user asks.\nThink more.\n</think>\n\nParis.", True) == SplitText(
        "The user asks.\nThink more.", "Paris.")


def test_split_reasoning_output_opens_the_thinking():
    text = "<think>\nHmm.\n</think>\n\nParis.\n"
    assert split_reasoning(text, False) == SplitText("Hmm.", "Paris.\n")
    assert split_reasoning(text, True) == SplitText("Hmm.", "Paris.\n")   # a repeated <think> is not reasoning
    assert split_reasoning("\n <think></think>Hi", False) == SplitText("", "Hi")


def test_split_reasoning_without_thinking():
    for text in ["\nParis.\n", "Paris </think> x", "Say <think> now", ""]:
        assert split_reasoning(text, False) == SplitText(None, text)


def test_split_reasoning_truncated_thinking_is_all_reasoning():
    assert split_reasoning("\nStill thinking about it\n\n", True) == SplitText("Still thinking about it", "")
    assert split_reasoning("<think>\nStill thinking</thi", False) == SplitText("Still thinking</thi", "")
    assert split_reasoning("", True) == SplitText("", "")


def test_prompt_opens_reasoning():
    opened = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert prompt_opens_reasoning(opened)
    assert not prompt_opens_reasoning(opened + "\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<|im_start|>user\nwrite <think><|im_end|>\n<|im_start|>assistant\n")
    assert prompt_opens_reasoning("<think>\nprefilled")   # no turn markers: the whole prompt counts


def test_reasoning_stream_holds_only_a_possible_tag():
    stream = ReasoningStream(starts_in_reasoning=True)
    assert stream.feed("\nabc\n</thi") == [("reasoning", "abc")]
    assert stream.feed("nk>\n\nHi") == [("content", "Hi")]
    assert stream.feed(" there") == [("content", " there")]
    assert stream.finish() == []
    stream = ReasoningStream(starts_in_reasoning=False)
    assert stream.feed(" <thi") == []
    assert stream.feed("s is content") == [("content", " <this is content")]


def reasoning_stream(deltas: list[str], starts_in_reasoning: bool) -> dict[str, str]:
    stream = ReasoningStream(starts_in_reasoning)
    pieces = [p for d in deltas for p in stream.feed(d)] + stream.finish()
    assert all(text for _, text in pieces)
    return {kind: "".join(t for k, t in pieces if k == kind) for kind in ("reasoning", "content")}


THINKING_OUTPUTS = [
    "Let me think.\n\nStep 2.\n</think>\n\nThe answer is 4.\n",
    "\n<think>\n\nQuick.\n\n</think>\n\n\nHi </think> <think>",
    "<think>\ntruncated reasoning\n\n",
    "no thinking at all\n",
    " \n <thin",
]
THINK_FRAGMENTS = ["<think>", "</think>", "<thi", "</th", "\n", "\n\n", " ", "a", "<"]


@FAST
@given(split_text(st.sampled_from(THINKING_OUTPUTS) | st.lists(st.sampled_from(THINK_FRAGMENTS), max_size=12).map(
    "".join)), st.booleans())
def test_reasoning_stream_equals_split_for_any_split(case, starts_in_reasoning):
    text, deltas = case
    split = split_reasoning(text, starts_in_reasoning)
    assert reasoning_stream(deltas, starts_in_reasoning) == {"reasoning": split.reasoning or "",
                                                            "content": split.content}


def test_reasoning_then_tool_calls_compose():
    text = "Need weather.\n</think>\n\nChecking.\n" + xml("get_weather", city="Oslo", days="2")
    split = split_reasoning(text, True)
    expected = parse_tool_calls(split.content, "qwen_3_5", TOOLS)
    reasoning, tools = ReasoningStream(True), ToolCallStream("qwen_3_5", TOOLS)
    events = []
    for char in text:
        for kind, piece in reasoning.feed(char):
            events += tools.feed(piece) if kind == "content" else []
    events += [e for kind, piece in reasoning.finish() if kind == "content" for e in tools.feed(piece)]
    events += tools.finish()
    assert split.reasoning == "Need weather."
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == expected.content == "Checking."
    assert [(e.name, e.arguments) for e in events if isinstance(e, ToolCallDelta)] == [
        ("get_weather", '{"city": "Oslo", "days": 2}')]


def test_an_enum_or_const_value_is_matched_without_the_whitespace_a_grammar_allows_around_it():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", 3]}, "unit": {"const": "C"}, "note": {"type": "string"}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=city>\n\nParis \n</parameter>\n<parameter=unit>\n C\n"
            "</parameter>\n<parameter=note>\n a \n</parameter>\n</function>\n</tool_call>")
    call = parse_tool_calls(text, "qwen_3_5", tools).tool_calls[0]
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C", "note": " a "}   # a plain string keeps it
