"""A chat template given by the user (vLLM's --chat-template, LLM(chat_template=...)): a file or the text itself."""

from __future__ import annotations

import os

from pagellm.config import ArgumentValueError


def load_chat_template(chat_template: str | None) -> str | None:
    """vLLM's reading of --chat-template: a file's text, or the template itself when it looks like Jinja."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as file:
            return file.read()
    if any(char in chat_template for char in "{}\n"):
        return chat_template
    raise ArgumentValueError(f"chat_template={chat_template!r} is neither a file nor a Jinja template; pass the path "
                             "of a template file, or the template text itself.")
