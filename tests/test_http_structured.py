"""Structured outputs, tool calls and reasoning through a real stack (issue 40): the demo model with its MTP drafter
service, driven by the official `openai` client and by gRPC. JSON Schema outputs validate; tool_choice
"required" and a named function always give well-formed calls, streamed and not; a two-turn tool conversation;
reasoning split out with enable_thinking; seeded constrained output is the same with speculation off; and
refusals name their field."""
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest

from specdec.demo import demo_model_dir
from specdec.rpc.v1 import gateway_pb2
from specdec_tools.local_stack import LocalStack, StackConfig

pytestmark = pytest.mark.timeout(600)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "year", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "year": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                         "kind": {"enum": ["module", "class", "function"]}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
           "properties": {"city": {"enum": ["Paris", "London", "Rome"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = LocalStack(StackConfig(model=str(demo_model_dir()), drafter="mtp", num_drafts=3, port=0, http_port=0,
                                   log_dir=str(tmp_path_factory.mktemp("structured")), startup_timeout_s=180))
    stack.start()
    yield stack
    stack.stop()


def test_50_seeded_json_schema_outputs_validate(client):
    def one(seed):
        reply = client.chat.completions.create(model="demo_model", messages=[{"role": "user", "content": f"item {seed}"}],
                                               max_tokens=160, temperature=0.8, seed=seed, response_format=FORMAT)
        return reply.choices[0]
    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(one, range(50)))
    for choice in choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({c.message.content for c in choices}) > 25                      # sampled, not one answer


def test_json_object_and_seeded_output_equal_without_speculation(client):
    outputs = []
    for speculation in (True, False):
        reply = client.chat.completions.create(model="demo_model", messages=ASK, max_tokens=120, temperature=0.8,
                                               seed=5, response_format={"type": "json_object"},
                                               extra_body={"speculation": speculation})
        outputs.append(reply.choices[0].message.content)
        assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(outputs[-1]), dict)
        drafts = reply.usage.model_extra["spec_decode"]["draft_tokens"]
        assert drafts > 0 if speculation else drafts == 0                         # drafts verified under the mask
    assert outputs[0] == outputs[1]


def _check_call(call, names=("get_weather", "now")):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER)
    return arguments


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_always_gives_well_formed_calls(client, stream):
    for seed in range(6):
        kwargs = dict(model="demo_model", messages=ASK, max_tokens=200, temperature=0.8, seed=seed, tools=TOOLS,
                      tool_choice="required", parallel_tool_calls=False)
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            calls, content, reason = choice.message.tool_calls, choice.message.content, choice.finish_reason
        else:
            chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
            assert [tc.index for tc in calls] == list(range(len(calls)))
        assert reason == "tool_calls" and len(calls) == 1 and not content, (reason, calls, content)
        _check_call(calls[0])


def test_a_named_function_is_the_one_called_and_the_conversation_goes_on(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model="demo_model", messages=ASK, max_tokens=200, tools=TOOLS,
                                           tool_choice=named)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "stop" and call.function.name == "get_weather"   # named: as OpenAI
    _check_call(call, ("get_weather",))
    turn = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "rain", "celsius": 11})}]
    second = client.chat.completions.create(model="demo_model", messages=turn, max_tokens=24, tools=TOOLS)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20           # the call and its result were read
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for later in second.choices[0].message.tool_calls or []:                      # auto: whatever it calls parses
        assert later.function.name in ("get_weather", "now") and later.id.startswith("call_")


def test_tool_choice_none_and_auto_leave_plain_text_alone(client):
    prompt_tokens = {}
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model="demo_model", messages=ASK, max_tokens=16, tools=TOOLS,
                                               tool_choice=choice)
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
        prompt_tokens[choice] = reply.usage.prompt_tokens
    bare = client.chat.completions.create(model="demo_model", messages=ASK, max_tokens=1).usage.prompt_tokens
    assert prompt_tokens["none"] == bare < prompt_tokens["auto"]                  # none: the tools are not shown


def test_reasoning_is_split_out_streamed_and_not(client):
    kwargs = dict(model="demo_model", messages=ASK, max_tokens=40, extra_body={
        "chat_template_kwargs": {"enable_thinking": True}})
    whole = client.chat.completions.create(**kwargs).choices[0].message
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and streamed == reasoning and "<think>" not in reasoning
    assert (whole.content or "") == "".join(c.choices[0].delta.content or "" for c in chunks)
    plain = client.chat.completions.create(model="demo_model", messages=ASK, max_tokens=40).choices[0].message
    assert "reasoning_content" not in (plain.model_extra or {}) and plain.content   # off: all of it is the answer


def test_grpc_takes_grammars_and_tools(client, stub):
    http = client.chat.completions.create(model="demo_model", messages=ASK, max_tokens=160, temperature=0.8,
                                          seed=9, response_format=FORMAT).choices[0].message.content
    sampling = gateway_pb2.SamplingParams(max_tokens=160, temperature=0.8, seed=9,
                                          grammar=gateway_pb2.Grammar(json_schema=json.dumps(SCHEMA)))
    messages = [gateway_pb2.ChatMessage(role="user", content=ASK[0]["content"])]
    replies = list(stub.Generate(gateway_pb2.GenerateRequest(messages=messages, sampling=sampling), timeout=300))
    assert "".join(r.text for r in replies) == http
    tools = [gateway_pb2.Tool(name=t["function"]["name"], parameters_json=json.dumps(t["function"]["parameters"]))
             for t in TOOLS]
    replies = list(stub.Generate(gateway_pb2.GenerateRequest(
        messages=messages, sampling=gateway_pb2.SamplingParams(max_tokens=200), tools=tools,
        tool_choice="get_weather"), timeout=300))
    calls = [c for r in replies for c in r.tool_calls]
    assert replies[-1].finish_reason == "stop" and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments_json), WEATHER)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(gateway_pb2.GenerateRequest(
            prompt="x", sampling=gateway_pb2.SamplingParams(grammar=gateway_pb2.Grammar(regex="(")))))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in error.value.details()


@pytest.mark.parametrize("kwargs, field", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "grammar": "b"}}), "structured_outputs"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": 3}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": 'say "hi"'}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
          tool_choice="required"), "tools"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "objectx"}}}), "structured_outputs"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_400_names_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="demo_model", messages=ASK, max_tokens=8, **kwargs)
    assert error.value.body["param"] == field, error.value.body


def test_completions_take_a_regex(client):
    reply = client.completions.create(model="demo_model", prompt="date = ", max_tokens=20, temperature=0.7, seed=1,
                                      extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]"}})
    text = reply.choices[0].text
    assert len(text) == 7 and text.startswith("20") and text[4] == "-", text
