"""One sequence's grammar state in the model runner, kept in step with the sequence's output tokens."""

from __future__ import annotations

from concurrent.futures import Future

import torch

# Why a constrained sequence ends although no stop token was sampled (its stop_reason).
GRAMMAR_COMPLETE = "structured output complete: the grammar allows no further token"
DEAD_END = "structured output dead end: the grammar allows none of the model's tokens here"


class SequenceGrammar:
    """A matcher that has consumed exactly the sequence's output tokens so far.

    The runner's copy of a sequence's tokens is the truth: before each sample the matcher catches up with
    it. A sequence re-admitted after preemption, or forked from another (n > 1), arrives in the runner as
    a new row with all its tokens, so its matcher is rebuilt by replaying them: a fork gets a copy of its
    parent's state, and a recomputed sequence resumes where it was, with nothing to undo.
    """

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self._matcher = None
        self.num_consumed = 0
        self.failure: str | None = None

    def _start(self) -> bool:
        import xgrammar as xgr

        try:
            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        except Exception as exc:  # a compile error raised in the pool thread ends this request only
            self.failure = f"structured output grammar failed to compile: {exc}"
            return False
        return True

    def catch_up(self, output_token_ids) -> None:
        """Accept the output tokens the matcher has not seen yet."""
        if self.failure is not None or (self._matcher is None and not self._start()):
            return
        for token_id in output_token_ids[self.num_consumed:]:
            if self._matcher.is_terminated():
                self.failure = GRAMMAR_COMPLETE
                return
            if not self._matcher.accept_token(int(token_id)):
                self.failure = f"structured output rejected token {int(token_id)}"
                return
            self.num_consumed += 1
        if self._matcher.is_terminated():
            self.failure = GRAMMAR_COMPLETE

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> str | None:
        """Write the allowed tokens into row `index` of an int32 bitmask; the reason if none is allowed."""
        if self.failure is not None:
            return self.failure
        self._matcher.fill_next_token_bitmask(bitmask, index)
        if not bool(bitmask[index].any()):
            self.failure = DEAD_END
        return self.failure


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, at every token a row's [ceil(V/32)] int32 bitmask does not allow (bit j of word w is
    token 32w + j): xgrammar's kernel, one pass over the batch's logits (C++ on CPU, Triton on CUDA)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask)
