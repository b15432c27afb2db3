"""The synchronous engine: validated requests in, RequestOutputs out, one step at a time."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Union

from pagellm.config import EngineArgs
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import SchedulerStats
from pagellm.engine.engine_core import EngineCore
from pagellm.engine.output_processor import OutputProcessor
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams, check_text
from pagellm.structured_output.grammar import GrammarCompiler

PromptType = Union[str, Mapping]


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.core = EngineCore(args)
        info = self.core.model_info
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.hf_config.vocab_size
        self.output_processor = OutputProcessor(self.tokenizer)
        self._arrivals = itertools.count()
        # Imports xgrammar and indexes the vocabulary in its own threads, at the first structured-output request.
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, self.vocab_size, info.eos_token_ids, timeout_s=args.structured_outputs_timeout,
            any_whitespace=not (args.structured_outputs_config or {}).get("disable_any_whitespace", False))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def get_tokenizer(self):
        return self.tokenizer

    # ---- input processing --------------------------------------------------------------------------

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt given as text, {"prompt": text} or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, Mapping) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        else:
            raise ValueError(
                f"prompt={prompt!r:.80} is not a prompt; pass a str, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}."
            )
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt={text!r:.80} must be a str.")
            check_text("prompt", text)
            token_ids = self.tokenizer.encode(text)
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens); pass at least one token.")
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains {bad[0]!r}, outside the vocabulary; allowed: ints in [0, {self.vocab_size})."
            )
        return text, token_ids

    def _check_prompt_length(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_tokens} tokens, but max_model_len={self.max_model_len} must also leave room "
                f"for at least one generated token; shorten the prompt to at most {self.max_model_len - 1} tokens "
                "or raise max_model_len."
            )
        budget = self.core.scheduler.config.max_num_batched_tokens
        if not self.args.enable_chunked_prefill and num_tokens > budget:
            raise ValueError(
                f"the prompt has {num_tokens} tokens, more than max_num_batched_tokens={budget}, and chunked prefill "
                "is off; raise max_num_batched_tokens, enable chunked prefill, or shorten the prompt."
            )

    def _check_token_ids_in_vocab(self, params: SamplingParams) -> None:
        """Ids the sampler indexes logits with must exist, or one request would fail the whole step."""
        fields = {
            "stop_token_ids": params.stop_token_ids,
            "allowed_token_ids": params.allowed_token_ids or [],
            "logit_bias": list(params.logit_bias or {}),
        }
        for name, ids in fields.items():
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token id {bad[0]}, outside the vocabulary; allowed: ids in [0, {self.vocab_size})."
                )

    def _check_priority(self, priority: object) -> int:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority={priority!r} must be an int (lower runs first).")
        if priority != 0 and self.args.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs the priority scheduling policy; this engine runs "
                             f"scheduling_policy={self.args.scheduling_policy!r}. Start it with "
                             "scheduling_policy='priority' (--scheduling-policy priority), or leave priority at 0.")
        return priority

    def check_lora_request(self, lora_request: object) -> LoRARequest | None:
        """The adapter, read and checked now (a ValueError naming what is wrong), so that no step fails on it."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request={lora_request!r:.80} must be a pagellm.lora.request.LoRARequest or None.")
        if self.core.runner.lora is None:
            raise ValueError(f"lora_request names adapter {lora_request.lora_name!r}, but this engine runs without "
                             "LoRA; start it with enable_lora=True (--enable-lora).")
        self.core.runner.lora.load(lora_request)
        return lora_request

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queues a request. `prompt` may carry a "cache_salt": requests reuse each other's cached prefix
        blocks only under the same salt (vLLM's tenant isolation); `priority` counts under the "priority"
        scheduling policy, lower first; `lora_request` names the LoRA adapter it runs with."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}.")
        priority = self._check_priority(priority)
        lora_request = self.check_lora_request(lora_request)
        cache_salt = _cache_salt(prompt)
        text, token_ids = self.process_prompt(prompt)
        self._check_prompt_length(len(token_ids))
        self.core.scheduler.check_fits(len(token_ids), params.num_sequences)
        self._check_token_ids_in_vocab(params)
        params = params.clone()
        eos = set() if params.ignore_eos else set(self.core.model_info.eos_token_ids)
        params.all_stop_token_ids = eos | set(params.stop_token_ids)
        params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words or [])
        if params.structured_outputs is not None and params.structured_grammar is None:
            # Not handed over by a route (which waited for the parse on its event loop): wait here, in the
            # caller's thread, so that a bad grammar is a ValueError now.
            params.structured_grammar = self.grammar_compiler.submit(params.structured_outputs).wait()
        room = self.max_model_len - len(token_ids)
        max_output = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(
            request_id,
            token_ids,
            params,
            arrival_index=next(self._arrivals),
            max_output_tokens=max_output,
            stop_token_ids=frozenset(params.all_stop_token_ids),
            num_pending_forks=params.num_sequences - 1,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        self.core.add_request(request)
        self.output_processor.add_request(request_id, text, token_ids, params, request.kv_account)

    def add_beam_request(self, request_id: str, token_ids: list[int], num_logprobs: int, max_tokens: int,
                         beam_width: int, lora_request: LoRARequest | None = None) -> None:
        """A beam-search sequence: it reports its next token's top log-probabilities each step and
        waits for the caller to append a token or fork it (see engine/beam_search.py). Its search holds
        beam_width seats of max_num_seqs from its admission on."""
        self._check_prompt_length(len(token_ids))
        if len(token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens and max_tokens={max_tokens}, more than "
                f"max_model_len={self.max_model_len}; lower max_tokens or shorten the prompt."
            )
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=num_logprobs, ignore_eos=True)
        request = Request(request_id, token_ids, params, next(self._arrivals), max_tokens,
                          appends_sampled_tokens=False, reserved_seats=beam_width,
                          lora_request=self.check_lora_request(lora_request))
        self.core.add_request(request)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (as vLLM bans both)."""
        sequences: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(ids)
        return self.output_processor.abort_requests(ids)

    # ---- stepping ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step. A request whose results fail to process (in the core or the output processor)
        comes back finished with finish_reason "error" and `RequestOutput.error`; only it is ended."""
        core_outputs = self.core.step()
        outputs, stopped, failed = self.output_processor.process(core_outputs)
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED, whole_groups=False)
        if failed:
            self.core.abort_requests(failed, RequestStatus.FINISHED_ERROR)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def prefault_kv_cache(self, seconds: float) -> bool:
        return self.core.prefault_kv_cache(seconds)

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (interpreter exit does it too), and the grammar
        compile threads if a structured-output request started them."""
        self.grammar_compiler.shutdown()
        self.core.shutdown()


def _cache_salt(prompt: PromptType) -> str | None:
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt={salt!r:.80} must be a non-empty str (a secret per tenant, e.g. 43 "
                         "characters of base64: 256 random bits).")
    return salt
