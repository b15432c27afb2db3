"""Chat templates rendered without transformers (pagellm/tokenization/chat_render.py) against transformers'
apply_chat_template(tokenize=False): the default model's template, Gemma 3's, and a template using what chat
templates use (tools as JSON, namespaces, loop controls, documents, reasoning, {% generation %}, errors)."""

from __future__ import annotations

import copy
import dataclasses

import jinja2
import pytest
from transformers import AutoTokenizer

from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer
from pagellm.tokenization.chat_render import render_chat

TOOL_TEMPLATE = """{%- set ns = namespace(system='', turns=0) -%}
{%- if messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}{%- endif -%}
{{ bos_token }}<|system|>{{ ns.system }} (year {{ strftime_now('%Y')[:2] }}xx)
{%- if tools %}
Tools:
{% for tool in tools %}{{ tool | tojson(indent=2) }}
{% endfor %}{%- endif %}
{%- if documents %}{% for d in documents %}[doc {{ loop.index }}: {{ d.title }}] {{ d.text }}
{% endfor %}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
{%- set ns.turns = ns.turns + 1 %}
<|{{ m.role }}|>
{%- if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
{%- if m.tool_calls is defined %}{% for call in m.tool_calls %}<call>{{ call.function | tojson }}</call>{% endfor %}{% endif %}
{%- if ns.turns > 20 %}{% break %}{% endif %}
<|end|>
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}
{{- dict(a=1) | tojson }}{{ extra_flag | default('') }}"""

# Block tags on indented lines of their own: trim_blocks and lstrip_blocks decide its whitespace.
INDENTED_TEMPLATE = """{% for m in messages %}
    {% if m.role == 'user' %}
    User: {{ m.content }}
    {% else %}
        {% if m.content %}
    Other ({{ m.role }}): {{ m.content }}
        {% endif %}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    Assistant:
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, é 漢",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi", "name": None},
     {"role": "assistant", "content": "Hello! ", "reasoning": "they greet"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny", "tool_call_id": "1"}],
]


@pytest.fixture(scope="module")
def compact():
    return load_gguf_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def fast(compact):
    return AutoTokenizer.from_pretrained(str(compact.source_directory))


def _templates(compact) -> list[str]:
    templates = [compact.chat_template, TOOL_TEMPLATE, INDENTED_TEMPLATE]
    from tests.test_gguf_gemma3 import gemma3_270m_path

    gemma_template = load_gguf_tokenizer(gemma3_270m_path()).chat_template
    if gemma_template is not None:
        templates.append(gemma_template)
    return templates


def _both(fast, template, conversation, **options):
    """(transformers' text or its exception, ours or its exception)."""
    results = []
    for render in (lambda: fast.apply_chat_template(copy.deepcopy(conversation), chat_template=template,
                                                    tokenize=False, **copy.deepcopy(options)),
                   lambda: render_chat(template, copy.deepcopy(conversation), fast.special_tokens_map,
                                       **copy.deepcopy(options))):
        try:
            results.append(render())
        except Exception as error:  # noqa: BLE001 - the two must fail alike
            results.append((type(error), str(error)))
    return results


def test_templates_render_as_transformers_renders_them(compact, fast):
    for template in _templates(compact):
        for conversation in CONVERSATIONS:
            for options in ({}, {"add_generation_prompt": True}, {"tools": TOOLS, "extra_flag": "!"},
                            {"documents": [{"title": "T", "text": "body"}], "enable_thinking": False}):
                theirs, ours = _both(fast, template, conversation, **options)
                assert ours == theirs, (template[:60], conversation, options)


def test_continue_final_message_as_transformers(fast):
    conversations = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is "}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Par"}]}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "reasoning_content": "Let me"}],
    ]
    content_loop = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
                    "{% for b in m.content %}{{ b.text }}{% endfor %}{% endif %}</{{ m.role }}>{% endfor %}")
    for template in (TOOL_TEMPLATE, content_loop):
        for conversation in conversations:
            for field in (True, "reasoning_content", "missing"):
                theirs, ours = _both(fast, template, conversation, continue_final_message=field)
                assert ours == theirs, (template[:40], conversation, field)
    theirs, ours = _both(fast, TOOL_TEMPLATE, conversations[0], continue_final_message=True,
                         add_generation_prompt=True)
    assert ours[0] is ValueError and ours == theirs


def test_errors_and_the_sandbox_as_transformers(fast):
    bad_role = [{"role": "robot", "content": "x"}]
    theirs, ours = _both(fast, TOOL_TEMPLATE, bad_role)
    assert ours[0] is jinja2.exceptions.TemplateError and ours == theirs
    for escape in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}", "{{ dict.__class__ }}"):
        theirs, ours = _both(fast, escape, CONVERSATIONS[0])
        assert ours == theirs, escape


@dataclasses.dataclass
class Message:
    role: str
    content: str


def test_the_engine_tokenizer_renders_without_becoming_a_transformers_one(compact, fast):
    tokenizer = copy.deepcopy(compact)
    for conversation in CONVERSATIONS:
        assert tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == \
            fast.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert tokenizer._full is None
    # What it does not render itself (message objects, token ids) the transformers tokenizer does.
    objects = [Message("user", "hello")]
    assert tokenizer.apply_chat_template(objects, tokenize=False) == fast.apply_chat_template(objects, tokenize=False)
    assert tokenizer._full is not None
    assert tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=False) == \
        fast.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=False)
