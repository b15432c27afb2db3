"""How OpenAI and vLLM clients ask for structured output, as StructuredOutputsParams: response_format,
vLLM's structured_outputs and guided_* fields, and tools with tool_choice "required" or a named function;
tool_choice "auto" instead leaves the output free and reads the calls out of it (tool_parsers/)."""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

from pagellm.entrypoints.openai.errors import bad_request
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser, openai_tool_call
from pagellm.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class NamedStructuredOutputs(StructuredOutputsParams):
    """A request's constraint and the request field it came from, which a 400 about its grammar names (plain
    attributes, not dataclass fields: the constraint's fields, as dataclasses.asdict lists them, are vLLM's)."""

    param: str = "structured_outputs"
    name: str = "structured_outputs"


def requested_structured_outputs(request) -> StructuredOutputsParams | None:
    """The one structured-output constraint a request asks for (400 if it asks for two). Its grammar is
    checked and parsed by `compiled_grammar`, off the event loop, before any streaming starts."""
    asked: list[tuple[str, StructuredOutputsParams]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        asked.append(("response_format", _from_response_format(response_format)))
    if request.structured_outputs is not None:
        asked.append(("structured_outputs", _build("structured_outputs", request.structured_outputs)))
    for field_name, kind in _GUIDED.items():
        value = getattr(request, field_name)
        if value is not None:
            asked.append((field_name, _build(field_name, {kind: value})))
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise bad_request(f"{' and '.join(names)} both constrain the output; pass only one of them.", names[1])
    if not asked:
        return None
    param, structured = asked[0]
    return named_constraint(structured, param, f"{param}.{structured.kind}" if param == "structured_outputs" else param)


async def compiled_grammar(engine, structured: StructuredOutputsParams | None) -> Future | None:
    """What to set as SamplingParams.structured_grammar (None without a constraint): the compiled grammar's
    Future, once the grammar has been parsed in the grammar threads while this event loop kept serving. A 400
    naming the request field if the grammar is over a size limit, refused by xgrammar, or not parsed within
    structured_outputs_timeout. A grammar seen before is not parsed again. `engine`: the AsyncLLMEngine."""
    if structured is None:
        return None
    param = getattr(structured, "param", "structured_outputs")
    name = getattr(structured, "name", f"structured_outputs.{structured.kind}")
    try:
        return await engine.engine.grammar_compiler.submit(structured, name).wait_async()
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def named_constraint(structured: StructuredOutputsParams, param: str, name: str) -> NamedStructuredOutputs:
    """The constraint, with the request field a 400 about its grammar names (`param`) and how its text names it."""
    named = NamedStructuredOutputs(**{f.name: getattr(structured, f.name) for f in dataclass_fields(structured)})
    named.param, named.name = param, name
    return named


def _build(param: str, fields: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"{param}: {exc}", param) from None


def _from_response_format(response_format) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.type == "json_schema":
        spec = response_format.json_schema
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request('response_format.json_schema must be {"name": ..., "schema": {...}}, with the JSON '
                              "schema under \"schema\".", "response_format.json_schema")
        return StructuredOutputsParams(json=schema)
    raise bad_request(f"response_format.type={response_format.type!r} is not supported; allowed: 'text', "
                      "'json_object', 'json_schema'.", "response_format.type")


# ---- tools ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools make of its output. tool_choice "required" or named: a constrained JSON
    (`structured`) that becomes tool_calls: the arguments of `named` alone, or a list of {"name", "parameters"}
    calls. tool_choice "auto": free text, in which `parser` finds the calls the model chose to make."""

    structured: StructuredOutputsParams | None
    named: str | None = None
    parser: ToolParser | None = None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict | None,
               auto_tool_parser: str | None = None) -> ToolPlan | None:
    """auto_tool_parser: the server's --tool-call-parser when --enable-auto-tool-choice is on, else None."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request(f"tool_choice={tool_choice!r} needs tools; pass tools or drop tool_choice.",
                              "tool_choice")
        return None
    schemas = _tool_schemas(tools)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        if auto_tool_parser is None:
            raise bad_request(
                "tool_choice='auto' (the default with tools) needs the server started with --enable-auto-tool-choice "
                f"and --tool-call-parser NAME (the model's tool-call format, one of {sorted(TOOL_PARSERS)}); or pass "
                "tool_choice='required' or {\"type\": \"function\", \"function\": {\"name\": ...}} (the arguments "
                "are then constrained to the function's parameters), or 'none'.",
                "tool_choice", "unsupported_parameter")
        return ToolPlan(None, parser=get_tool_parser(auto_tool_parser))
    if tool_choice == "required":
        calls = {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, schema in schemas.items()
        ]}
        array = {"type": "array", "minItems": 1, "items": calls}
        return ToolPlan(named_constraint(StructuredOutputsParams(json=array), "tools", "tools"))
    name = _named_choice(tool_choice)
    if name not in schemas:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                          f"{sorted(schemas)}.", "tool_choice")
    return ToolPlan(named_constraint(StructuredOutputsParams(json=schemas[name]), "tools", f"tools.{name}.parameters"),
                    named=name)


def _named_choice(tool_choice: object) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise bad_request(f"tool_choice={tool_choice!r:.120} is not supported; allowed: 'none', 'required' or "
                          '{"type": "function", "function": {"name": ...}}.', "tool_choice")
    return name


def _tool_schemas(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """Function name -> its parameters schema (an empty object when it has none)."""
    schemas: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools.{index} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"parameters\": {...}}}}.", f"tools.{index}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad_request(f"tools.{index}.function.parameters must be a JSON schema object.",
                              f"tools.{index}.function.parameters")
        schemas[name] = parameters
    return schemas


def tool_calls_of(plan: ToolPlan, text: str) -> list[dict]:
    """OpenAI's tool_calls from the constrained output (arguments as JSON text)."""
    if plan.named is not None:
        return [openai_tool_call(plan.named, text)]
    calls = json.loads(text)
    return [openai_tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in calls]


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template writes a tool list into the prompt at all (some, like SmolLM2's, ignore it)."""
    conversation = [{"role": "user", "content": "hi"}]
    probe = [{"type": "function", "function": {"name": "probe_tool_name", "parameters": {"type": "object"}}}]
    try:
        with_tools = tokenizer.apply_chat_template(conversation, tools=probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses tools certainly does not render them
        return False
    return "probe_tool_name" in with_tools
