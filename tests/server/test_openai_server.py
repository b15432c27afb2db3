"""A real `pagellm serve` on the tiny model, driven by the official `openai` client and by raw httpx."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pagellm import LLM, SamplingParams
from tests.helpers import PROMPTS
from tests.server.utils import metric_value, wait_until

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512)


def _offline_greedy(offline: LLM, prompt, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return offline.generate([prompt], params, use_tqdm=False)[0]


def _stream_text(stream) -> tuple[str, str | None, object]:
    """(text, last finish_reason, usage) of a completions stream with one choice."""
    text, finish, usage = "", None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


def _metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


# ---- /v1/models ----------------------------------------------------------------------------------


def test_models_lists_the_served_names(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert all(m.owned_by == "pagellm" for m in models)


# ---- completions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_completion_equals_offline_streamed_or_not(client, offline, prompt):
    expected = _offline_greedy(offline, prompt, 24)
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, **GREEDY)
    (choice,) = response.choices
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == "length" and choice.index == 0
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 24
    assert response.usage.total_tokens == len(expected.prompt_token_ids) + 24

    stream = client.completions.create(model="tiny-alias", prompt=prompt, max_tokens=24, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    text, finish, usage = _stream_text(stream)
    assert (text, finish) == (choice.text, "length")
    assert usage.model_dump() == response.usage.model_dump()


def test_prompt_as_token_ids_and_as_a_list_of_strings(client, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[1])
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, **GREEDY)
    by_text = client.completions.create(model="tiny", prompt=[PROMPTS[1]], max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text == _offline_greedy(offline, PROMPTS[1], 8).outputs[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPTS[1] + by_text.choices[0].text


def test_n_choices_with_seed_plus_index_and_exact_usage(client, offline):
    prompts = [PROMPTS[0], PROMPTS[1]]
    kwargs = dict(model="tiny", prompt=prompts, n=3, max_tokens=7, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    response = client.completions.create(**kwargs)
    assert [c.index for c in response.choices] == list(range(6))
    tokenizer = offline.get_tokenizer()
    # Prompt tokens count once per prompt, as OpenAI counts them, however many choices each has.
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == 6 * 7
    texts = [c.text for c in response.choices]
    assert len(set(texts[:3])) > 1, "three seeded choices of one prompt came out identical"
    # Choice i samples with seed + i: the same request with n=1 and that seed gives the same text.
    single = client.completions.create(**{**kwargs, "prompt": prompts[0], "n": 1, "seed": 1234 + 2})
    assert single.choices[0].text == texts[2]
    # And it is reproducible, streamed or not.
    stream = client.completions.create(**kwargs, stream=True)
    streamed = ["" for _ in range(6)]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts


def test_stop_string_ends_the_completion(client, offline):
    full = _offline_greedy(offline, PROMPTS[2], 24).outputs[0].text
    stop = full[6:10]
    assert stop.strip(), full
    response = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, stop=[stop], **GREEDY)
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == full[: full.index(stop)]
    text, finish, _ = _stream_text(
        client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=24, stop=stop, stream=True, **GREEDY)
    )
    assert (text, finish) == (response.choices[0].text, "stop")


def test_penalties_and_logit_bias_reach_the_engine(client, offline):
    # This prompt's greedy continuation repeats a token within 96, so the penalties change it.
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    expected = offline.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, **penalties),
                                use_tqdm=False)[0].outputs[0].text
    plain = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=96, **GREEDY).choices[0].text
    penalized = client.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=96, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    ).choices[0].text
    assert penalized == expected != plain
    biased = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, logit_bias={"4093": 100},
                                       logprobs=0, **GREEDY)
    assert biased.choices[0].logprobs.tokens == [offline.get_tokenizer().decode([4093])] * 5


def test_completion_logprobs_streamed_or_not(client, offline):
    expected = offline.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3),
                                use_tqdm=False)[0].outputs[0]
    response = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=10, logprobs=3, **GREEDY)
    logprobs = response.choices[0].logprobs
    chosen = [position[token] for position, token in zip(expected.logprobs, expected.token_ids)]
    assert logprobs.token_logprobs == pytest.approx([c.logprob for c in chosen], abs=1e-4)
    assert logprobs.tokens == [c.decoded_token for c in chosen]
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(10)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        # Greedy picks the most likely token; each entry holds the top 3 and the chosen one.
        assert len(top) <= 4 and top[token] == value == max(top.values())
    stream = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=10, logprobs=3, stream=True,
                                       **GREEDY)
    tokens, values, offsets = [], [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (logprobs.tokens, logprobs.text_offset)
    assert values == pytest.approx(logprobs.token_logprobs, abs=1e-4)  # prefix-cache hits round differently


# ---- chat ------------------------------------------------------------------------------------------


def test_chat_equals_offline_chat_streamed_or_not(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paged attention?"}]
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    response = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=20, **GREEDY)
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 20

    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == choice.message.content and finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == response.usage.model_dump()


def test_chat_n_choices(client):
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=5, seed=7, temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 10


def test_chat_logprobs_streamed_or_not(client):
    messages = [{"role": "user", "content": "Count to five."}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
    response = client.chat.completions.create(**kwargs)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert [top.logprob for top in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.bytes == list(entry.token.encode())
    streamed = [entry for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    # The second run reads the prompt from the prefix cache: the same tokens, logprobs to fp32 rounding.
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


# ---- the other routes ----------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(server, offline):
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[3]}).json()
    assert tokenized["tokens"] == offline.get_tokenizer().encode(PROMPTS[3])
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 512
    detokenized = httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert detokenized == {"prompt": PROMPTS[3]}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3


def test_generate_route_streamed_and_not_agree_with_offline(server, offline):
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert whole == {"text": _offline_greedy(offline, PROMPTS[1], 12).outputs[0].text, "finish_reason": "length"}
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert "".join(line["text"] for line in lines) == whole["text"]
    assert [line["finish_reason"] for line in lines][-1] == "length"


def test_health_and_version(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_metrics_count_tokens_and_latencies(server, client):
    labels = {"model_name": "tiny"}
    before = _metrics(server)

    def delta(text: str, name: str, extra: dict | None = None) -> float:
        return metric_value(text, name, {**labels, **(extra or {})}) - metric_value(before, name, {**labels, **(extra or {})})

    response = client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=9, **GREEDY)
    prompt_tokens = response.usage.prompt_tokens
    # The engine thread records a step's metrics just after handing out its tokens.
    wait_until(lambda: delta(_metrics(server), "vllm:request_success_total", {"finished_reason": "length"}) == 1,
               30, "the finished request in /metrics")
    after = _metrics(server)
    assert delta(after, "vllm:prompt_tokens_total") == prompt_tokens
    assert delta(after, "vllm:generation_tokens_total") == 9
    assert delta(after, "vllm:time_to_first_token_seconds_count") == 1
    assert delta(after, "vllm:inter_token_latency_seconds_count") == 8
    assert delta(after, "vllm:e2e_request_latency_seconds_count") == 1
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                  "pagellm:kv_cache_waste_perc"):
        assert metric_value(after, gauge, labels) == 0
    assert metric_value(after, "vllm:num_preemptions_total", labels) >= 0


# ---- disconnects and concurrency -----------------------------------------------------------------


def test_disconnected_stream_is_aborted_and_frees_its_blocks(server):
    labels = {"model_name": "tiny", "finished_reason": "abort"}
    aborted_before = metric_value(_metrics(server), "vllm:request_success_total", labels)
    body = {"model": "tiny", "prompt": PROMPTS[5], "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
        assert metric_value(_metrics(server), "vllm:kv_cache_usage_perc", {"model_name": "tiny"}) > 0
    # Leaving the block closed the connection; 400 tokens would take seconds more to finish on their own.

    def freed() -> bool:
        text = _metrics(server)
        return (metric_value(text, "vllm:kv_cache_usage_perc", {"model_name": "tiny"}) == 0
                and metric_value(text, "vllm:num_requests_running", {"model_name": "tiny"}) == 0)

    wait_until(freed, 30, "KV usage back to zero after the client left")
    assert metric_value(_metrics(server), "vllm:request_success_total", labels) == aborted_before + 1


def test_32_concurrent_streaming_clients_all_complete(server, client):
    prompts = PROMPTS[:8]
    expected = {p: client.completions.create(model="tiny", prompt=p, max_tokens=16, **GREEDY).choices[0].text
                for p in prompts}

    async def one(async_client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None, int]:
        stream = await async_client.completions.create(model="tiny", prompt=prompt, max_tokens=16, stream=True,
                                                       stream_options={"include_usage": True}, **GREEDY)
        text, finish, usage = "", None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
        return text, finish, usage.completion_tokens

    async def run_all() -> list[tuple[str, str | None, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as async_client:
            return await asyncio.gather(*(one(async_client, prompts[i % len(prompts)]) for i in range(32)))

    results = asyncio.run(run_all())
    for i, (text, finish, completion_tokens) in enumerate(results):
        assert (text, finish, completion_tokens) == (expected[prompts[i % len(prompts)]], "length", 16), i
