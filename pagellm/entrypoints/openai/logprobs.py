"""The engine's per-position log-probabilities in OpenAI's two response formats, and vLLM's prompt_logprobs."""

from __future__ import annotations

from collections.abc import Sequence

from pagellm.entrypoints.openai.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
from pagellm.outputs import Logprob, PositionLogprobs

# What OpenAI (and vLLM) send for a log-probability of -inf, which JSON cannot carry.
_MIN_LOGPROB = -9999.0


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    """The position's `num_top` most likely tokens, most likely first (the chosen token only if among them)."""
    ranked = [(token_id, lp) for token_id, lp in position.items() if lp.rank is not None and lp.rank <= num_top]
    return sorted(ranked, key=lambda item: item[1].rank)


def _text(token_id: int, logprob: Logprob | None, tokenizer, as_token_ids: bool = False) -> str:
    if as_token_ids:
        # vLLM's return_tokens_as_token_ids: a form every token has, even one that is not valid UTF-8 alone.
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, _MIN_LOGPROB)


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None], num_top: int,
                        text_offset: int, tokenizer, as_token_ids: bool = False) -> CompletionLogprobs:
    """Legacy completions format; `text_offset` is where the first token's text starts in the choice's text.
    As OpenAI documents, each top_logprobs entry holds the `num_top` most likely tokens plus the chosen one. A
    position without log-probabilities (an echoed prompt's first token) has null entries, as in vLLM."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions):
        if position is None:
            token = _text(token_id, None, tokenizer, as_token_ids)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = position[token_id]
            token = _text(token_id, chosen, tokenizer, as_token_ids)
            result.token_logprobs.append(_value(chosen))
            top = {_text(t, lp, tokenizer, as_token_ids): _value(lp) for t, lp in _top(position, num_top)}
            top.setdefault(token, _value(chosen))
            result.top_logprobs.append(top)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top: int,
                  tokenizer, as_token_ids: bool = False) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        token = _text(token_id, chosen, tokenizer, as_token_ids)
        top = [_top_entry(t, lp, tokenizer, as_token_ids) for t, lp in _top(position, num_top)]
        content.append(TokenLogprob(token=token, logprob=_value(chosen), bytes=_bytes(token), top_logprobs=top))
    return ChatLogprobs(content=content)


def prompt_logprobs_json(positions: Sequence[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt position (null for the first) the prompt's token and the top ones, as
    {"token id": {"logprob", "rank", "decoded_token"}}."""
    if positions is None:
        return None
    return [
        None if position is None else {
            str(token_id): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()
        }
        for position in positions
    ]


def _top_entry(token_id: int, logprob: Logprob, tokenizer, as_token_ids: bool) -> TopLogprob:
    token = _text(token_id, logprob, tokenizer, as_token_ids)
    return TopLogprob(token=token, logprob=_value(logprob), bytes=_bytes(token))


def _bytes(token: str) -> list[int]:
    # A token that ends inside a multi-byte character decodes to U+FFFD; its bytes are those of that text.
    return list(token.encode("utf-8", errors="replace"))
