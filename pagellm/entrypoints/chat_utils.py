"""Chat prompts as vLLM renders them, for `LLM.chat` and the server: a chat template (one passed with the call, the
server's --chat-template, or the model's), the template's keyword arguments, and how message content reaches the
template ("string": text parts joined; "openai": the list of parts, as OpenAI sends them).

Errors are ValueErrors naming the argument; the server turns them into 400s."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ContentFormat = Literal["auto", "string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")

# apply_chat_template's own parameters, which chat_template_kwargs must not set: a template is code that runs where
# it renders (nested loops render for hours), so it comes as chat_template or not at all; `tokenize` would change
# what the call returns. vLLM refuses both too.
RESERVED_TEMPLATE_KWARGS = ("chat_template", "tokenize")


def reserved_template_kwarg(kwargs: Mapping[str, Any]) -> str | None:
    """The first of apply_chat_template's own parameters among a call's template kwargs, if any."""
    return next((name for name in RESERVED_TEMPLATE_KWARGS if name in kwargs), None)


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs={kwargs!r:.80} must be a dict of the chat template's variables.")
    name = reserved_template_kwarg(kwargs)
    if name is not None:
        raise ValueError(f"chat_template_kwargs contains {name!r}, which is not a template variable; pass a template "
                         "as chat_template, and leave tokenizing to LLM.chat.")
    return dict(kwargs)


def template_variables(template_kwargs: Mapping[str, Any] | None, *, add_generation_prompt: bool,
                       continue_final_message: bool, documents: Sequence[Mapping] | None = None,
                       reasoning_effort: str | None = None) -> dict[str, Any]:
    """The caller's template kwargs overlaid with the named arguments that are set (vLLM's merge_kwargs): what the
    request states in its own fields wins over the same name in chat_template_kwargs."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=true continues the last message and add_generation_prompt=true "
                         "starts a new one; pass add_generation_prompt=false with continue_final_message.")
    variables = dict(template_kwargs or {})
    variables["add_generation_prompt"] = add_generation_prompt
    variables["continue_final_message"] = continue_final_message
    if documents is not None:
        variables["documents"] = list(documents)
    if reasoning_effort is not None:
        variables["reasoning_effort"] = reasoning_effort
        # Templates that gate thinking behind enable_thinking (off by default in some) turn it on, as vLLM does.
        variables.setdefault("enable_thinking", reasoning_effort != "none")
    return variables


def render_chat(tokenizer, conversation: list[dict], *, chat_template: str | None = None,
                tools: list[dict] | None = None, variables: Mapping[str, Any]) -> str:
    """The prompt text of a conversation (special tokens the template writes included)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass chat_template (or start the server with "
                         "--chat-template).")
    text = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template, tokenize=False,
                                         **variables)
    if not isinstance(text, str):
        raise ValueError(f"the chat template rendered a {type(text).__name__}, not text; check chat_template_kwargs.")
    return text


def resolve_content_format(content_format: str, chat_template: str | None, tokenizer) -> str:
    """"auto" becomes "openai" for a template that loops over a message's content parts, else "string"."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format={content_format!r}; allowed: {list(CONTENT_FORMATS)}.")
    if content_format != "auto":
        return content_format
    template = chat_template or getattr(tokenizer, "chat_template", None)
    return "openai" if isinstance(template, str) and _loops_over_content(template) else "string"


def conversation_message(message: Mapping[str, Any], content_format: str) -> dict:
    """A message as the chat template reads it: content in the chosen format (a missing one empty), and tool
    calls' arguments as objects (OpenAI sends them as JSON text; transformers' templates expect objects)."""
    entry = {key: value for key, value in message.items() if value is not None}
    content = message.get("content")
    parts = _text_parts(content)
    if content_format == "openai":
        entry["content"] = parts
    else:
        entry["content"] = "\n".join(part["text"] for part in parts)
    return _tool_call_arguments_as_objects(entry)


def _text_parts(content: object) -> list[dict]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(f"message content part {part!r:.80} is not supported; only text parts "
                                 '({"type": "text", "text": ...}) are.')
        return parts
    raise ValueError(f"message content {content!r:.80} must be a str or a list of text parts.")


def _tool_call_arguments_as_objects(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
            except ValueError:
                pass  # not JSON: the template gets the text as sent
        converted.append(call)
    return {**message, "tool_calls": converted}


@functools.lru_cache(maxsize=16)
def _loops_over_content(template: str) -> bool:
    """Whether the template has `for x in message.content` (or message['content']) inside a loop over
    `messages`: a simpler form of vLLM's detection."""
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False
    message_names = {loop.target.name for loop in ast.find_all(nodes.For)
                     if isinstance(loop.target, nodes.Name) and _names(loop.iter, "messages")}
    return any(_content_of(loop.iter, message_names) for loop in ast.find_all(nodes.For))


def _unwrap(node):
    from jinja2 import nodes

    while isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                           and isinstance(node.arg, nodes.Slice)):
        node = node.node
    return node


def _names(node, name: str) -> bool:
    from jinja2 import nodes

    node = _unwrap(node)
    return isinstance(node, nodes.Name) and node.name == name


def _content_of(node, message_names: set[str]) -> bool:
    from jinja2 import nodes

    node = _unwrap(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and isinstance(node.node, nodes.Name) and node.node.name in message_names
    if isinstance(node, nodes.Getitem):
        return (isinstance(node.arg, nodes.Const) and node.arg.value == "content"
                and isinstance(node.node, nodes.Name) and node.node.name in message_names)
    return False
