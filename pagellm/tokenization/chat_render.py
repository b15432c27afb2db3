"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` renders them, without
importing transformers: the same sandboxed Jinja environment (trimmed blocks, loop controls, `{% generation %}`,
its `tojson`, `raise_exception`, `strftime_now`, `dict` and `namespace`), the same inputs (messages without their
None fields, reasoning under its three names, the tokenizer's named special tokens, the caller's variables) and
the same `continue_final_message`. Calls it does not take (batches, message objects, tools as functions, a dict of
templates) return None, and the caller renders them through transformers. tests/test_chat_render.py holds it equal
to transformers on real templates."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

# The names a message's reasoning is given under; templates read the first (transformers' _REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _NotPlain(Exception):
    """An input holding something other than JSON data: left to transformers, which converts such objects."""


def render_chat(template: str, conversation: list, special_tokens: dict[str, str], *, tools: list | None = None,
                documents: list | None = None, add_generation_prompt: bool = False,
                continue_final_message: bool | str = False, **variables: Any) -> str | None:
    """The text of one conversation (a list of message dicts) under `template`, or None where the call is one this
    module leaves to transformers."""
    if not isinstance(conversation, list) or not conversation or not all(isinstance(m, dict) for m in conversation):
        return None
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible. Use "
                         "continue_final_message when you want the model to continue the final message, and "
                         "add_generation_prompt when you want to add a header that will prompt it to start a new "
                         "assistant message instead.")
    try:
        messages = [{key: _plain(value) for key, value in message.items() if value is not None}
                    for message in conversation]
        tools, documents, variables = _plain(tools), _plain(documents), _plain(variables)
    except _NotPlain:
        return None
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        return None  # functions, which transformers turns into JSON schemas, or what it refuses
    if documents is not None and not all(isinstance(document, dict) for document in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    messages = _alias_reasoning(messages)
    final = None
    if continue_final_message:
        final = _tag_final_message(messages, template, continue_final_message)
    text = _compiled(template).render(messages=messages, tools=tools, documents=documents,
                                      add_generation_prompt=add_generation_prompt, **{**special_tokens, **variables})
    return _cut_at_final_message(text, final) if final is not None else text


def _plain(value: Any) -> Any:
    """`value` as the plain JSON data the template sees (str/int/float subclasses as their base type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    raise _NotPlain(type(value).__name__)


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    aliased = []
    for message in messages:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tag_final_message(messages: list[dict], template: str, field: bool | str) -> str:
    """Marks the end of the final message's `field` (content unless named), so that the rendered text can be cut
    there; returns the message's text."""
    field = field if isinstance(field, str) else "content"
    final = messages[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [name for name in _REASONING_FIELDS if messages[-1].get(name) == final]
    if not any(name in template for name in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         "chat_template")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final "
                         "message!")
    for name in fields:
        messages[-1][name] = messages[-1][name] + _CONTINUE_TAG
    return final


def _cut_at_final_message(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template! This can happen if the chat template deletes portions of the "
                         "final message. Please verify the chat template and final message in your chat to ensure "
                         f"they are compatible.Final message to continue: {final.strip()}\nRendered chat:\n{text}")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _body(caller) -> str:
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # Jinja's own escapes HTML characters, which a prompt must not have.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(form: str) -> str:
        return datetime.now().strftime(form)

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` without the class itself, which a template could climb from."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """Jinja's namespace refusing underscore names, which lead to the interpreter's internals."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                               namespace=TemplateNamespace)
    return environment.from_string(template)
