"""Token ids -> text: incremental detokenization, stop strings, RequestOutputs.

One request's fault is its own: whatever raises while one request's results are processed
(`OutputProcessor.update_request`: detokenizing, stop strings, logprobs; or `to_output`) fails that
request alone, with finish_reason "error" and `RequestOutput.error`; the other requests of the step go
on. Tests inject such faults per request by patching `OutputProcessor.update_request`.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from pagellm.core.kv_usage import KVAccount, KVUsage
from pagellm.core.scheduler import EngineCoreOutput, TokenLogprobs
from pagellm.outputs import CompletionOutput, CompletionProgress, Logprob, PositionLogprobs, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

# Tokens before the first new one that are decoded with it, so that a leading space or a multi-token
# character comes out as the whole text would have it.
_CONTEXT_TOKENS = 5

logger = logging.getLogger(__name__)


def decode_function(tokenizer, params: SamplingParams) -> Callable[[list[int]], str]:
    """`tokenizer.decode` with the request's options; for a HF fast tokenizer whose decode only forwards to its
    Rust tokenizer (no clean-up of spaces, no override), that Rust decode itself: the same text for a third of
    the cost, which counts at two decodes per token per sequence per step. The compact tokenizer's decode_ids
    likewise."""
    backend = _plain_rust_decoder(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=params.skip_special_tokens)
    from pagellm.tokenization.compact_bpe import CompactBPETokenizer

    if isinstance(tokenizer, CompactBPETokenizer) and not tokenizer.clean_up_tokenization_spaces:
        return functools.partial(tokenizer.decode_ids, skip_special_tokens=params.skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=params.skip_special_tokens,
                             spaces_between_special_tokens=params.spaces_between_special_tokens)


def _plain_rust_decoder(tokenizer):
    # A process that never imported transformers holds none of its tokenizers (and should not import it to see).
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    PreTrainedTokenizerFast = transformers.PreTrainedTokenizerFast  # noqa: N806 - the class's own name
    kind = type(tokenizer)
    if (
        not isinstance(tokenizer, PreTrainedTokenizerFast)
        or kind.decode is not PreTrainedTokenizerFast.decode
        or kind._decode is not PreTrainedTokenizerFast._decode
        or tokenizer.clean_up_tokenization_spaces
    ):
        return None
    return getattr(tokenizer, "_tokenizer", None)


class IncrementalDetokenizer:
    """Emits the text that each new token adds, holding back bytes that do not yet form a character."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self._decode = decode or decode_function(tokenizer, params)
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_ids: list[int], final: bool) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


@dataclass
class SequenceState(CompletionProgress):
    """One completion of a request (a request with n > 1 has n), with the detokenizer that extends its text."""

    detokenizer: IncrementalDetokenizer = field(kw_only=True)

    def visible_text_len(self, stops: list[str]) -> int:
        """While running, the tail that could still turn out to begin a stop string is held back."""
        if self.finished or not stops:
            return len(self.text)
        hold = max(len(s) for s in stops) - 1
        return max(self.sent_text_len, len(self.text) - hold)

    def completion(self, params: SamplingParams) -> CompletionOutput:
        return self.take(params.output_kind == RequestOutputKind.DELTA, self.visible_text_len(params.stop))


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[int, SequenceState] = field(default_factory=dict)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # The scheduler's account for the request (set when it was added): all zero until it holds a block.
    kv_account: KVAccount = field(kw_only=True)

    def kv_usage(self) -> KVUsage:
        return self.kv_account.snapshot()

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.num_sequences and all(s.finished for s in self.sequences.values())

    def to_output(self) -> RequestOutput | None:
        params = self.params
        finished = self.finished
        if (params.output_kind == RequestOutputKind.FINAL_ONLY or params.num_sequences > params.n) and not finished:
            return None  # best_of > n: which n are returned is known only at the end
        sequences = sorted(self.sequences.values(), key=lambda s: s.index)
        if params.num_sequences > params.n:
            best = sorted(sequences, key=lambda s: -(s.cumulative_logprob or 0.0))[: params.n]
            sequences = sorted(best, key=lambda s: s.index)
        if params.output_kind == RequestOutputKind.DELTA and not finished:
            sequences = [s for s in sequences if s.changed]
        completions = [s.completion(params) for s in sequences]
        if params.num_sequences > params.n:
            for index, completion in enumerate(completions):
                completion.index = index  # the n returned, numbered as if only they had been generated
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, finished,
            prompt_logprobs=self.prompt_logprobs, num_cached_tokens=self.num_cached_tokens, kv=self.kv_usage(),
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    kv_account: KVAccount) -> None:
        state = RequestState(request_id, prompt, prompt_token_ids, params, kv_account=kv_account)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has nothing before it to be scored on
        self.states[request_id] = state

    def abort_requests(self, request_ids) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                for index in range(state.params.num_sequences):
                    sequence = state.sequences.get(index) or self._new_sequence(state, index)
                    if not sequence.finished:
                        sequence.finish_reason = "abort"
                outputs.append(state.to_output())
        return outputs

    def _new_sequence(self, state: RequestState, index: int) -> SequenceState:
        detokenizer = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, state.params)
        sequence = SequenceState(index, detokenizer=detokenizer)
        if state.params.logprobs is not None:
            sequence.logprobs = []
            sequence.cumulative_logprob = 0.0
        state.sequences[index] = sequence
        return sequence

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str], list[str]]:
        """RequestOutputs for this step; the core sequence ids a stop string finished; and the user
        requests that failed here (the core must free both)."""
        stopped_by_string: list[str] = []
        failed: dict[str, str] = {}
        touched: dict[str, RequestState] = {}
        for core_output in core_outputs:
            state = self.states.get(core_output.group_id or core_output.request_id)
            if state is None or state.request_id in failed:
                continue
            touched[state.request_id] = state
            if core_output.error is not None:  # the core already ended the request
                failed[state.request_id] = core_output.error
                continue
            try:
                if self.update_request(state, core_output):
                    stopped_by_string.append(core_output.request_id)
            except Exception as exc:  # noqa: BLE001 - one request's fault must not end its neighbours
                failed[state.request_id] = _describe_failure(state.request_id, exc)
        outputs = []
        for state in touched.values():
            if state.params.output_kind == RequestOutputKind.FINAL_ONLY and state.request_id not in failed \
                    and not state.finished:
                continue  # nothing to build or to forget until it finishes
            output = None
            if state.request_id not in failed:
                try:
                    output = state.to_output()
                except Exception as exc:  # noqa: BLE001 - as above
                    failed[state.request_id] = _describe_failure(state.request_id, exc)
            if state.request_id in failed:
                output = _failed_output(state, failed[state.request_id])
            if output is not None:
                outputs.append(output)
            if state.request_id in failed or state.finished:
                del self.states[state.request_id]
        return outputs, stopped_by_string, list(failed)

    def update_request(self, state: RequestState, core_output: EngineCoreOutput) -> bool:
        """Adds one core output to its request; True when a stop string ended the sequence before the core did."""
        state.num_cached_tokens = core_output.num_cached_tokens
        if core_output.prompt_logprobs:
            state.prompt_logprobs.extend(self._position_logprobs(e) for e in core_output.prompt_logprobs)
        if not core_output.new_token_ids and not core_output.finished:
            return False
        sequence = state.sequences.get(core_output.sample_index) or self._new_sequence(state, core_output.sample_index)
        return self._advance(state.params, sequence, core_output)

    def _advance(self, params: SamplingParams, sequence: SequenceState, core_output: EngineCoreOutput) -> bool:
        """Adds the step's tokens to a sequence; True when a stop string ended it before the core did."""
        sequence.changed = True
        sequence.token_ids.extend(core_output.new_token_ids)
        if core_output.logprobs and params.logprobs is not None:
            sequence.logprobs.extend(self._position_logprobs(e) for e in core_output.logprobs)
        if core_output.cumulative_logprob is not None and (params.logprobs is not None or params.num_sequences > params.n):
            sequence.cumulative_logprob = core_output.cumulative_logprob
        delta = sequence.detokenizer.add(_text_token_ids(params, core_output), final=core_output.finished)
        sequence.finish_reason, sequence.stop_reason = core_output.finish_reason, core_output.stop_reason
        if not delta:
            return False
        stop = _find_stop_string(sequence, params.stop, delta)
        sequence.text += delta
        if stop is None:
            return False
        stop_string, cut = stop
        sequence.text = sequence.text[: cut if not params.include_stop_str_in_output else cut + len(stop_string)]
        sequence.finish_reason, sequence.stop_reason = "stop", stop_string
        return not core_output.finished

    def _position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        ids = [entry.token_id, *entry.top_token_ids]
        values = [entry.logprob, *entry.top_logprobs]
        ranks = [entry.rank, *range(1, len(entry.top_token_ids) + 1)]
        return {
            token_id: Logprob(value, rank, self.tokenizer.decode([token_id]))
            for token_id, value, rank in zip(ids, values, ranks)
        }


def _text_token_ids(params: SamplingParams, core_output: EngineCoreOutput) -> list[int]:
    """The step's tokens that become text: a stop token (EOS or one of `stop_token_ids`) is kept in the token ids
    but not in the text unless `include_stop_str_in_output` asks for it, as in vLLM. Otherwise a request that keeps
    special tokens (a tool-call parser whose marker is one) would end its reply with the EOS text."""
    ids = core_output.new_token_ids
    ended_by_stop_token = core_output.finish_reason == "stop" and not isinstance(core_output.stop_reason, str)
    if ended_by_stop_token and ids and not params.include_stop_str_in_output:
        return ids[:-1]
    return ids


def _describe_failure(request_id: str, exc: Exception) -> str:
    logger.error("Processing the outputs of request %s failed; it alone is ended", request_id, exc_info=exc)
    return f"{type(exc).__name__}: {exc}"


def _failed_output(state: RequestState, error: str) -> RequestOutput:
    """The last output of a request that failed: what each sequence had so far, finish_reason "error".
    Built from plain fields only, since the request's own processing is what raised."""
    delta = state.params.output_kind == RequestOutputKind.DELTA
    completions = []
    for index in range(state.params.n):
        sequence = state.sequences.get(index)
        if sequence is None:
            completions.append(CompletionOutput(index, "", [], finish_reason="error"))
            continue
        text_from, tokens_from = (sequence.sent_text_len, sequence.sent_tokens) if delta else (0, 0)
        completions.append(CompletionOutput(index, sequence.text[text_from:], sequence.token_ids[tokens_from:],
                                            sequence.cumulative_logprob, finish_reason="error"))
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, True,
                         num_cached_tokens=state.num_cached_tokens, error=error, kv=state.kv_usage())


def _find_stop_string(sequence: SequenceState, stops: list[str], delta: str) -> tuple[str, int] | None:
    """The earliest stop string that the new text completes, and where it starts."""
    if not stops:
        return None
    text = sequence.text + delta
    # A stop string may straddle old and new text, but must end inside the new text.
    search_from = max(0, len(sequence.text) - max(len(s) for s in stops) + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, search_from)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return stop, index
