"""The server's own arguments (vLLM's FrontendArgs, with pagellm's beside them) and the `pagellm serve` parser,
made from this table and AsyncEngineArgs' as vLLM's `make_arg_parser` makes it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from pagellm.config import ArgumentValueError, arg, check_supported, default_only, field_default, no_effect
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.entrypoints.chat_template import load_chat_template
from pagellm.entrypoints.arg_parser import FlexibleArgumentParser, add_table_arguments, flag_of
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS

FRONTEND = "Frontend"
# `pagellm serve` drains running requests for this long on SIGTERM (vLLM's EngineArgs default, 0, aborts them).
SERVE_SHUTDOWN_TIMEOUT = 10.0
# What the server takes from these arguments, under the same names (ServerConfig in openai/serving.py).
SERVER_CONFIG_FIELDS = (
    "api_key", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "allowed_origins", "allowed_methods",
    "allowed_headers", "allow_credentials", "root_path", "disable_fastapi_docs", "disable_uvicorn_access_log",
    "h11_max_incomplete_event_size", "h11_max_header_count", "header_read_timeout", "body_read_timeout",
    "enable_server_load_tracking", "enable_scale_out", "responses_store_max_entries", "responses_store_max_bytes",
    "trust_request_chat_template", "response_role", "lora_modules",
)
_NOT_IN_RESPONSES = "pagellm's responses do not carry it"


def _frontend(default=dataclasses.MISSING, **kwargs):
    return arg(default, group=FRONTEND, **kwargs)


def _frontend_default_only(default=dataclasses.MISSING, **kwargs):
    return default_only(default, group=FRONTEND, **kwargs)


def _frontend_no_effect(default=dataclasses.MISSING, **kwargs):
    return no_effect(default, group=FRONTEND, **kwargs)


@dataclass
class FrontendArgs:
    """The OpenAI-compatible server's arguments: every flag of vLLM's FrontendArgs and `vllm serve`'s own,
    treated as the engine table's rows are (IMPLEMENTED, NO_EFFECT, DEFAULT_ONLY)."""

    # `vllm serve`'s own flags.
    headless: bool = _frontend_default_only(False, why="pagellm's engine runs inside its server")
    api_server_count: int | None = _frontend_default_only(None, kind="int", accepted=(1,), flags=("-asc",),
                                                          why="pagellm runs one API server process")
    config: str | None = _frontend(None, kind="optional_str",
                                   help="a YAML file of flags (name: value), read before the command line's")
    grpc: bool = _frontend_default_only(False, why="pagellm serves HTTP")
    # vLLM's FrontendArgs.
    lora_modules: list | None = _frontend(None, kind="list",
                                          help="LoRA adapters served under their names (with --enable-lora): "
                                               'name=path or {"name": ..., "path": ..., "base_model_name": ...}')
    chat_template: str | None = _frontend(None, kind="optional_str",
                                          help="a Jinja chat template, or a file holding one, used instead of the "
                                               "tokenizer's")
    chat_template_content_format: str = _frontend_default_only("auto", accepted=("string",),
                                                               why="pagellm renders message content as text")
    trust_request_chat_template: bool = _frontend(False, help="take a chat_template from requests (a template runs "
                                                              "as code on the server: only for trusted clients)")
    trust_request_mm_kwargs: bool = _frontend_no_effect(False)
    default_chat_template_kwargs: dict | None = _frontend_default_only(
        None, kind="json", why="pagellm passes each request's own chat_template_kwargs")
    response_role: str = _frontend("assistant", help="the role of a chat reply that starts a new message "
                                                    "(add_generation_prompt)")
    return_tokens_as_token_ids: bool = _frontend_default_only(False, why="pagellm writes logprob tokens as text")
    enable_auto_tool_choice: bool = _frontend(False, help='answer tool_choice "auto" (the default with tools): the '
                                                          "model calls tools in its own format, which "
                                                          "--tool-call-parser reads")
    exclude_tools_when_tool_choice_none: bool = _frontend_default_only(
        False, why="pagellm renders the request's tools whatever its tool_choice")
    tool_call_parser: str | None = _frontend(None, kind="optional_str", choices=tuple(sorted(TOOL_PARSERS)),
                                             help="the model family's tool-call format: hermes (Qwen2.5/Qwen3, "
                                                  "Hermes, SmolLM3), llama3_json (Llama 3.1/3.2), mistral")
    tool_parser_plugin: str = _frontend_default_only("", why="pagellm loads no tool parser plugins")
    tool_strict_level: str = _frontend_default_only("auto", why="pagellm constrains tool calls as each request asks")
    tool_server: str | None = _frontend_default_only(None, kind="optional_str",
                                                     why="pagellm runs no built-in tool servers")
    max_log_len: int | None = _frontend_no_effect(None, kind="int")
    enable_prompt_tokens_details: bool = _frontend_default_only(False, why=_NOT_IN_RESPONSES)
    enable_per_request_metrics: bool = _frontend_default_only(False, why=_NOT_IN_RESPONSES)
    enable_server_load_tracking: bool = _frontend(False, help="count the generating requests in flight, read at "
                                                                "GET /load")
    enable_force_include_usage: bool = _frontend_default_only(False, why="pagellm sends usage as each request asks")
    sse_keep_alive_interval: int = _frontend_default_only(0, why="pagellm sends no keep-alive comments")
    enable_tokenizer_info_endpoint: bool = _frontend_default_only(False, why="pagellm has no /tokenizer_info")
    enable_log_outputs: bool = _frontend_no_effect(False)
    enable_log_deltas: bool = _frontend_no_effect(True)
    cohere_is_reasoning_model: bool = _frontend_no_effect(True)
    cohere_format: str = _frontend_no_effect("cmd4")
    anthropic_disabled_thinking_effort: str = _frontend_no_effect("auto")
    log_error_stack: bool = _frontend_no_effect(False)
    tokens_only: bool = _frontend_default_only(False, why="pagellm serves text as well as tokens")
    enable_scale_out: bool = _frontend(False, help="answer the /render endpoints (the token ids and sampling "
                                                     "parameters a request would run with); else they answer 403")
    fingerprint_mode: str = _frontend_default_only("full", why="pagellm's system_fingerprint is its own")
    fingerprint_value: str | None = _frontend_default_only(None, kind="optional_str",
                                                           why="pagellm's system_fingerprint is its own")
    # Loopback by default (vLLM's None binds every interface): exposing a model should be a decision.
    host: str | None = _frontend("127.0.0.1", kind="optional_str", help="address to bind (default: 127.0.0.1)")
    port: int = _frontend(8000, help="port to bind (default: 8000)")
    grpc_port: int | None = _frontend_default_only(None, kind="int", why="pagellm serves HTTP")
    data_parallel_supervisor_port: int = _frontend_no_effect(9256)
    dp_supervisor_probe_interval_s: float = _frontend_no_effect(5.0)
    dp_supervisor_probe_timeout_s: float = _frontend_no_effect(5.0)
    dp_supervisor_probe_failure_threshold: int = _frontend_no_effect(3)
    uds: str | None = _frontend_default_only(None, kind="optional_str", why="pagellm listens on --host:--port")
    uvicorn_log_level: str = _frontend("info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                                       help="uvicorn's log level")
    disable_uvicorn_access_log: bool = _frontend(False, help="no access log line per request")
    disable_access_log_for_endpoints: str | None = _frontend_no_effect(None, kind="optional_str")
    allow_credentials: bool = _frontend(False, help="CORS: allow credentials")
    allowed_origins: list[str] = _frontend(factory=list, kind="json_list",
                                           help='CORS: origins allowed, as JSON, e.g. \'["https://a.example"]\' '
                                                "(default: none)")
    allowed_methods: list[str] = _frontend(factory=lambda: ["*"], kind="json_list",
                                           help='CORS: methods allowed, as JSON (default: ["*"])')
    allowed_headers: list[str] = _frontend(factory=lambda: ["*"], kind="json_list",
                                           help='CORS: headers allowed, as JSON (default: ["*"])')
    api_key: list[str] | None = _frontend(None, kind="list",
                                          help="require 'Authorization: Bearer KEY' with one of these keys on API "
                                               "routes (default: $PAGELLM_API_KEY, then $VLLM_API_KEY)")
    ssl_keyfile: str | None = _frontend(None, kind="optional_str", help="TLS: the key file")
    ssl_certfile: str | None = _frontend(None, kind="optional_str", help="TLS: the certificate file")
    ssl_ca_certs: str | None = _frontend(None, kind="optional_str", help="TLS: CA certificates of clients")
    enable_ssl_refresh: bool = _frontend_default_only(False, why="pagellm reads the TLS files once, at start-up")
    ssl_cert_reqs: int = _frontend(0, help="TLS: client certificates (0 none, 1 optional, 2 required)")
    ssl_ciphers: str | None = _frontend_default_only(None, kind="optional_str",
                                                     why="pagellm uses Python's default TLS ciphers")
    root_path: str | None = _frontend(None, kind="optional_str",
                                      help="the path prefix a proxy serves this server under, e.g. /llm")
    middleware: list[str] = _frontend_default_only(factory=list, kind="append",
                                                   why="pagellm adds no ASGI middleware of the user's")
    enable_request_id_headers: bool = _frontend_default_only(False, why="pagellm sends no X-Request-Id header")
    disable_fastapi_docs: bool = _frontend(False, help="no /docs, /redoc or /openapi.json")
    h11_max_incomplete_event_size: int = _frontend(4194304, help="most bytes of a request's head (default: 4 MiB)")
    h11_max_header_count: int = _frontend(256, help="most headers of a request (default: 256)")
    enable_offline_docs: bool = _frontend_no_effect(False)
    enable_flash_late_interaction: bool = _frontend_no_effect(True)
    # pagellm's own.
    max_request_body_bytes: int | None = _frontend(None, kind="size", vllm=False,
                                                   help="refuse bodies larger than this with HTTP 413, e.g. 4MiB "
                                                        "(default: 64 bytes per token of --max-model-len, at least "
                                                        "1 MiB)")
    header_read_timeout: float = _frontend(30.0, vllm=False,
                                           help="seconds a request's headers may take to arrive before HTTP 408")
    body_read_timeout: float = _frontend(60.0, vllm=False,
                                         help="seconds a request's body may take to arrive before HTTP 408")
    responses_store_max_entries: int = _frontend(1000, vllm=False,
                                                 help="/v1/responses kept for previous_response_id and GET, least "
                                                      "recently used dropped first (0 keeps none)")
    responses_store_max_bytes: int = _frontend(64 << 20, kind="size", vllm=False,
                                               help="the most JSON bytes those stored responses may take, e.g. 256MiB")

    def __post_init__(self) -> None:
        check_supported(self)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ArgumentValueError(f"port={self.port!r} is out of range; allowed: 0..65535 (--port).")
        for name in ("header_read_timeout", "body_read_timeout"):
            if not getattr(self, name) > 0:
                raise ArgumentValueError(f"{name}={getattr(self, name)!r} is out of range; allowed: > 0 seconds "
                                         f"({flag_of(name)}).")
        if self.responses_store_max_entries < 0:
            raise ArgumentValueError(f"responses_store_max_entries={self.responses_store_max_entries!r} is out of "
                                     "range; allowed: >= 0 (0 keeps no responses) (--responses-store-max-entries).")
        if self.max_request_body_bytes is not None and not self.max_request_body_bytes > 0:
            raise ArgumentValueError(f"max_request_body_bytes={self.max_request_body_bytes!r} is out of range; "
                                     "allowed: > 0 bytes (--max-request-body-bytes).")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                raise ArgumentValueError(f"{name}={value!r} must be a JSON list of strings, e.g. '[\"*\"]' "
                                         f"({flag_of(name)}).")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ArgumentValueError(f"ssl_cert_reqs={self.ssl_cert_reqs!r} is out of range; allowed: 0 (none), "
                                     "1 (optional), 2 (required) (--ssl-cert-reqs).")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ArgumentValueError("--enable-auto-tool-choice needs --tool-call-parser NAME, the model's tool-call "
                                     f"format; NAME is one of {sorted(TOOL_PARSERS)}.")


def make_arg_parser(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    """`pagellm serve`'s flags: the model (positional, or --model), FrontendArgs', then AsyncEngineArgs'."""
    parser.add_argument("model_tag", nargs="?", default=None,
                        help="the model: a local HF directory or .gguf file, or a hub id in the local Hugging Face "
                             "cache (same as --model)")
    add_table_arguments(parser, FrontendArgs)
    # One flag for a name both tables have (as vLLM's parser has one --tokens-only).
    add_table_arguments(parser, AsyncEngineArgs, skip=[f.name for f in fields(FrontendArgs)],
                        defaults={"shutdown_timeout": SERVE_SHUTDOWN_TIMEOUT})
    return parser


def frontend_args_from(namespace) -> FrontendArgs:
    return FrontendArgs(**{f.name: getattr(namespace, f.name) for f in fields(FrontendArgs)})


def engine_args_from(namespace) -> AsyncEngineArgs:
    """The engine's arguments from parsed flags; the positional model wins over --model where both are given."""
    values = {f.name: getattr(namespace, f.name) for f in fields(AsyncEngineArgs) if hasattr(namespace, f.name)}
    model_tag = getattr(namespace, "model_tag", None)
    if model_tag is not None:
        if values.get("model") not in (None, model_tag):
            raise ArgumentValueError(f"the model is given twice, as {model_tag!r} and --model {values['model']!r}; "
                                     "pass one.")
        values["model"] = model_tag
    return AsyncEngineArgs(**values)


def server_config_kwargs(frontend: FrontendArgs, server_fields: set[str]) -> dict:
    """FrontendArgs' values for the server, by ServerConfig's names. A server without one of those fields
    cannot do what a non-default value asks: that is refused here, naming the flag."""
    kwargs, missing = {}, []
    for name in SERVER_CONFIG_FIELDS:
        value = getattr(frontend, name)
        if name in server_fields:
            kwargs[name] = value
        elif value != field_default(next(f for f in fields(FrontendArgs) if f.name == name)):
            missing.append(flag_of(name))
    if missing:
        raise ArgumentValueError(f"this server does not take {', '.join(missing)}; leave them unset.")
    return kwargs


__all__ = ["FrontendArgs", "make_arg_parser", "engine_args_from", "frontend_args_from", "load_chat_template",
           "server_config_kwargs", "SERVER_CONFIG_FIELDS"]
