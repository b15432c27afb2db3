"""Sliding-window attention: which layers slide, every attention backend against a dense windowed
reference, and the engine against transformers' Mistral and Qwen2 with windows far shorter than the prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention import native
from pagellm.attention.backend import BACKEND_ENV, AttentionShape, triton_available
from pagellm.attention.paged import TorchAttentionBackend, kv_write_index, write_kv
from pagellm.core.kv_cache_manager import cdiv
from pagellm.models.sliding_window import layer_sliding_window, model_sliding_window
from tests.attention_cases import make_step
from tests.helpers import PROMPTS, hf_greedy

# ---- which layers slide ------------------------------------------------------------------------------


def test_layer_windows_of_each_config_shape():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    mistral = MistralConfig(num_hidden_layers=2, sliding_window=16)
    assert [layer_sliding_window(mistral, i) for i in range(2)] == [16, 16]
    assert model_sliding_window(mistral) == 16
    assert model_sliding_window(MistralConfig(num_hidden_layers=2, sliding_window=None)) is None
    assert layer_sliding_window(LlamaConfig(num_hidden_layers=2), 0) is None
    # Qwen2: layers from max_window_layers on slide, and only with use_sliding_window.
    qwen = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert [layer_sliding_window(qwen, i) for i in range(3)] == [None, 8, 8]
    assert model_sliding_window(qwen) is None  # a global layer keeps every block
    qwen_off = Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=8)
    assert [layer_sliding_window(qwen_off, i) for i in range(2)] == [None, None]
    # Gemma 3: interleaved local (sliding) and global layers through layer_types.
    gemma = Gemma3TextConfig(num_hidden_layers=7, sliding_window=8)
    assert [layer_sliding_window(gemma, i) for i in range(7)] == [8, 8, 8, 8, 8, None, 8]
    assert model_sliding_window(gemma) is None


def test_config_without_layer_types_or_with_a_bad_window():
    from types import SimpleNamespace

    old_qwen = SimpleNamespace(model_type="qwen2", sliding_window=4, use_sliding_window=True, max_window_layers=2,
                               num_hidden_layers=3)
    assert [layer_sliding_window(old_qwen, i) for i in range(3)] == [None, None, 4]
    with pytest.raises(ValueError, match="sliding_window=-2"):
        layer_sliding_window(SimpleNamespace(sliding_window=-2), 0)
    with pytest.raises(ValueError, match="layer_types"):
        layer_sliding_window(SimpleNamespace(sliding_window=4, layer_types=["sliding_attention"]), 3)


# ---- backends against a dense windowed reference ---------------------------------------------------


def _windowed_reference(q, keys, values, first_position, window, scale):
    """q: [n, H, D] at positions first_position..; keys/values [L, KVH, D]; key j visible to query p when
    p - window < j <= p."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).double()
    v = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    positions = first_position + torch.arange(q.shape[0])[:, None]
    key_positions = torch.arange(keys.shape[0])[None, :]
    visible = (key_positions <= positions) & (key_positions > positions - window)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).float()


def _backends(shape):
    backends = [pytest.param(lambda: TorchAttentionBackend(shape, torch.device("cpu"), None), id="torch")]
    kernel = native.decode_kernel()
    backends.append(pytest.param(lambda: TorchAttentionBackend(shape, torch.device("cpu"), kernel), id="native",
                                 marks=pytest.mark.skipif(kernel is None, reason="no C compiler")))

    def triton_backend():
        from pagellm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(shape, torch.device("cpu"))

    backends.append(pytest.param(triton_backend, id="triton", marks=pytest.mark.skipif(
        not triton_available() or torch.cuda.is_available(), reason="triton interpreter tests run without CUDA")))
    return backends


SHAPE = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=32, block_size=4)


@pytest.mark.filterwarnings("ignore:All-NaN slice")
@pytest.mark.parametrize("make_backend", _backends(SHAPE))
@pytest.mark.parametrize("window", [1, 6, 13])
def test_backends_attend_within_the_window_and_never_read_before_it(make_backend, window):
    """Decodes at contexts around and past the window, a fresh prompt several windows long, continued chunks.
    Every block-table entry wholly before a sequence's first window key points at a block of NaNs: a backend
    that read one would return NaN."""
    computed = [0, 5, 13, 40, 69, 0, 40, 17, 3]
    scheduled = [1, 1, 1, 1, 1, 30, 9, 20, 2]
    num_blocks = 96
    step, q, k, v, k_cache, v_cache = make_step(SHAPE, computed, scheduled, num_blocks, seed=window)
    bs = SHAPE.block_size
    reference_k, reference_v = k_cache.clone(), v_cache.clone()
    slots = step.slot_mapping
    rows = torch.from_numpy(kv_write_index(slots // bs, slots % bs, SHAPE.num_kv_heads, bs))
    write_kv(k, v, reference_k, reference_v, rows)
    scale = SHAPE.head_dim**-0.5
    expected, offset = [], 0
    for i in range(len(computed)):
        seq_len = computed[i] + scheduled[i]
        table = step.block_tables[i, : -(-seq_len // bs)]
        history_k = reference_k[table].transpose(1, 2).reshape(-1, SHAPE.num_kv_heads, SHAPE.head_dim)[:seq_len]
        history_v = reference_v[table].transpose(1, 2).reshape(-1, SHAPE.num_kv_heads, SHAPE.head_dim)[:seq_len]
        expected.append(_windowed_reference(q[offset : offset + scheduled[i]], history_k, history_v, computed[i],
                                            window, scale))
        offset += scheduled[i]
    poison = sorted(set(range(num_blocks)) - set(step.block_tables.ravel().tolist()))[0]
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    for i in range(len(computed)):
        first_key = max(0, computed[i] - window + 1)
        step.block_tables[i, : first_key // bs] = poison
    backend = make_backend()
    meta = backend.build_metadata(step)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.cat(expected), atol=2e-5, rtol=1e-4)
    # The same step without a window sees everything, poison included: the test can fail.
    if window == 1:
        full = backend.forward(q, k, v, k_cache, v_cache, backend.build_metadata(step), scale)
        assert not torch.isfinite(full).all()


# ---- the engine against transformers -----------------------------------------------------------------

WINDOW = 16
MAX_TOKENS = 12
# Two to seven windows long, and one shorter than a window.
ENGINE_PROMPTS = [PROMPTS[2], PROMPTS[1], PROMPTS[5], PROMPTS[8]]


def _save_sliding(path, tokenizer, model_type: str) -> str:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import TINY_CONFIG

    torch.manual_seed(0)
    common = dict(TINY_CONFIG, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, sliding_window=WINDOW)
    if model_type == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    else:
        # Layer 0 attends to everything, layers 1 and 2 slide.
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=1))
    model.to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def sliding_model(request, module_tmp_path_factory, default_tokenizer):
    """(checkpoint dir, transformers' greedy continuation of each prompt)."""
    from transformers import AutoModelForCausalLM

    path = _save_sliding(module_tmp_path_factory.mktemp(request.param), default_tokenizer, request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt_ids = [default_tokenizer.encode(p) for p in ENGINE_PROMPTS]
    assert max(map(len, prompt_ids)) > 5 * WINDOW
    expected = [hf_greedy(hf, default_tokenizer, ids, MAX_TOKENS, ignore_eos=True) for ids in prompt_ids]
    # The window decides these outputs: with full attention a long prompt continues otherwise.
    no_window = {"sliding_window": None} if request.param == "mistral" else {"layer_types": ["full_attention"] * 3}
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **no_window).eval()
    assert any(hf_greedy(full, default_tokenizer, prompt_ids[i], MAX_TOKENS, ignore_eos=True) != expected[i]
               for i in (0, 2))
    return path, expected


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _generate(llm, prompts=ENGINE_PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_batched_and_single_match_hf_and_slid_out_blocks_are_freed(sliding_model, default_tokenizer):
    path, expected = sliding_model
    llm = LLM(path, dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
              enable_prefix_caching=False, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.core.runner.native_decode is not None
    assert _generate(llm) == expected
    (single,) = llm.generate(ENGINE_PROMPTS[3:4], GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == expected[3]
    num_tokens = len(default_tokenizer.encode(ENGINE_PROMPTS[3])) + MAX_TOKENS
    if "mistral" in path:
        # Every layer slides: the sequence holds its window and the 32-token chunk being computed, not all
        # of its blocks.
        assert cdiv(32, 4) < single.kv.peak_blocks <= cdiv(WINDOW - 1 + 32, 4) + 1 < cdiv(num_tokens, 4)
    else:
        assert single.kv.peak_blocks == cdiv(num_tokens - 1, 4)  # a global layer keeps every block
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


def test_chunked_prefix_cached_and_torch_path_match_hf(sliding_model, monkeypatch):
    path, expected = sliding_model
    monkeypatch.setenv(BACKEND_ENV, "torch")
    # 14-token chunks: shorter than the window, so every chunk of a long prompt reads cached keys of the window.
    llm = LLM(path, dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=14,
              enable_prefix_caching=True, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.core.runner.native_decode is None
    for _ in range(2):  # the second round starts from the prompts' cached blocks
        assert _generate(llm) == expected
    assert llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0


def test_a_prompt_longer_than_the_whole_pool_runs_when_every_layer_slides(sliding_model, default_tokenizer):
    """max_model_len is the model's max_position_embeddings, far past the window, and the pool only has to
    hold a window plus a chunk: 13 blocks of 4 tokens for a 120-token sequence. A model with a global layer
    (Qwen2's layer 0 here) keeps every block, and the same pool is refused with the numbers."""
    path, expected = sliding_model
    settings = dict(dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                    enable_prefix_caching=False, num_gpu_blocks_override=cdiv(WINDOW - 1 + 32, 4) + 1)
    if "qwen2" in path:
        with pytest.raises(ValueError, match="needs 128 blocks at once"):
            LLM(path, **settings)
        return
    llm = LLM(path, **settings)
    assert llm.llm_engine.core.model_info.max_model_len == 512 > WINDOW
    assert len(default_tokenizer.encode(ENGINE_PROMPTS[3])) + MAX_TOKENS > 13 * 4
    assert _generate(llm, ENGINE_PROMPTS[3:4]) == expected[3:4]


@pytest.mark.skipif(not triton_available() or torch.cuda.is_available(),
                    reason="the Triton interpreter run is for machines without CUDA (tests/gpu run the kernels)")
def test_triton_backend_with_freed_blocks_matches_hf(sliding_model, monkeypatch):
    path, expected = sliding_model
    if "qwen2" in path:
        pytest.skip("one model is enough for the slow interpreter; the kernel cases cover mixed layers")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    llm = LLM(path, dtype="float32", block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
              enable_prefix_caching=False, kv_cache_memory_bytes=4 << 20)
    assert llm.llm_engine.core.runner.attn_backend.name == "triton"
    (output,) = llm.generate(ENGINE_PROMPTS[:1], GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == expected[0]
    assert output.kv.peak_blocks <= cdiv(WINDOW - 1 + 16, 4) + 1
