"""On a CUDA device: the Triton kernels against the torch reference (bf16 too), greedy == transformers on a tiny
random Llama in fp32 (CUDA graphs and eager) and bf16 (compared as vLLM's check_logprobs_close does), and
loading straight into bf16 on the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import AttentionShape
from pagellm.attention.paged import TorchAttentionBackend, paged_attention
from tests.attention_cases import make_step

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
MAX_TOKENS = 16


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 512, 40).tolist()
    prompts = [rng.integers(3, 512, n).tolist() for n in (3, 17, 70, 5, 33)]
    # Two prompts behind one 40-token prefix: they share its full blocks.
    return prompts + [shared + [7, 8], shared + [9]]


def _hf_greedy(model, prompt: list[int], logprobs: int = 0):
    ids = torch.tensor([prompt], device=CUDA)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    top = [s[0].float().log_softmax(-1).topk(max(logprobs, 1)).indices.tolist() for s in out.scores]
    return tokens, top


def _hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(CUDA).eval()


def _llm(path: str, dtype: str, **kwargs) -> LLM:
    # 48 tokens a step: the 70-token prompt is chunked, alongside the others' decodes.
    return LLM(path, dtype=dtype, device="cuda", gpu_memory_utilization=0.5, kv_cache_memory_bytes=64 << 20,
               max_num_batched_tokens=48, max_num_seqs=8, **kwargs)


# Paired rather than crossed: every dtype, block size and GQA ratio (4, 3, 1) is covered with a third of the compiles.
@pytest.mark.parametrize("dtype,block_size,num_heads,num_kv_heads", [
    (torch.bfloat16, 16, 32, 8), (torch.float16, 32, 12, 4), (torch.float32, 16, 8, 8), (torch.bfloat16, 32, 12, 4),
])
def test_triton_backend_matches_torch_reference(dtype, block_size, num_heads, num_kv_heads):
    """A mixed step (decodes of ragged and long contexts, a fresh and a continued prefill) at head size 128."""
    shape = AttentionShape(num_heads, num_kv_heads, head_dim=128, block_size=block_size)
    computed, scheduled = [0, 37, 3000, 500, 0, 200], [1, 1, 1, 1, 100, 64]
    step, q, k, v, k_cache, v_cache = make_step(shape, computed, scheduled, num_blocks=400, seed=block_size)
    from pagellm.attention.triton_backend import TritonAttentionBackend

    results = []
    for backend in (TorchAttentionBackend(shape, CUDA, None), TritonAttentionBackend(shape, CUDA)):
        kc, vc = k_cache.to(CUDA, dtype), v_cache.to(CUDA, dtype)
        meta = backend.build_metadata(step)
        out = paged_attention(q.to(CUDA, dtype), k.to(CUDA, dtype), v.to(CUDA, dtype), kc, vc, meta,
                              shape.head_dim ** -0.5)
        results.append((out.float(), kc, vc))
    (ref, ref_k, ref_v), (out, out_k, out_v) = results
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    assert torch.isfinite(out).all()
    error = ((out - ref).norm() / ref.norm()).item()
    assert error < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], error


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_fp32_equals_transformers(gpu_tiny_dir, enforce_eager):
    prompts = _prompts()
    hf = _hf_model(gpu_tiny_dir, torch.float32)
    expected = [_hf_greedy(hf, p)[0] for p in prompts]
    del hf
    llm = _llm(gpu_tiny_dir, "float32", enforce_eager=enforce_eager)
    runner = llm.llm_engine.core.runner
    assert runner.attn_backend.name == "triton"
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second round reads the prompts' full blocks from the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0
    if enforce_eager:
        assert runner.graphs is None
    else:
        assert runner.graphs.num_replays > 0, "decode steps ran through the captured graphs"


def test_greedy_bf16_close_to_transformers(gpu_tiny_dir):
    """bf16 rounding can flip a near-tie: where the tokens first differ, each side's token must be in the
    other's top 5, and the rest of that sequence is not compared (vLLM's check_logprobs_close)."""
    prompts = _prompts()
    hf = _hf_model(gpu_tiny_dir, torch.bfloat16)
    expected = [_hf_greedy(hf, p, logprobs=5) for p in prompts]
    del hf
    llm = _llm(gpu_tiny_dir, "bfloat16")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    exact = 0
    for output, (hf_tokens, hf_top) in zip(outputs, expected):
        ours = output.outputs[0]
        for i, (a, b) in enumerate(zip(ours.token_ids, hf_tokens)):
            if a != b:
                assert a in hf_top[i], f"position {i}: pagellm's {a} not in transformers' top 5 {hf_top[i]}"
                assert b in ours.logprobs[i], f"position {i}: transformers' {b} not in pagellm's top 5"
                break
        else:
            exact += 1
    assert exact >= 1, "no sequence equals transformers exactly: a systematic error, not rounding"


def test_loads_straight_into_bf16_on_the_device(tmp_path):
    """Peak device memory while loading is the bf16 weights, not a float32 copy (which would be twice that)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagellm.models import loader

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="200MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    source = loader.resolve_model(str(tmp_path))
    hf_config, _ = loader.load_hf_config(source)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = loader.load_model(source, hf_config, None, torch.bfloat16, CUDA, 256)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    weights = model.weights_bytes()
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in model.parameters())
    assert peak < 1.1 * weights, f"loading peaked at {peak / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"
