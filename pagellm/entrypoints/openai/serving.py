"""What every generating route shares: model check, prompt processing and limits, sampling parameters,
one engine request per prompt (its n choices share the prompt's blocks), and aborting it when the client
goes away.

Tokenizing and detokenizing run on a worker thread of their own, never on the event loop: a 5 MB prompt takes
seconds to tokenize, and /health and every stream must go on meanwhile."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from starlette.requests import Request

from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.engine.request_stream import RequestStream
from pagellm.entrypoints.chat_utils import (
    conversation_message,
    render_chat,
    reserved_template_kwarg,
    template_variables,
)
from pagellm.entrypoints.openai.errors import OpenAIError, bad_request, from_exception
from pagellm.core.kv_usage import KVUsage
from pagellm.entrypoints.openai.protocol import ChatMessage, PromptField, SamplingFields
from pagellm.entrypoints.openai.structured import template_renders_tools
from pagellm.lora.request import LoRARequest
from pagellm.lora.serving import LoRARegistry, parse_lora_modules
from pagellm.models.loader import ServerSamplingDefaults
from pagellm.outputs import PositionLogprobs, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams, check_text

logger = logging.getLogger(__name__)

# vLLM's header that sets a request's priority over its body's field.
PRIORITY_HEADER = "X-Vllm-Priority"


# vLLM's defaults for its --h11-max-incomplete-event-size and --h11-max-header-count.
H11_MAX_INCOMPLETE_EVENT_SIZE = 4 << 20
H11_MAX_HEADER_COUNT = 256


@dataclass
class ServerConfig:
    served_model_names: list[str]
    # What the model was loaded from (a path, or the default model's name), reported as `root`.
    model_root: str
    # Any one of these keys is accepted; None or empty: $PAGELLM_API_KEY, else $VLLM_API_KEY, else no key.
    api_key: list[str] | None = None
    # None: derived from max_model_len (see api_server.default_max_request_body_bytes).
    max_request_body_bytes: int | None = None
    # On SIGINT/SIGTERM, how long running requests may go on before their streams are ended.
    shutdown_timeout: float = 10.0
    # tool_choice "auto": the --tool-call-parser that reads the model's calls; None without
    # --enable-auto-tool-choice (then "auto" is a 400).
    auto_tool_parser: str | None = None
    # Slow clients: the seconds a request's headers may take to arrive (from the connection's opening, or the
    # end of the previous response on it), and its whole body after them; then 408 and the connection closes.
    header_read_timeout: float = 30.0
    body_read_timeout: float = 60.0
    # h11's bound on a request's head (bytes buffered before the headers end), and on the number of headers.
    h11_max_incomplete_event_size: int = H11_MAX_INCOMPLETE_EVENT_SIZE
    h11_max_header_count: int = H11_MAX_HEADER_COUNT
    # TLS: serve HTTPS with this certificate (and key, unless the certificate file holds it); ssl_cert_reqs is
    # the ssl module's verify mode for client certificates (0 none, 1 optional, 2 required, against ssl_ca_certs).
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    # CORS, as vLLM's: browsers on other origins get no access unless their origin is listed ("*": any).
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # The path prefix under which a proxy exposes the server, e.g. "/llm"; routes answer with or without it.
    root_path: str | None = None
    disable_fastapi_docs: bool = False
    disable_uvicorn_access_log: bool = False

    # GET /load counts the generating requests in flight (vLLM's --enable-server-load-tracking; else it reads 0).
    enable_server_load_tracking: bool = False
    # The /render endpoints (vLLM's --enable-scale-out; else they answer 403).
    enable_scale_out: bool = False
    # Bounds of the in-memory store of /v1/responses (previous_response_id, GET); least recently used go first.
    responses_store_max_entries: int = 1000
    responses_store_max_bytes: int = 64 << 20
    # --chat-template: the server's chat template (its text; cli.py reads a file's); None: the model's.
    chat_template: str | None = None
    # --trust-request-chat-template: take a request's chat_template (a template runs on the server: only for
    # trusted clients).
    trust_request_chat_template: bool = False
    # --response-role: the role of a chat reply when add_generation_prompt is on.
    response_role: str = "assistant"
    # --lora-modules: LoRA adapters served under their names (name=path or vLLM's JSON form; needs --enable-lora).
    lora_modules: list | None = None

    def __post_init__(self) -> None:
        if self.api_key is not None and (isinstance(self.api_key, str)
                                         or not all(isinstance(key, str) for key in self.api_key)):
            # A lone string would read as one key per character.
            raise ValueError(f"api_key={self.api_key!r:.40} must be a list of keys (--api-key KEY [KEY ...]).")
        for name in ("header_read_timeout", "body_read_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive number of seconds (--{_flag(name)}).")
        for name in ("h11_max_incomplete_event_size", "h11_max_header_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer (--{_flag(name)}).")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"ssl_cert_reqs={self.ssl_cert_reqs!r} must be 0 (no client certificate), 1 (optional) "
                             "or 2 (required) (--ssl-cert-reqs).")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError(f"ssl_keyfile={self.ssl_keyfile!r} needs ssl_certfile, the certificate it belongs to "
                             "(--ssl-certfile).")
        if self.ssl_cert_reqs != ssl.CERT_NONE and not self.ssl_ca_certs:
            raise ValueError(f"ssl_cert_reqs={self.ssl_cert_reqs} verifies client certificates: pass ssl_ca_certs, "
                             "the CA file they are checked against (--ssl-ca-certs).")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}={path!r} is not a file (--{_flag(name)}).")
        self.lora_modules = parse_lora_modules(self.lora_modules)
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path={self.root_path!r} must start with '/' and not end with one, e.g. '/llm' "
                             "(--root-path).")

    @property
    def api_keys(self) -> list[str]:
        """The keys a request may present (none: no key is needed); --api-key wins over the environment."""
        if self.api_key:
            return [key for key in self.api_key if key]
        from_environment = os.environ.get("PAGELLM_API_KEY") or os.environ.get("VLLM_API_KEY")
        return [from_environment] if from_environment else []


def _flag(name: str) -> str:
    return name.replace("_", "-")


@dataclass
class PromptInput:
    text: str | None
    token_ids: list[int]

    def engine_prompt(self, cache_salt: str | None = None) -> dict:
        prompt = {"prompt": self.text, "prompt_token_ids": self.token_ids}
        return prompt if cache_salt is None else {**prompt, "cache_salt": cache_salt}


@dataclass
class Choice:
    """One choice of a response: completion `sample_index` of the engine request `request_id`."""

    index: int
    prompt_index: int
    request_id: str
    # None for a beam-search choice: its beams were engine requests of their own.
    stream: RequestStream | None
    sample_index: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    # The latest KV figures of its engine request (shared by the request's n choices).
    kv: KVUsage | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def kv_info(choices: Sequence[Choice]) -> KVUsage:
    """The response's `kv` object: each engine request's figures once, added up."""
    per_request = {choice.request_id: choice.kv for choice in choices if choice.kv is not None}
    return sum(per_request.values(), KVUsage())


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.engine.vocab_size
        # --max-logprobs, vLLM's ModelConfig.max_logprobs (-1: no cap).
        self.max_logprobs: int = engine.engine.args.max_logprobs
        self.chat_template = config.chat_template
        info, args = engine.engine.core.model_info, engine.engine.args
        self.sampling_defaults = ServerSamplingDefaults.of(info.source, info.hf_config, args.generation_config,
                                                           args.override_generation_config)
        # One thread: the tokenizer is not shared between threads, and a second big prompt waits its turn
        # rather than taking a core from the engine.
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-tokenizer")
        # The adapters served under their own names (--lora-modules, and those loaded at run time).
        self.loras = LoRARegistry(engine.engine.check_lora_request, config.served_model_names)
        for module in config.lora_modules:
            self.loras.add(module)
        if config.auto_tool_parser is not None and not template_renders_tools(self.tokenizer):
            logger.warning("--enable-auto-tool-choice: this model's chat template does not write the request's tools "
                           "into the prompt, so the model is not told about them and will rarely call one.")

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on the tokenizer thread: what may take long on big inputs stays off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        check_text_param(param, text)
        if not text:
            return []
        return await self.off_loop(lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        return await self.off_loop(self.tokenizer.decode, token_ids)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, requested: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a name not served."""
        lora = self.loras.get(requested)
        if requested is not None and requested not in self.config.served_model_names and lora is None:
            served = self.config.served_model_names + list(self.loras.requests)
            raise OpenAIError(
                404, f"the model `{requested}` does not exist; this server serves {served}.",
                "model", "model_not_found",
            )
        return lora

    # ---- prompts ----------------------------------------------------------------------------------

    async def completion_prompts(self, prompt: PromptField, add_special_tokens: bool = True) -> list[PromptInput]:
        """A string, a list of strings, a list of token ids or a list of those, as one input each."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt is an empty list; pass at least one prompt.", "prompt")
        inputs = []
        for item in items:
            if isinstance(item, str):
                inputs.append(PromptInput(item, await self.encode(item, "prompt", add_special_tokens)))
            else:
                self.check_token_ids("prompt", item)
                inputs.append(PromptInput(None, list(item)))
        return inputs

    async def chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                          template_kwargs: dict | None = None, *, chat_template: str | None = None,
                          continue_final_message: bool = False, tools: list[dict] | None = None,
                          documents: list[dict] | None = None, reasoning_effort: str | None = None,
                          add_special_tokens: bool = False) -> PromptInput:
        """The prompt of a conversation through the chat template: the given one (a trusted request's), else the
        server's --chat-template, else the model's."""
        conversation = [_template_message(m) for m in messages]
        for index, message in enumerate(conversation):
            for key, value in message.items():
                if isinstance(value, str):
                    check_text_param(f"messages.{index}.{key}", value)
        variables = check_template_kwargs(template_kwargs)
        # Tools go to the template as apply_chat_template's own argument; the request's field wins over a kwarg.
        kwargs_tools = variables.pop("tools", None)
        tools = kwargs_tools if tools is None else tools
        try:
            variables = template_variables(variables, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, documents=documents,
                                           reasoning_effort=reasoning_effort)
        except ValueError as exc:
            raise bad_request(str(exc), "continue_final_message") from None
        template = chat_template if chat_template is not None else self.chat_template

        def render() -> str:
            return render_chat(self.tokenizer, conversation, chat_template=template, tools=tools, variables=variables)

        try:
            text = await self.off_loop(render)
        except Exception as exc:  # a template raises on conversations it does not accept (e.g. role order)
            raise bad_request(f"the chat template refused these messages: {exc}", "messages") from exc
        # The template already wrote any special tokens (BOS) it wants; encoding adds them again only if asked.
        return PromptInput(text, await self.encode(text, "messages", add_special_tokens=add_special_tokens))

    def truncate(self, prompt: PromptInput, keep: int | None, side: str | None) -> PromptInput:
        """vLLM's truncate_prompt_tokens: keep `keep` prompt tokens (-1: as many as leave room for one generated
        token), the last ones unless truncation_side is "right"."""
        if keep is None:
            return prompt
        if keep > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens={keep} is more than this model's maximum context length of "
                              f"{self.max_model_len} tokens; lower it (or pass -1 for as many as fit).",
                              "truncate_prompt_tokens")
        if keep == -1:
            keep = self.max_model_len - 1
        if len(prompt.token_ids) <= keep:
            return prompt
        kept = prompt.token_ids[:keep] if side == "right" else prompt.token_ids[len(prompt.token_ids) - keep:]
        # The text no longer matches the tokens; whoever needs it (echo) decodes the kept tokens.
        return PromptInput(None, kept)

    def check_token_ids(self, param: str, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise bad_request(
                    f"{param} contains token id {token_id}, outside the vocabulary; allowed: 0 <= id < "
                    f"{self.vocab_size}.", param,
                )

    def check_length(self, prompt: PromptInput, max_tokens: int | None, prompt_param: str,
                     max_tokens_param: str = "max_tokens") -> None:
        num_prompt = len(prompt.token_ids)
        limit = self.max_model_len
        if num_prompt == 0:
            raise bad_request(f"{prompt_param} is empty (0 tokens); pass at least one token.", prompt_param)
        if num_prompt >= limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, and your {prompt_param} has {num_prompt} "
                f"tokens, leaving no room for output; shorten it to at most {limit - 1} tokens.", prompt_param,
                "context_length_exceeded",
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but you requested {num_prompt + max_tokens} "
                f"tokens ({num_prompt} in the {prompt_param}, {max_tokens} in the completion); lower "
                f"{max_tokens_param} to at most {limit - num_prompt} or shorten the {prompt_param}.",
                max_tokens_param, "context_length_exceeded",
            )

    # ---- sampling ---------------------------------------------------------------------------------

    def check_stream_options(self, request: SamplingFields) -> None:
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed with stream=true.", "stream_options")

    def logit_bias(self, bias: object) -> dict[int, float] | None:
        """OpenAI's {"token id": bias} with the ids checked against the vocabulary."""
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise bad_request(f"logit_bias={bias!r:.80} must be an object mapping token ids to biases.", "logit_bias")
        parsed = {}
        for key, value in bias.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad_request(f"logit_bias[{key!r}]={value!r:.40} must be a number from -100 to 100.", "logit_bias")
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(f"logit_bias has the key {key!r}, which is not a token id; keys are token ids "
                                  "as strings, e.g. {\"50256\": -100}.", "logit_bias") from None
            self.check_token_ids("logit_bias", [token_id])
            parsed[token_id] = value
        return parsed

    def num_logprobs(self, param: str, value: int | None) -> int | None:
        """A logprobs count as the engine takes it: -1 means the whole vocabulary (as in vLLM); more than the
        server's max_logprobs is a 400 naming the limit."""
        if value is None:
            return None
        count = self.vocab_size if value == -1 else value
        limit = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        if count > limit:
            raise bad_request(f"{param}={value} asks for {count} log-probabilities per position, more than this "
                              f"server's max_logprobs={self.max_logprobs}; lower {param}, or start the server with "
                              f"--max-logprobs {count}.", param)
        return count

    def sampling_params(self, request: SamplingFields, max_tokens: int | None, logprobs: int | None = None,
                        best_of: int | None = None,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The parameters of the request's engine request: its n choices are n samples of one engine
        request (sample i of a seeded request samples with seed + i), which computes the prompt once."""
        if request.stop_token_ids:
            self.check_token_ids("stop_token_ids", request.stop_token_ids)
        if request.allowed_token_ids:
            self.check_token_ids("allowed_token_ids", request.allowed_token_ids)
        # Unset fields: the model's generation_config.json defaults (--generation-config), else OpenAI's.
        default = functools.partial(self.sampling_defaults.value, request)
        top_k = default("top_k", 0) or 0
        max_tokens = self.sampling_defaults.max_tokens(max_tokens)
        kwargs = dict(
            temperature=default("temperature", 1.0),
            top_p=default("top_p", 1.0),
            # A top_k at or past the vocabulary keeps every token, which is what 0 means.
            top_k=0 if top_k >= self.vocab_size else top_k,
            min_p=default("min_p", 0.0),
            n=request.n,
            best_of=best_of,
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            presence_penalty=default("presence_penalty", 0.0),
            frequency_penalty=default("frequency_penalty", 0.0),
            repetition_penalty=default("repetition_penalty", 1.0),
            logit_bias=self.logit_bias(request.logit_bias),
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured,
            prompt_logprobs=prompt_logprobs,
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words or None,
        )
        return build_sampling_params(kwargs)

    # ---- running ----------------------------------------------------------------------------------

    def priority(self, request: SamplingFields, raw_request: Request) -> int:
        """The request's priority (lower runs first): vLLM's X-Vllm-Priority header, else the body's field. Not 0
        on a server without the priority policy is a 400 now, before a stream could start."""
        priority = request.priority
        header = raw_request.headers.get(PRIORITY_HEADER)
        if header is not None:
            try:
                priority = int(header)
            except ValueError:
                pass  # vLLM, too, falls back to the body's priority
        policy = self.engine.engine.args.scheduling_policy
        if priority != 0 and policy != "priority":
            raise bad_request(f"priority={priority} needs a server that schedules by priority; this one runs "
                              f"--scheduling-policy {policy}. Leave priority at 0, or start the server with "
                              "--scheduling-policy priority.", "priority")
        return priority

    def submit(self, base_id: str, prompts: Sequence[PromptInput], params: SamplingParams, priority: int = 0,
               cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> list[Choice]:
        """One engine request per prompt, with params.n choices each; all queued or none (an error aborts
        those already queued). A cache_salt keeps their prefix-cache blocks apart from other salts'."""
        choices: list[Choice] = []
        try:
            for prompt_index, prompt in enumerate(prompts):
                request_id = f"{base_id}-{prompt_index}"
                stream = self.engine.add_request(request_id, prompt.engine_prompt(cache_salt), params, priority,
                                                 lora_request=lora_request)
                choices += [Choice(prompt_index * params.n + i, prompt_index, request_id, stream, sample_index=i)
                            for i in range(params.n)]
        except BaseException as exc:
            for request_id in {choice.request_id for choice in choices}:
                self.engine.abort_request(request_id)
            raise from_exception(exc) from exc
        return choices

    async def run_to_completion(self, raw_request: Request, choices: list[Choice]) -> None:
        """Fills each choice's text, token count and finish reason; a client that leaves aborts them all."""
        try:
            async with abort_on_disconnect(raw_request, self.engine, choices):
                async for choice, output in merge_outputs(self.engine, choices):
                    record(choice, output)
        except Exception as exc:  # the engine's verdict on a request (bad input, failed step, dead engine)
            raise from_exception(exc) from exc


def check_template_kwargs(template_kwargs: dict | None) -> dict:
    """A request's chat_template_kwargs, without apply_chat_template's own parameters (see chat_utils)."""
    kwargs = dict(template_kwargs or {})
    name = reserved_template_kwarg(kwargs)
    if name is not None:
        raise bad_request(f"chat_template_kwargs.{name} is not accepted: a template sent with a request runs as "
                          "code on the server (pass it as chat_template, to a server started with "
                          "--trust-request-chat-template), and tokenizing is the server's; pass only the template's "
                          "variables.", f"chat_template_kwargs.{name}")
    return kwargs


def check_text_param(param: str, text: str) -> None:
    try:
        check_text(param, text)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def build_sampling_params(kwargs: dict) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise from_exception(exc) from exc


def record(choice: Choice, output: RequestOutput) -> None:
    completion = output.outputs[0]
    choice.text_parts.append(completion.text)
    choice.num_tokens += len(completion.token_ids)
    choice.token_ids.extend(completion.token_ids)
    if completion.logprobs:
        choice.logprobs.extend(completion.logprobs)
    if output.prompt_logprobs is not None:
        choice.prompt_logprobs = output.prompt_logprobs
    if output.finished:
        choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason


def _template_message(message: ChatMessage) -> dict:
    return conversation_message(message.model_dump(exclude_none=True), "string")


async def merge_outputs(engine: AsyncLLMEngine, choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Each choice's outputs as they come, as RequestOutputs of that one completion (finished when the
    completion is). Leaving early (or an error in one engine request) ends all of them."""
    queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
    by_sample = {(choice.request_id, choice.sample_index): choice for choice in choices}
    by_request: dict[str, list[Choice]] = {}
    for choice in choices:
        by_request.setdefault(choice.request_id, []).append(choice)
    streams = {choice.request_id: choice.stream for choice in choices}

    async def pump(stream: RequestStream) -> None:
        try:
            async for output in engine.outputs(stream):
                queue.put_nowait(output)
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams.values()]
    finished: set[int] = set()
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            for choice in by_request[item.request_id]:
                choice.kv = item.kv
            for completion in item.outputs:
                choice = by_sample[(item.request_id, completion.index)]
                if choice.index in finished:
                    continue
                done = completion.finish_reason is not None
                if done:
                    finished.add(choice.index)
                yield choice, RequestOutput(item.request_id, item.prompt, item.prompt_token_ids, [completion], done,
                                            prompt_logprobs=item.prompt_logprobs,
                                            num_cached_tokens=item.num_cached_tokens, kv=item.kv)
    finally:
        # Cancelling a pump throws into its `outputs` generator, whose cleanup aborts the engine request.
        for task in tasks:
            task.cancel()


@asynccontextmanager
async def abort_on_disconnect(raw_request: Request, engine: AsyncLLMEngine, choices: Sequence[Choice]):
    """Aborts the choices' engine requests the moment the client disconnects, even while they only wait
    in the queue and no byte is being written that would notice."""

    async def watch() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                for request_id in {choice.request_id for choice in choices}:
                    engine.abort_request(request_id)
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
