"""On a CUDA device, the Triton kernels that came after the attention backend and the quantized products: the
fused-MoE kernel, the latent (MLA) decode kernel, the LoRA shrink/expand kernels and the 8-bit KV cache's writer
and step path, in the dtypes the interpreter cannot run (bfloat16) as well as float32; then the engines that use
them on the device, greedy against transformers in float32: a Mixtral, a DeepSeek-V3 (MLA + MoE), LoRA adapters
(against transformers + peft), speculative decoding's verification steps (against plain decode) and an fp8 KV
cache (against the same engine on the CPU). The cases are the CPU tests' own, moved to the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import AttentionShape, StepAttentionInputs
from pagellm.attention.paged import DecodeMetadata, TorchAttentionBackend
from tests.gpu.conftest import save_word_tokenizer
from tests.gpu.test_gpu import MAX_TOKENS, _hf_greedy, _hf_model, _prompts

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(device="cuda", gpu_memory_utilization=0.5, kv_cache_memory_bytes=64 << 20,
                   max_num_batched_tokens=48, max_num_seqs=8)


# ---- kernels ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,routing", [(1, "softmax"), (70, "softmax"), (33, "deepseek_v3")])
def test_fused_moe_kernel_matches_the_grouped_path(dtype, tokens, routing):
    """Expert sizes that are not tile multiples (hidden 200, intermediate 72), 8 experts, top 2."""
    from pagellm.layers.activation import SiluAndMul
    from pagellm.layers.fused_moe import Routing, grouped_experts
    from pagellm.ops.triton_moe import fused_experts

    num_experts, hidden, intermediate = 8, 200, 72
    generator = torch.Generator().manual_seed(tokens)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.1
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.1
    x = torch.randn(tokens, hidden, generator=generator)
    logits = torch.randn(tokens, num_experts, generator=generator)
    router = (Routing.softmax_top_k(2, False) if routing == "softmax"
              else Routing(2, "sigmoid", True, 4, 2, "top2_sum", 2.5, sorted_choice=False))
    weights, ids = router.select(logits)
    w13, w2, x = w13.to(dtype), w2.to(dtype), x.to(dtype)
    expected = grouped_experts(x.double(), weights.double(), ids, num_experts,
                               lambda e, rows, out: out.copy_(F.linear(rows, w13[e].double())),
                               lambda e, rows, out: out.copy_(F.linear(rows, w2[e].double())), 2 * intermediate,
                               SiluAndMul())
    ours = fused_experts(x.to(CUDA), w13.to(CUDA), w2.to(CUDA), weights.to(CUDA), ids.to(CUDA))
    assert ours.dtype == dtype and ours.shape == x.shape
    error = ((ours.double().cpu() - expected).norm() / expected.norm()).item()
    assert error < {torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype], error


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float16)])
@pytest.mark.parametrize("shape_index", [0, 1])
def test_mla_triton_kernel_matches_expanded_attention(q_dtype, cache_dtype, shape_index):
    from pagellm.attention.mla_triton import triton_latent_decode
    from tests.test_mla_kernels import NOPE, SHAPES, TOLERANCE, _absorbed, _case, _expanded_reference

    heads, rank, rope, lens, block_size = SHAPES[shape_index]
    cache, rows, w_uk, w_uv, q_nope, q_pe, decode = _case(3, heads, rank, rope, lens, block_size, cache_dtype)
    on_device = DecodeMetadata(decode.block_tables, decode.context_lens, decode.block_tables_tensor.to(CUDA))
    scale = (NOPE + rope) ** -0.5
    ours = _absorbed(lambda q: triton_latent_decode(q.to(CUDA), cache.to(CUDA), on_device, scale, rank).cpu(),
                     q_nope, q_pe, w_uk, w_uv, q_dtype)
    reference = _expanded_reference(rows, w_uk, w_uv, q_nope, q_pe, rank, scale)
    torch.testing.assert_close(ours, reference, atol=TOLERANCE[q_dtype], rtol=TOLERANCE[q_dtype])


@pytest.mark.parametrize("format_name", ["fp8_e4m3", "int8_per_token_head"])
def test_mla_triton_kernel_reads_quantized_latents(format_name):
    from pagellm.attention.kv_spec import KVCacheFormat
    from pagellm.attention.mla_triton import triton_latent_decode
    from tests.test_mla_kernels import NOPE, SHAPES, _absorbed, _case, _expanded_reference

    heads, rank, rope, lens, block_size = SHAPES[1]
    kv_format = KVCacheFormat.resolve(format_name, torch.float32)
    cache, rows, w_uk, w_uv, q_nope, q_pe, decode = _case(4, heads, rank, rope, lens, block_size, torch.float32,
                                                          kv_format)
    on_device = DecodeMetadata(decode.block_tables, decode.context_lens, decode.block_tables_tensor.to(CUDA))
    scale = (NOPE + rope) ** -0.5
    ours = _absorbed(lambda q: triton_latent_decode(q.to(CUDA), cache.to(CUDA), on_device, scale, rank,
                                                    kv_format=kv_format).cpu(),
                     q_nope, q_pe, w_uk, w_uv, torch.float32)
    reference = _expanded_reference(rows, w_uk, w_uv, q_nope, q_pe, rank, scale)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case_index", [0, 1, 2, 3])
def test_lora_triton_kernels_match_the_reference(case_index, dtype):
    from pagellm.lora.punica import build_mapping
    from pagellm.lora.triton_kernels import add_lora_triton
    from tests.test_lora_kernels import CASES, _operands, _reference

    case = CASES[case_index]
    token_slots = case[0]
    x, out, a, b_t, _ = _operands(case, dtype)
    expected = _reference(x, out, a, b_t, token_slots)
    mapping = build_mapping(token_slots, CUDA)
    result = add_lora_triton(x.to(CUDA), out.to(CUDA), a.to(CUDA), b_t.to(CUDA), mapping).cpu()
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    torch.testing.assert_close(result.double(), expected, **tolerance)
    assert torch.equal(result[token_slots < 0], out[token_slots < 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head"])
def test_kv_cache_triton_writer_equals_the_reference_byte_for_byte(name, dtype):
    from tests.test_kv_cache_dtype import _empty_caches, _format, _reference_caches, _write_case
    from pagellm.attention.triton_backend import TritonAttentionBackend

    kv_format = _format(name)
    k, v, slots, num_blocks, block_size = _write_case(kv_format, dtype, seed=len(name))
    expected, _ = _reference_caches(kv_format, k, v, slots, num_blocks, block_size)
    # K and V as strided views of one fused projection, as the model hands them over.
    tokens, kv_heads, head_dim = k.shape
    fused = torch.cat([k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=1).to(CUDA)
    k_dev, v_dev = (part.view(tokens, kv_heads, head_dim) for part in fused.split(kv_heads * head_dim, dim=1))
    backend = TritonAttentionBackend(AttentionShape(kv_heads, kv_heads, head_dim, block_size, kv_format), CUDA)
    step = StepAttentionInputs(tokens, np.ones(tokens, np.int64), np.ones(tokens, np.int64),
                               (slots // block_size)[:, None], slots)
    caches = [c.to(CUDA) for c in _empty_caches(kv_format, num_blocks, kv_heads, block_size, head_dim)]
    backend.write_kv(k_dev, v_dev, *caches, backend.build_metadata(step))
    for got, want, which in zip(caches, expected, "KV"):
        differ = (got.cpu() != want).nonzero()
        assert not len(differ), f"{which}: {len(differ)} bytes differ, first at {differ[0].tolist()}"


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float32), ("fp8_e5m2", torch.bfloat16),
                                        ("int8_per_token_head", torch.float16), ("fp8", torch.bfloat16)])
def test_kv_cache_triton_step_path_equals_the_torch_path(name, dtype):
    """The writer, split-K decode over a long context and paged prefill on one quantized pool, at head size 128."""
    from pagellm.attention.paged import paged_attention
    from pagellm.attention.triton_backend import TritonAttentionBackend
    from tests.attention_cases import make_step
    from tests.test_kv_cache_dtype import _format

    kv_format = _format(name)
    shape = AttentionShape(8, 2, 128, 16, kv_format)
    step, q, k, v, k_cache, v_cache = make_step(shape, [0, 37, 3000, 0, 45, 16], [1, 1, 1, 23, 30, 9],
                                                num_blocks=400, seed=5)
    k_cache, v_cache = kv_format.pack(k_cache), kv_format.pack(v_cache)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    outs = []
    for backend, device in ((TorchAttentionBackend(shape, torch.device("cpu"), None), torch.device("cpu")),
                            (TritonAttentionBackend(shape, CUDA), CUDA)):
        kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)
        out = paged_attention(q.to(device), k.to(device), v.to(device), kc, vc, backend.build_metadata(step),
                              shape.head_dim ** -0.5)
        outs.append((out.float().cpu(), kc.cpu(), vc.cpu()))
    (ref, ref_k, ref_v), (out, out_k, out_v) = outs
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    error = ((out - ref).norm() / ref.norm()).item()
    assert error < {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], error


# ---- engines on the device -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def word_tokenizer_dir(module_tmp_path_factory):
    path = module_tmp_path_factory.mktemp("word-tokenizer")
    return path, save_word_tokenizer(path)


def _tiny_checkpoint(variant, tokenizer, path, perturb=None) -> str:
    from tests.models.tiny_checkpoints import save_tiny_checkpoint

    return save_tiny_checkpoint(variant, tokenizer, path, perturb)


def _hf_expected(path: str, prompts: list[list[int]]) -> list[list[int]]:
    hf = _hf_model(path, torch.float32)
    expected = [_hf_greedy(hf, p)[0] for p in prompts]
    del hf
    torch.cuda.empty_cache()
    return expected


def _token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _variant(name: str):
    if name == "mixtral":
        from tests.models.test_moe import _mixtral

        return _mixtral, None
    from tests.models.test_mla import _perturb_correction_bias, _v3

    return _v3, _perturb_correction_bias


@pytest.mark.parametrize("name", ["mixtral", "deepseek-v3"])
def test_moe_and_mla_engines_equal_transformers(name, word_tokenizer_dir, tmp_path):
    """Through the Triton fused-MoE kernel and, for DeepSeek-V3, the latent cache and the Triton latent decode,
    with CUDA graphs; the second round reads the prompts' full blocks from the prefix cache."""
    variant, perturb = _variant(name)
    path = _tiny_checkpoint(variant, word_tokenizer_dir[1], tmp_path, perturb)
    prompts = _prompts()
    expected = _hf_expected(path, prompts)
    llm = LLM(path, dtype="float32", enable_prefix_caching=True, **ENGINE_ARGS)
    runner = llm.llm_engine.core.runner
    if name == "deepseek-v3":
        assert "mla-triton" in runner.attn_backend.name
    for _ in range(2):
        assert _token_ids(llm, prompts) == expected
    assert llm.llm_engine.get_stats().kv_cache.prefix_cache_hits > 0


@pytest.mark.parametrize("name", ["qwen3-moe-gptq", "deepseek-v3-fp8-blocks", "gpt-oss-mxfp4"])
def test_quantized_moe_engines_equal_transformers_on_the_dequantized_weights(name, word_tokenizer_dir, tmp_path):
    """Experts as linear layers of their format (GPTQ 4-bit act order; DeepSeek-V3's fp8 blocks, with its
    partial output block and kv_b_proj dequantized for the latent decode), or gpt-oss's MXFP4 experts as the GGUF
    experts' MXFP4_F16 blocks with their biases, on the Triton kernels, decoding eagerly (one product per used
    expert reads the counts on the host)."""
    from tests.models.test_moe_quantized import _qwen3_moe
    from tests.quant_checkpoints import QuantSpec, write_quantized
    from tests.w8a8_checkpoints import write_quantized as write_8bit

    if name == "gpt-oss-mxfp4":
        from tests.models.test_gpt_oss import _gpt_oss, _randomise_biases_and_sinks
        from tests.mxfp4_checkpoints import write_mxfp4

        path = _tiny_checkpoint(_gpt_oss, word_tokenizer_dir[1], tmp_path / "float", _randomise_biases_and_sinks)
        quantized, dequantized = tmp_path / "mxfp4", tmp_path / "dequantized"
        write_mxfp4(path, quantized, dequantized_out=dequantized)
    elif name == "qwen3-moe-gptq":
        path = _tiny_checkpoint(_qwen3_moe, word_tokenizer_dir[1], tmp_path / "float")
        quantized, dequantized = tmp_path / "quantized", tmp_path / "dequantized"
        write_quantized(path, quantized, dequantized, QuantSpec("gptq", bits=4, group_size=16, desc_act=True))
    else:
        variant, perturb = _variant("deepseek-v3")
        path = _tiny_checkpoint(variant, word_tokenizer_dir[1], tmp_path / "float", perturb)
        quantized, dequantized = write_8bit(path, tmp_path / "fp8", "fp8-block-32x16", fmt="fp8")
    prompts = _prompts()
    expected = _hf_expected(str(dequantized), prompts)
    llm = LLM(str(quantized), dtype="float32", **ENGINE_ARGS)
    assert llm.llm_engine.core.runner.graphs is None
    assert _token_ids(llm, prompts) == expected


def test_lora_engine_equals_transformers_and_peft(gpu_tiny_dir, tmp_path):
    """Two adapters (attention only; every projection) and the base model in one batch: the LoRA Triton kernels
    on the device's step."""
    from pagellm.lora.request import LoRARequest
    from peft import PeftModel

    from tests.lora_adapters import ATTENTION, MLP, save_adapter

    prompts = _prompts()[:4]
    adapters = [save_adapter(gpu_tiny_dir, tmp_path / "attn", 8, ATTENTION, seed=1),
                save_adapter(gpu_tiny_dir, tmp_path / "all", 16, ATTENTION + MLP, seed=2)]
    expected = {}
    for adapter in [None, *adapters]:
        model = _hf_model(gpu_tiny_dir, torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter).to(CUDA).eval()
        expected[adapter] = [_hf_greedy(model, p)[0] for p in prompts]
    assert expected[adapters[0]] != expected[None] != expected[adapters[1]], "an adapter changes nothing"
    llm = LLM(gpu_tiny_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, **ENGINE_ARGS)
    requests = [None] + [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters)]
    batch, wanted = [], []
    for prompt_index, prompt in enumerate(prompts):
        for request in requests:
            batch.append((prompt, request))
            wanted.append(expected[None if request is None else request.lora_path][prompt_index])
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], GREEDY, use_tqdm=False,
                           lora_request=[r for _, r in batch])
    assert [o.outputs[0].token_ids for o in outputs] == wanted


def test_speculative_verification_on_the_device_keeps_greedy_output(gpu_tiny_dir, monkeypatch):
    """Drafts of the known continuation with 15% of tokens wrong: every acceptance length and rollback, through
    the Triton kernels' several queries per sequence."""
    from tests.gpu.conftest import VOCAB_SIZE
    from tests.test_spec_decode import NGRAM, _oracle

    prompts = _prompts()
    plain = LLM(gpu_tiny_dir, dtype="float32", **ENGINE_ARGS)
    expected = _token_ids(plain, prompts)
    del plain
    _oracle(monkeypatch, {tuple(p): out for p, out in zip(prompts, expected)}, error=0.15, vocab_size=VOCAB_SIZE)
    llm = LLM(gpu_tiny_dir, dtype="float32", speculative_config=NGRAM, **ENGINE_ARGS)
    assert _token_ids(llm, prompts) == expected
    stats = llm.llm_engine.core.scheduler.get_stats().spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "bfloat16"])
def test_narrow_kv_engine_on_the_device_equals_the_cpu_engine(gpu_tiny_dir, kv_cache_dtype):
    """The same fp8 (or, under the float32 model, bfloat16) pool contents on both devices (the writers are
    byte-exact), so the same greedy tokens up to a near-tie: where they first differ, each side's token must be in
    the other's top 5."""
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    runs = []
    for device_args in (ENGINE_ARGS, dict(device="cpu", kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=48,
                                          max_num_seqs=8)):
        llm = LLM(gpu_tiny_dir, dtype="float32", kv_cache_dtype=kv_cache_dtype, **device_args)
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        del llm
    exact = 0
    for on_gpu, on_cpu in zip(*runs):
        ours, theirs = on_gpu.outputs[0], on_cpu.outputs[0]
        for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
            if a != b:
                assert a in theirs.logprobs[i] and b in ours.logprobs[i], f"position {i}: {a} vs {b}"
                break
        else:
            exact += 1
    assert exact >= len(prompts) - 1, f"{exact} of {len(prompts)} sequences equal"
