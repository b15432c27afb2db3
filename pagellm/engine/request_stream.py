"""The consumer's end of one request in the async engine.

The engine thread always runs requests in DELTA mode and drops each step's delta here (through the
consumer's event loop); the stream turns deltas into the output kind the caller asked for. A consumer that
falls behind gets the deltas that piled up merged into one output, so it catches up in one read instead of
replaying every step. A request with n > 1 (or best_of) carries one completion per sample, each followed
on its own.
"""

from __future__ import annotations

import asyncio
from pagellm.outputs import CompletionOutput, CompletionProgress, RequestOutput
from pagellm.sampling_params import RequestOutputKind


class _Completion(CompletionProgress):
    """One sample as the consumer has received it, built up from the engine's deltas."""

    def accept(self, delta: CompletionOutput) -> None:
        self.changed = True
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class RequestStream:
    """Lives on the consumer's event loop: `put` and `next_output` must be called on that loop's thread."""

    def __init__(self, request_id: str, output_kind: RequestOutputKind, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self.loop = loop
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._completions: dict[int, _Completion] = {}
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
        for delta in item.outputs:  # none in a step that produced nothing for this request (a prompt chunk)
            self._changed = True
            completion = self._completions.get(delta.index)
            if completion is None:
                completion = self._completions[delta.index] = _Completion(delta.index)
            completion.accept(delta)

    def _take(self) -> RequestOutput | None:
        last = self._last
        if last is None or not self._changed:
            return None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        completions = [self._completions[index] for index in sorted(self._completions)]
        if self.output_kind == RequestOutputKind.DELTA:
            # Only what moved; a finished request still sends one (empty) output to say so.
            completions = [c for c in completions if c.changed] or completions[:1]
        self._changed = False
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                             [c.take(self.output_kind == RequestOutputKind.DELTA) for c in completions], last.finished,
                             prompt_logprobs=last.prompt_logprobs, num_cached_tokens=last.num_cached_tokens,
                             kv=last.kv)
