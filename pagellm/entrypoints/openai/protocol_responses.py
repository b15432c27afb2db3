"""POST /v1/responses: its request body (the fields of OpenAI's Responses API that vLLM's server takes, and
vLLM's sampling extensions), and how its input items become the chat messages a template renders.

What this server cannot do is refused with a 400 naming the field (built-in tools, reasoning items and
settings, background mode, prompt templates, conversations, images and files), never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagellm.entrypoints.openai.errors import bad_request, not_supported
from pagellm.entrypoints.openai.protocol import MAX_LOGPROBS, SamplingFields, StrictModel

# The one `include` value this server answers: log-probabilities of the output text.
INCLUDE_LOGPROBS = "message.output_text.logprobs"

# Input item types of the Responses API that carry something only OpenAI's own models or tools produce.
_UNSUPPORTED_ITEMS = {
    "reasoning": "reasoning items (this server runs no reasoning parser)",
    "item_reference": "item references (send the item itself, or chain with previous_response_id)",
    "file_search_call": "built-in tool calls", "web_search_call": "built-in tool calls",
    "computer_call": "built-in tool calls", "computer_call_output": "built-in tool calls",
    "code_interpreter_call": "built-in tool calls", "image_generation_call": "built-in tool calls",
    "local_shell_call": "built-in tool calls", "local_shell_call_output": "built-in tool calls",
    "mcp_call": "built-in tool calls", "mcp_list_tools": "built-in tool calls",
    "mcp_approval_request": "built-in tool calls", "mcp_approval_response": "built-in tool calls",
    "custom_tool_call": "custom tools", "custom_tool_call_output": "custom tools",
}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")


class ResponseTextConfig(StrictModel):
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict", "description"}.
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(StrictModel):
    """The body of POST /v1/responses. Defaults are OpenAI's (store=true, tool_choice "auto")."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: ResponseTextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncation: Literal["auto", "disabled"] = "disabled"
    # Carried into the response as given; they do not change the output.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    # Counts built-in tool calls only, which this server has none of.
    max_tool_calls: int | None = Field(default=None, ge=1)
    # Accepted at their neutral value only (see check_supported).
    background: bool = False
    reasoning: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or [])

    def sampling_fields(self) -> SamplingFields:
        """The fields the other routes sample with, so that one function turns them into SamplingParams."""
        values = {
            "model": self.model, "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "stop": self.stop, "seed": self.seed, "logit_bias": self.logit_bias, "user": self.user,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
            "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        # Validated here already; fields SamplingFields has beyond these keep their defaults.
        return SamplingFields.model_construct(**values)


def check_supported(request: ResponsesRequest) -> None:
    """400 for what the request asks and this server cannot do."""
    if request.background:
        raise bad_request("background=true is not supported: this server answers a response in the request that "
                          "creates it (stream=true gives its events as they come); omit background.", "background",
                          "unsupported_parameter")
    reasoning = {key: value for key, value in (request.reasoning or {}).items() if value is not None}
    if reasoning:
        raise bad_request(f"reasoning={reasoning!r:.120} is not supported: this server has no reasoning models' "
                          "effort or summary settings; omit reasoning.", "reasoning", "unsupported_parameter")
    if request.prompt is not None:
        raise bad_request("prompt (a stored prompt template) is not supported; send the text as instructions and "
                          "input.", "prompt", "unsupported_parameter")
    if request.conversation is not None:
        raise bad_request("conversation (the Conversations API) is not supported; chain responses with "
                          "previous_response_id, or send the whole conversation as input.", "conversation",
                          "unsupported_parameter")
    if request.truncation != "disabled":
        raise not_supported("truncation", request.truncation)
    for index, value in enumerate(request.include or []):
        if value != INCLUDE_LOGPROBS:
            raise bad_request(f"include.{index}={value!r} is not supported; this server can include only "
                              f"{INCLUDE_LOGPROBS!r}.", f"include.{index}", "unsupported_parameter")
    if request.text is not None and request.text.verbosity not in (None, "medium"):
        raise bad_request(f"text.verbosity={request.text.verbosity!r} is not supported: this server cannot make a "
                          "model more or less verbose; omit it.", "text.verbosity", "unsupported_parameter")


# ---- input items -> chat messages ----------------------------------------------------------------


def item_messages(items: list[dict[str, Any]], param: str, messages: list[dict] | None = None) -> list[dict]:
    """`messages` extended with the chat messages of input items: messages, function calls (folded into the
    assistant message before them, as chat templates expect) and function call outputs (tool messages)."""
    messages = [] if messages is None else messages
    for index, item in enumerate(items):
        where = f"{param}.{index}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _fold_call(messages, _function_call(item, where))
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", where),
                             "content": _content_text(item.get("output"), f"{where}.output")})
        elif kind in _UNSUPPORTED_ITEMS:
            raise bad_request(f"{where}.type={kind!r}: {_UNSUPPORTED_ITEMS[kind]} are not supported; this server "
                              "takes message, function_call and function_call_output items.", f"{where}.type",
                              "unsupported_parameter")
        else:
            raise bad_request(f"{where} is not an input item (type={kind!r}); allowed: a message ({{\"role\", "
                              "\"content\"}), function_call or function_call_output.", f"{where}.type")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise bad_request(f"{where}.role={role!r} is not a role; allowed: {list(_MESSAGE_ROLES)}.", f"{where}.role")
    return {"role": role, "content": _content_text(item.get("content"), f"{where}.content")}


def _content_text(content: object, where: str) -> str:
    """A message's content (text, or a list of text parts, joined by newlines as the chat route joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be text or a list of input_text parts.", where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind)
        if key is None:
            if kind in ("input_image", "input_file", "input_audio"):
                raise bad_request(f"{where}.{index}.type={kind!r}: this server serves text models; send text parts "
                                  "(input_text) only.", f"{where}.{index}.type", "unsupported_parameter")
            raise bad_request(f"{where}.{index} must be a text part, {{\"type\": \"input_text\", \"text\": ...}}.",
                              f"{where}.{index}")
        texts.append(_text_field(part, key, f"{where}.{index}"))
    return "\n".join(texts)


def _text_field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} is required and must be a string (got {value!r:.60}).", f"{where}.{key}")
    return value


def _function_call(item: dict, where: str) -> dict:
    """OpenAI's chat form of a call: what chat templates render an assistant's calls from."""
    return {"id": _text_field(item, "call_id", where), "type": "function",
            "function": {"name": _text_field(item, "name", where),
                         "arguments": _text_field(item, "arguments", where)}}


def _fold_call(messages: list[dict], call: dict) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


# ---- tools ---------------------------------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]]) -> list[dict]:
    """The Responses API's flat function tools ({"type": "function", "name", "parameters"}) in the chat form
    that chat templates and the tool planner read."""
    converted = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools.{index}.type={kind!r} is not supported: this server runs function tools only "
                              "(no built-in web search, file search, code interpreter, computer use, image "
                              "generation, MCP, shell or custom tools).", f"tools.{index}.type",
                              "unsupported_parameter")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools.{index}.name is required: a function tool is {{\"type\": \"function\", \"name\": "
                              "..., \"parameters\": {...}}.", f"tools.{index}.name")
        function = {"name": name}
        for key, kind_of, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object")):
            value = tool.get(key)
            if value is not None and not isinstance(value, kind_of):
                raise bad_request(f"tools.{index}.{key} must be {what}.", f"tools.{index}.{key}")
            if value is not None:
                function[key] = value
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(tool_choice: str | dict[str, Any]) -> str | dict:
    """The Responses API's tool_choice in the chat form: {"type": "function", "name": N} names a function."""
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if kind == "function" and isinstance(tool_choice.get("name"), str):
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    if kind is not None and kind != "function":
        raise bad_request(f"tool_choice={tool_choice!r:.120} is not supported: this server runs function tools "
                          "only.", "tool_choice", "unsupported_parameter")
    raise bad_request(f"tool_choice={tool_choice!r:.120} is not a tool choice; allowed: 'none', 'auto', "
                      "'required' or {\"type\": \"function\", \"name\": ...}.", "tool_choice")
