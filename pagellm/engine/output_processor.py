"""Token ids -> text: incremental detokenization, stop strings, RequestOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.scheduler import EngineCoreOutput
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

# Tokens before the first new one that are decoded with it, so that a leading space or a multi-token
# character comes out as the whole text would have it.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Emits the text that each new token adds, holding back bytes that do not yet form a character."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

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
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # How much text and how many tokens earlier DELTA outputs already carried.
    sent_text_len: int = 0
    sent_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text_len(self) -> int:
        """While running, the tail that could still turn out to begin a stop string is held back."""
        if self.finished or not self.params.stop:
            return len(self.text)
        hold = max(len(s) for s in self.params.stop) - 1
        return max(self.sent_text_len, len(self.text) - hold)

    def to_output(self) -> RequestOutput | None:
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        visible = self.visible_text_len()
        if kind == RequestOutputKind.DELTA:
            text, token_ids = self.text[self.sent_text_len : visible], self.token_ids[self.sent_tokens :]
            self.sent_text_len, self.sent_tokens = visible, len(self.token_ids)
        else:
            text, token_ids = self.text[:visible], list(self.token_ids)
        completion = CompletionOutput(0, text, token_ids, None, None, self.finish_reason, self.stop_reason)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, [completion], self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, detokenizer)

    def abort_requests(self, request_ids) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                state.finish_reason = "abort"
                outputs.append(state.to_output())  # every kind reports the end of a request
        return outputs

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """RequestOutputs for this step, and the ids a stop string finished (the core must free them)."""
        outputs: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for core_output in core_outputs:
            state = self.states.get(core_output.request_id)
            if state is None:
                continue
            state.token_ids.extend(core_output.new_token_ids)
            state.num_cached_tokens = core_output.num_cached_tokens
            delta = state.detokenizer.add(core_output.new_token_ids, final=core_output.finished)
            state.finish_reason, state.stop_reason = core_output.finish_reason, core_output.stop_reason
            if delta:
                stop = _find_stop_string(state, delta)
                state.text += delta
                if stop is not None:
                    stop_string, cut = stop
                    state.text = state.text[:cut]
                    state.finish_reason, state.stop_reason = "stop", stop_string
                    if not core_output.finished:
                        stopped_by_string.append(state.request_id)
            output = state.to_output()
            if output is not None:
                outputs.append(output)
            if state.finished:
                del self.states[state.request_id]
        return outputs, stopped_by_string


def _find_stop_string(state: RequestState, delta: str) -> tuple[str, int] | None:
    """The earliest stop string that the new text completes, and where the output text ends."""
    stops = state.params.stop
    if not stops:
        return None
    text = state.text + delta
    # A stop string may straddle old and new text, but must end inside the new text.
    search_from = max(0, len(state.text) - max(len(s) for s in stops) + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, search_from)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return stop, index + len(stop) if state.params.include_stop_str_in_output else index
