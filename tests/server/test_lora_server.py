"""LoRA adapters through the server with the openai client: --lora-modules (both forms), adapter names as
`model` and in /v1/models, unknown names 404, and the runtime load/unload routes vLLM gates behind
VLLM_ALLOW_RUNTIME_LORA_UPDATING."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import httpx
import openai
import pytest

from tests.lora_adapters import ATTENTION, MLP, peft_greedy, save_adapter

PROMPT = [1, 450, 4996, 17354, 1701, 29916]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, module_tmp_path_factory) -> dict[str, str]:
    root = module_tmp_path_factory.mktemp("server-adapters")
    return {
        "alpha": save_adapter(tiny_llama_dir, root / "alpha", rank=8, targets=ATTENTION, seed=11),
        "beta": save_adapter(tiny_llama_dir, root / "beta", rank=4, targets=MLP, seed=12),
        "gamma": save_adapter(tiny_llama_dir, root / "gamma", rank=16, targets=ATTENTION + MLP, seed=13),
    }


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, adapters, default_tokenizer) -> dict[str, str]:
    texts = {name: peft_greedy(tiny_llama_dir, path, [PROMPT], MAX_TOKENS)[0] for name, path in adapters.items()}
    texts["tiny"] = peft_greedy(tiny_llama_dir, None, [PROMPT], MAX_TOKENS)[0]
    return {name: default_tokenizer.decode(tokens) for name, tokens in texts.items()}


@pytest.fixture(scope="module")
def server(start_server, adapters):
    beta = json.dumps({"name": "beta", "path": adapters["beta"], "base_model_name": "tiny"})
    with mock.patch.dict(os.environ, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}):
        return start_server("--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--lora-modules",
                            f"alpha={adapters['alpha']}", beta)


def _complete(client: openai.OpenAI, model: str) -> str:
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    return completion.choices[0].text


def test_adapters_are_models_that_answer_as_peft_does(server, client, expected):
    cards = {card.id: card for card in client.models.list().data}
    assert {"tiny", "tiny-alias", "alpha", "beta"} <= set(cards)
    assert cards["alpha"].parent == "tiny" and cards["beta"].parent == "tiny"
    # Mixed in flight together, over one device slot.
    names = ["tiny", "alpha", "beta", "alpha", "tiny", "beta"]
    with ThreadPoolExecutor(len(names)) as pool:
        texts = list(pool.map(lambda name: _complete(client, name), names))
    for name, text in zip(names, texts):
        assert text == expected[name], name
    assert expected["alpha"] != expected["tiny"] != expected["beta"]
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0)
    assert chat.choices[0].message.content is not None


def test_an_unknown_adapter_is_a_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "delta")
    assert "delta" in str(info.value)


def test_adapters_load_and_unload_at_run_time(server, client, adapters, expected, tmp_path):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": adapters["gamma"]})
        assert loaded.status_code == 200, loaded.text
        assert _complete(client, "gamma") == expected["gamma"]
        assert "gamma" in {card.id for card in client.models.list().data}
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": adapters["gamma"]})
        assert again.status_code == 400 and "already been loaded" in again.text
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json is missing" in bad.text
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
        assert missing.status_code == 400
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert unloaded.status_code == 200, unloaded.text
        with pytest.raises(openai.NotFoundError):
            _complete(client, "gamma")
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 404


def test_runtime_routes_exist_only_where_the_environment_allows_them(monkeypatch):
    from fastapi import FastAPI

    from pagellm.lora import serving as lora_serving

    def paths() -> set[str]:
        app = FastAPI()
        lora_serving.install(app)
        return set(app.openapi()["paths"])

    for name in lora_serving.RUNTIME_UPDATING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert "/v1/load_lora_adapter" not in paths()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths()


def test_lora_modules_take_both_of_vllms_forms_and_refuse_the_rest():
    from pagellm.lora.serving import LoRAModulePath, parse_lora_modules

    parsed = parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    assert parsed == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m")]
    for bad, words in (["nopath", "name=path"], ['{"name": "b"}', "must be"], ["a=/x a=/z".split(), "more than once"],
                       ["{oops", "not valid JSON"]):
        with pytest.raises(ValueError, match=words):
            parse_lora_modules(bad if isinstance(bad, list) else [bad])
