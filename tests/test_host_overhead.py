"""The host-side fast paths of a step give what the general paths give: the Rust decode, the runner's plain-greedy
rows, and LLM.generate's final-only outputs."""

from __future__ import annotations

import random

import pytest

from pagellm.engine.output_processor import IncrementalDetokenizer, _plain_rust_decoder, decode_function
from pagellm.entrypoints.llm import _final_only
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.worker.input_batch import RowState


def _random_ids(tokenizer, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    special = list(tokenizer.all_special_ids)
    # Byte-level pieces of multi-byte characters come up often among random ids; special ids are mixed in.
    return [rng.choice(special) if rng.random() < 0.05 else rng.randrange(len(tokenizer)) for _ in range(count)]


@pytest.fixture(scope="module")
def fast_tokenizer(default_tokenizer):
    """The default model's tokenizer as transformers' fast tokenizer (the engine serves its compact one)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(str(default_tokenizer.source_directory))
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    return tokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_rust_decode_equals_the_tokenizers_decode(fast_tokenizer, skip_special_tokens):
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    decode = decode_function(fast_tokenizer, params)
    assert isinstance(decode.func.__self__, type(fast_tokenizer._tokenizer))  # the fast path was taken
    for seed in range(20):
        ids = _random_ids(fast_tokenizer, 12, seed)
        assert decode(ids) == fast_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_compact_tokenizers_decode_ids_equals_its_decode(default_tokenizer, skip_special_tokens):
    decode = decode_function(default_tokenizer, SamplingParams(skip_special_tokens=skip_special_tokens))
    assert decode.func == default_tokenizer.decode_ids  # the fast path was taken
    for seed in range(20):
        ids = _random_ids(default_tokenizer, 12, seed)
        assert decode(ids) == default_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_text_is_the_same_through_either_decode(default_tokenizer):
    params = SamplingParams()
    slow = lambda ids: default_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for seed in range(5):
        prompt, output = _random_ids(default_tokenizer, 8, seed), _random_ids(default_tokenizer, 60, 100 + seed)
        fast_detok = IncrementalDetokenizer(default_tokenizer, prompt, params)
        slow_detok = IncrementalDetokenizer(default_tokenizer, prompt, params, decode=slow)
        for i, token in enumerate(output):
            final = i == len(output) - 1
            assert fast_detok.add([token], final) == slow_detok.add([token], final)


def test_tokenizers_that_clean_up_spaces_keep_their_own_decode(fast_tokenizer, default_tokenizer):
    for tokenizer in (fast_tokenizer, default_tokenizer):
        saved = tokenizer.clean_up_tokenization_spaces
        try:
            tokenizer.clean_up_tokenization_spaces = True
            assert _plain_rust_decoder(tokenizer) is None
            assert decode_function(tokenizer, SamplingParams()).func == tokenizer.decode
        finally:
            tokenizer.clean_up_tokenization_spaces = saved
    assert _plain_rust_decoder(object()) is None


def test_generate_asks_for_final_outputs_without_touching_the_callers_params():
    params = SamplingParams(temperature=0, max_tokens=4)
    final = _final_only(params)
    assert final.output_kind == RequestOutputKind.FINAL_ONLY
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert (final.temperature, final.max_tokens) == (0, 4)
    assert _final_only(final) is final


@pytest.mark.parametrize(
    "change",
    [
        dict(temperature=0.5),
        dict(logprobs=1),
        dict(presence_penalty=0.5),
        dict(repetition_penalty=1.2),
        dict(logit_bias={5: 1.0}),
        dict(allowed_token_ids=[5, 6]),
    ],
)
def test_a_row_is_plain_greedy_only_with_nothing_else_to_apply(change):
    def row(**overrides) -> RowState:
        fields = dict(params=SamplingParams(temperature=0), samples_at_first=1, appends=True, stop_ids=[])
        fields.update(overrides)
        return RowState("r", fields["params"], 3, 0, fields["samples_at_first"], fields["appends"],
                        fields["stop_ids"])

    assert row().is_plain_greedy
    assert not row(params=SamplingParams(**{"temperature": 0, **change})).is_plain_greedy
    assert not row(samples_at_first=2).is_plain_greedy  # n > 1: its first sample forks
    assert not row(appends=False).is_plain_greedy  # a beam candidate
    assert not row(stop_ids=[2]).is_plain_greedy  # stop tokens masked until min_tokens
    with_bad_words = SamplingParams(temperature=0)
    with_bad_words.bad_words_token_ids = [[7]]
    assert not row(params=with_bad_words).is_plain_greedy
