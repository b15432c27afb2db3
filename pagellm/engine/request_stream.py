"""The consumer's end of one request in the async engine.

The engine thread always runs requests in DELTA mode and drops each step's delta here (through the
consumer's event loop); the stream turns deltas into the output kind the caller asked for. A consumer that
falls behind gets the deltas that piled up merged into one output, so it catches up in one read instead of
replaying every step.
"""

from __future__ import annotations

import asyncio

from pagellm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm.sampling_params import RequestOutputKind


class RequestStream:
    """Lives on the consumer's event loop: `put` and `next_output` must be called on that loop's thread."""

    def __init__(self, request_id: str, output_kind: RequestOutputKind, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self.loop = loop
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._text = ""
        self._token_ids: list[int] = []
        self._logprobs: list[PositionLogprobs] | None = None
        self._cumulative_logprob: float | None = None
        self._finish_reason: str | None = None
        self._stop_reason: int | str | None = None
        # Where the text, tokens and logprobs the consumer has not been handed yet begin (DELTA hands out
        # only those).
        self._sent_text = 0
        self._sent_tokens = 0
        self._changed = False
        self._last: RequestOutput | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next_output(self) -> RequestOutput:
        """The next output in the caller's kind; raises the error that ended the request, if one did."""
        while True:
            self._accept(await self._queue.get())
            while not self.finished and not self._queue.empty():
                self._accept(self._queue.get_nowait())
            output = self._take()
            if output is not None:
                return output

    def _accept(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self._last = item
        self.finished = item.finished
        self._changed = self._changed or item.finished
        if not item.outputs:
            return  # a step that produced nothing for this sequence (e.g. a prompt chunk)
        delta = item.outputs[0]
        self._changed = True
        self._text += delta.text
        self._token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self._logprobs = (self._logprobs or []) + list(delta.logprobs)
        self._cumulative_logprob = delta.cumulative_logprob
        self._finish_reason, self._stop_reason = delta.finish_reason, delta.stop_reason

    def _take(self) -> RequestOutput | None:
        last = self._last
        if last is None or not self._changed:
            return None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if self.output_kind == RequestOutputKind.DELTA:
            text, token_ids = self._text[self._sent_text :], self._token_ids[self._sent_tokens :]
            logprobs = None if self._logprobs is None else self._logprobs[self._sent_tokens :]
        else:
            text, token_ids = self._text, list(self._token_ids)
            logprobs = None if self._logprobs is None else list(self._logprobs)
        self._sent_text, self._sent_tokens = len(self._text), len(self._token_ids)
        self._changed = False
        completion = CompletionOutput(0, text, token_ids, self._cumulative_logprob, logprobs, self._finish_reason,
                                      self._stop_reason)
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, [completion], last.finished,
                             prompt_logprobs=last.prompt_logprobs, num_cached_tokens=last.num_cached_tokens)
