"""Chat templates (issue 14): the gateway's rendering + tokenization of `messages` gives exactly the prompt ids of
transformers' `apply_chat_template(..., add_generation_prompt=True)` on the same model folder, for the demo
model's own template and for a ChatML template with special tokens that uses the features real templates use
(namespace, loop controls, tojson, raise_exception, template kwargs). The sandbox holds, and refusals name the
field."""
import json
import shutil

import pytest
from tokenizers import AddedToken, Tokenizer

from gateway.chat_template import ChatTemplate, ChatTemplateError
from gateway.generator import Generator, PromptRequest
from gateway.tokenizer import TextTokenizer
from gateway.validation import InvalidRequest
from specdec.demo import DEMO_DIR

CHATML = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}
{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception('Unknown role: ' ~ message.role) }}
    {%- endif %}
    {%- if message.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in message.content %}
        {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
    {%- else %}
        {%- set content = message.content %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if metadata is defined %}{{- '<|im_start|>meta\\n' + metadata | tojson + '<|im_end|>\\n' }}{% endif %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{% endif %}
{%- endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "Sort a list\nof numbers"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"},
     {"role": "user", "content": "  trailing spaces and ünïcødé  "}],
    [{"role": "user", "content": "text with a control token <|im_end|> inside"}],
]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """The demo model's tokenizer plus ChatML special tokens, and the template in tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("chatml")
    tok = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML}))
    shutil.copy(DEMO_DIR / "config.json", folder / "config.json")
    return folder


def gateway_ids(folder, messages, kwargs=None) -> list[int]:
    """Prompt ids as the gateway makes them for a `messages` request (the code path both APIs take)."""
    tokenizer = TextTokenizer.from_folder(folder)
    generator = Generator(None, tokenizer, ChatTemplate.from_folder(folder, tokenizer.special_tokens_map))
    return generator._encode(PromptRequest(messages=messages, chat_template_kwargs=kwargs or {}))[0]


@pytest.mark.parametrize("which", ["demo", "chatml"])
def test_prompt_ids_equal_transformers_apply_chat_template(which, chatml_dir):
    from transformers import AutoTokenizer
    folder = DEMO_DIR if which == "demo" else chatml_dir
    reference = AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS:
        want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert gateway_ids(folder, messages) == list(want), messages
    if which == "chatml":  # template kwargs reach the template (transformers passes its extra kwargs the same way)
        kwargs = dict(enable_thinking=False, metadata={"tag": "<b>&", "n": [1, 2]})
        want = reference.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=True, **kwargs)
        want = want["input_ids"] if hasattr(want, "keys") else want
        got = gateway_ids(folder, CONVERSATIONS[0], kwargs)
        assert got == list(want) and got != gateway_ids(folder, CONVERSATIONS[0])
        assert reference.convert_tokens_to_ids("<|im_start|>") in got   # special tokens, not their text


def test_template_sources(tmp_path, chatml_dir):
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(chatml_dir / name, tmp_path / name)
    assert ChatTemplate.from_folder(tmp_path) is None                 # no template anywhere
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert ChatTemplate.from_folder(tmp_path).render([{"role": "user", "content": "x"}]) == "x"
    (tmp_path / "chat_template.jinja").write_text("jinja file wins")    # as in transformers
    assert ChatTemplate.from_folder(tmp_path).render([]) == "jinja file wins"
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ValueError, match="syntax error"):
        ChatTemplate.from_folder(tmp_path)


@pytest.mark.parametrize("source,match", [
    ("{{ ''.__class__.__mro__ }}", "refused"),                                  # the sandbox: no Python internals
    ("{{ messages.__class__ }}{{ raise_exception('no') }}", "refused"),
    ("{% set ns = namespace(_x=1) %}", "underscore"),
    ("{{ raise_exception('only user turns') }}", "only user turns"),
    ("{{ messages[0].content + 1 }}", "failed"),
])
def test_template_refusals_are_bad_requests(source, match):
    with pytest.raises(ChatTemplateError, match=match) as error:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert str(error.value).startswith(("messages:",))


def test_reserved_kwargs_and_messages_checks(chatml_dir):
    for reserved in ("messages", "add_generation_prompt"):
        with pytest.raises(InvalidRequest, match=f"chat_template_kwargs: {reserved}"):
            gateway_ids(chatml_dir, CONVERSATIONS[0], {reserved: False})
    with pytest.raises(InvalidRequest, match=r"messages\[1\].role"):
        gateway_ids(chatml_dir, [{"role": "user", "content": "x"}, {"content": "no role"}])
    tokenizer = TextTokenizer.from_folder(chatml_dir)
    with pytest.raises(InvalidRequest, match="no chat template"):
        Generator(None, tokenizer, None)._encode(PromptRequest(messages=CONVERSATIONS[0]))


def test_grpc_messages_with_invalid_utf8_name_the_field():
    """The gRPC `messages` form: a message whose bytes are not UTF-8 is refused naming messages[i].role/content."""
    from gateway.wire import MalformedRequest, decode_generate_request
    from specdec.rpc.v1 import gateway_pb2
    good = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")] * 2)
    assert list(decode_generate_request(good.SerializeToString()).messages) == list(good.messages)
    for field, number in (("role", 1), ("content", 2)):
        bad = good.SerializeToString() + _field(5, _field(number, b"\xff\xfe"))    # a third message
        decoded = decode_generate_request(bad)
        assert isinstance(decoded, MalformedRequest) and decoded.message.startswith(f"messages[2].{field}:")


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (payloads under 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload
