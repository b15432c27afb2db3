"""The engine's per-position log-probabilities in OpenAI's two response formats."""

from __future__ import annotations

from collections.abc import Sequence

from pagellm.entrypoints.openai.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from pagellm.outputs import Logprob, PositionLogprobs


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    """The position's `num_top` most likely tokens, most likely first (the chosen token only if among them)."""
    ranked = [(token_id, lp) for token_id, lp in position.items() if lp.rank is not None and lp.rank <= num_top]
    return sorted(ranked, key=lambda item: item[1].rank)


def _text(token_id: int, logprob: Logprob, tokenizer) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else tokenizer.decode([token_id])


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top: int,
                        text_offset: int, tokenizer) -> CompletionLogprobs:
    """Legacy completions format; `text_offset` is where the first token's text starts in the choice's text.
    As OpenAI documents, each top_logprobs entry holds the `num_top` most likely tokens plus the chosen one."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        token = _text(token_id, chosen, tokenizer)
        result.tokens.append(token)
        result.token_logprobs.append(chosen.logprob)
        top = {_text(t, lp, tokenizer): lp.logprob for t, lp in _top(position, num_top)}
        top.setdefault(token, chosen.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], num_top: int,
                  tokenizer) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position[token_id]
        token = _text(token_id, chosen, tokenizer)
        top = [_top_entry(t, lp, tokenizer) for t, lp in _top(position, num_top)]
        content.append(TokenLogprob(token=token, logprob=chosen.logprob, bytes=_bytes(token), top_logprobs=top))
    return ChatLogprobs(content=content)


def _top_entry(token_id: int, logprob: Logprob, tokenizer) -> TopLogprob:
    token = _text(token_id, logprob, tokenizer)
    return TopLogprob(token=token, logprob=logprob.logprob, bytes=_bytes(token))


def _bytes(token: str) -> list[int]:
    # A token that ends inside a multi-byte character decodes to U+FFFD; its bytes are those of that text.
    return list(token.encode("utf-8", errors="replace"))
