"""The engine on the Triton attention backend, on CPU under TRITON_INTERPRET=1 (set in tests/conftest.py).

Greedy output equals transformers with chunked prefill (chunks attend to cached blocks and to themselves)
and prefix caching; and a decode step run through the CUDA-graph buffers (padding rows included) equals
the same step run eagerly, which is what a graph replays.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests are for machines without CUDA; tests/gpu run the engine on the GPU",
                allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed: `pip install triton` runs these tests on CPU")

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.attention.backend import BACKEND_ENV, StepAttentionInputs  # noqa: E402
from tests.helpers import PROMPTS, hf_greedy  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def triton_llm(tiny_llama_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BACKEND_ENV, "triton")
        # A 16-token budget chunks the longer prompts alongside the other requests' decodes.
        llm = LLM(tiny_llama_dir, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4,
                  kv_cache_memory_bytes=8 << 20)
    assert llm.llm_engine.core.runner.attn_backend.name == "triton"
    return llm


def test_greedy_matches_hf_with_chunked_prefill_and_prefix_cache(triton_llm, hf_tiny, default_tokenizer):
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[2] + " and more"]
    expected = [hf_greedy(hf_tiny, default_tokenizer, default_tokenizer.encode(p), MAX_TOKENS, ignore_eos=True)
                for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round reads its prompts' full blocks from the prefix cache
        outputs = triton_llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert triton_llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0


def test_graph_buffers_step_equals_eager_step(triton_llm):
    from pagellm.worker.cuda_graphs import DecodeGraphs

    runner = triton_llm.llm_engine.core.runner
    rng = np.random.default_rng(0)
    seq_lens = np.array([5, 40, 17])
    block_size = runner.block_size
    tables = rng.permutation(12)[:9].reshape(3, 3)
    positions = seq_lens - 1
    step = StepAttentionInputs(3, np.ones(3, np.int64), seq_lens, tables,
                               tables[np.arange(3), positions // block_size] * block_size + positions % block_size)
    input_ids = rng.integers(0, runner.vocab_size, 3)
    with torch.inference_mode():
        eager = runner.model(torch.from_numpy(input_ids), torch.from_numpy(positions), runner.kv_caches,
                             runner.attn_backend.build_metadata(step))
        graphs = DecodeGraphs(runner.model, runner.attn_backend, runner.kv_caches, 4, runner.max_blocks,
                              runner.max_model_len, runner.device)
        size = graphs.fill(input_ids, positions, step)
        assert size == 4
        static = graphs.forward_static(size)
    assert torch.allclose(static[:3], eager, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(static).all(), "the padding row reads nothing and stays finite"


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    from pagellm.worker.cuda_graphs import MAX_CAPTURE_SIZE, capture_sizes

    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_SIZE


def test_decode_splits_fill_the_gpu_only_over_long_contexts():
    from pagellm.attention.backend import AttentionShape
    from pagellm.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(AttentionShape(32, 8, 128, 16), torch.device("cpu"))
    backend.num_sms = 132
    assert backend.decode_splits(1, 100) == 1, "a short context is not worth splitting"
    assert backend.decode_splits(1, 8192) == 16
    assert backend.decode_splits(256, 8192) == 1, "256 x 8 programs already fill the GPU"
    assert all(s & (s - 1) == 0 for n in (1, 3, 7, 20) for s in [backend.decode_splits(n, 5000)])
