"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagellm.config import EngineArgs
from pagellm.entrypoints.chat_utils import (
    check_template_kwargs,
    conversation_message,
    render_chat,
    resolve_content_format,
    template_variables,
)
from pagellm.engine.llm_engine import LLMEngine, PromptType
from pagellm.entrypoints.chat_template import load_chat_template
from pagellm.models.loader import generation_defaults
from pagellm.outputs import RequestOutput
from pagellm.engine.beam_search import BeamSearchOutput, beam_search
from pagellm.lora.request import LoRARequest
from pagellm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """Runs batches of prompts to completion on one engine."""

    def __init__(self, model: str | None = None, *, chat_template: str | None = None, **kwargs) -> None:
        """`model` and every keyword argument vLLM's LLM takes (each EngineArgs field, see pagellm/config.py),
        with vLLM's defaults; `chat_template` (a template or a file) replaces the tokenizer's."""
        template = load_chat_template(chat_template)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args_for(model, **kwargs))
        if template is not None:
            self.llm_engine.tokenizer.chat_template = template
        self._request_ids = itertools.count()
        info, args = self.llm_engine.core.model_info, self.llm_engine.args
        # vLLM's name: the sampling parameters the model's generation config sets.
        self.default_sampling_params: dict = generation_defaults(info.source, info.hf_config, args.generation_config,
                                                                 args.override_generation_config)

    @staticmethod
    def engine_args_for(model: str | None = None, **kwargs) -> EngineArgs:
        """The engine arguments `LLM(model, **kwargs)` runs with, checked without loading anything."""
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            hints = {name: difflib.get_close_matches(name, EngineArgs.field_names(), n=1) for name in sorted(unknown)}
            described = ", ".join(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                                  for name, close in hints.items())
            raise TypeError(f"LLM() got unknown engine arguments {described}; LLM takes vLLM's EngineArgs fields "
                            "(see pagellm/config.py).")
        # vLLM's LLM turns the periodic stats log off unless asked.
        kwargs.setdefault("disable_log_stats", True)
        return EngineArgs(model=model, **kwargs)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        return cls(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)})

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's generation_config.json
        defaults (temperature, top_p, top_k, min_p, penalties, max_new_tokens as max_tokens) under
        generation_config="auto", with override_generation_config on top; vLLM's defaults otherwise."""
        return SamplingParams(**self.default_sampling_params)

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`, each finished. `priority`: one per prompt, for an engine with
        scheduling_policy="priority" (lower first). `lora_request`: the LoRA adapter of every prompt, or one
        per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt."
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; pass one per prompt.")
        loras = _per_prompt_loras(lora_request, len(prompts))
        return self._run(prompts, params_list, use_tqdm, priority or [0] * len(prompts), loras)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: object | None = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation through the chat template (the given template text, else the model's), then
        generates; as vLLM's, each output's `prompt` is the rendered text.
        `continue_final_message` continues the last message instead of starting one (pass
        add_generation_prompt=False with it); `chat_template_content_format` "string" joins a message's text
        parts, "openai" hands the template the list of parts, "auto" picks what the template reads. `priority`: one
        for all conversations or one each, as LLM.generate takes it."""
        if mm_processor_kwargs is not None:
            raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r:.80}: pagellm serves text-only models; "
                             "pass None.")
        add_special_tokens = self._chat_add_special_tokens(tokenization_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        content_format = resolve_content_format(chat_template_content_format, chat_template, tokenizer)
        variables = template_variables(check_template_kwargs(chat_template_kwargs),
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message)
        prompts = []
        for conversation in conversations:
            rendered = [conversation_message(message, content_format) for message in conversation]
            text = render_chat(tokenizer, rendered, chat_template=chat_template, tools=tools, variables=variables)
            # The template writes the special tokens (BOS) it wants; encoding adds them again only if asked.
            token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        if isinstance(priority, int):
            priority = [priority] * len(prompts)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, priority=priority)

    @staticmethod
    def _chat_add_special_tokens(tokenization_kwargs: dict[str, Any] | None) -> bool:
        """vLLM's tokenization_kwargs for chat; add_special_tokens (default False) is the one that applies here."""
        kwargs = dict(tokenization_kwargs or {})
        add_special_tokens = kwargs.pop("add_special_tokens", False)
        if kwargs:
            raise ValueError(f"tokenization_kwargs has {sorted(kwargs)}; only add_special_tokens applies to chat "
                             "prompts here.")
        if not isinstance(add_special_tokens, bool):
            raise ValueError(f"tokenization_kwargs['add_special_tokens']={add_special_tokens!r} must be a bool.")
        return add_special_tokens

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """Beam search per prompt; each result's `sequences` are best first (see engine/beam_search.py).
        `lora_request`: one LoRA adapter for every prompt, or one per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        token_lists = [self.llm_engine.process_prompt(p)[1] for p in prompts]
        loras = _per_prompt_loras(lora_request, len(token_lists))
        outputs = beam_search(self.llm_engine, token_lists, params, loras)
        tokenizer = self.get_tokenizer()
        for output in outputs:
            for sequence in output.sequences:
                sequence.text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        return outputs

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool,
             priorities: Sequence[int], loras: Sequence[LoRARequest | None]) -> list[RequestOutput]:
        engine = self.llm_engine
        request_ids = [str(next(self._request_ids)) for _ in prompts]
        # Only finished outputs are read here: the engine builds nothing for the steps in between (vLLM's
        # FINAL_ONLY). The caller's params are left as they were; equal ones share one copy.
        final_only: dict[int, SamplingParams] = {}
        added: list[str] = []
        try:
            for request_id, prompt, params, priority, lora in zip(request_ids, prompts, params_list, priorities,
                                                                   loras):
                if id(params) not in final_only:
                    final_only[id(params)] = _final_only(params)
                engine.add_request(request_id, prompt, final_only[id(params)], priority, lora)
                added.append(request_id)
        except Exception:
            engine.abort_request(added)
            raise
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(finished) < len(request_ids):
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            progress.close()
        return [finished[r] for r in request_ids]


def _per_prompt_loras(lora_request, num_prompts: int) -> list:
    """vLLM's lora_request argument: one adapter (or None) for every prompt, or a list with one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"got {len(lora_request)} lora_requests for {num_prompts} prompts; pass one, or one "
                             "per prompt.")
        return list(lora_request)
    raise ValueError(f"lora_request={lora_request!r:.80} must be a LoRARequest, a list of them (one per prompt) "
                     "or None.")


def _final_only(params: SamplingParams) -> SamplingParams:
    if not isinstance(params, SamplingParams) or params.output_kind == RequestOutputKind.FINAL_ONLY:
        return params  # add_request names a wrong type
    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params
