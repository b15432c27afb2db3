"""On a CUDA device: the Triton kernels of the HF quantized formats against float64 references, in bfloat16,
float16 and float32 activations, and engines on tiny AWQ, GPTQ and W8A8 checkpoints whose greedy tokens equal
the same checkpoints' on the CPU. tests/test_triton_quant.py and tests/test_w8a8_triton.py run the same kernels
on CPU tensors under TRITON_INTERPRET=1 (fp32/fp16 only: the interpreter mishandles bf16).

Bounds per output with S = sum_k |w_k x_k|: float32 2e-6 S; float16 2^-10 S plus the output's rounding; bfloat16
2^-7 S (the tiles round the weight to bfloat16 before tl.dot, and y is rounded to bfloat16).
"""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from pagellm.ops import w8a8_kernels as wk
from pagellm.ops import wna16

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BOUND = {torch.float32: 2e-6, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -7}
DTYPES = list(BOUND)


def _on_cuda(weight: wna16.GroupQuantWeight) -> wna16.GroupQuantWeight:
    return replace(weight, **{f.name: getattr(weight, f.name).to(CUDA) for f in fields(weight)
                              if isinstance(getattr(weight, f.name), torch.Tensor)})


def _assert_within(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None, dtype) -> None:
    x64 = x.double().cpu()
    expected = x64 @ w64.T + (bias.double().cpu() if bias is not None else 0)
    magnitude = x64.abs() @ w64.abs().T + (bias.double().abs().cpu() if bias is not None else 0)
    error = (y.double().cpu() - expected).abs() - BOUND[dtype] * magnitude
    assert torch.isfinite(y).all() and (error <= 1e-30).all(), f"{dtype}: worst excess {error.max().item():.2e}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("variant", ["plain", "act_order", "uneven"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_awq_gptq_triton_matches_the_dequantized_weights(bits, variant, dtype):
    from pagellm.ops.triton_quant import group_quant_matmul
    from tests.quant_checkpoints import random_group_quant_weight

    weight = random_group_quant_weight(bits, 512, 300, variant, seed=bits)
    w64 = wna16.dequantize(weight).double()
    cuda_weight = _on_cuda(weight)
    bias = torch.randn(300, generator=torch.Generator().manual_seed(1)).to(dtype)
    for rows in (1, 7, 64, 257):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = group_quant_matmul(x.to(CUDA), cuda_weight, bias.to(CUDA))
        assert y.dtype == dtype and y.device.type == "cuda"
        _assert_within(y, x, w64, bias, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 200])
@pytest.mark.parametrize("rotated", [False, True])
def test_int8_w8a8_triton_equals_the_torch_reference(dtype, rows, rotated):
    from pagellm.ops import w8a8_triton as wt

    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 384, generator=generator) * 2).to(dtype)
    w = torch.randn(272, 384, generator=generator)
    q, scale, rotation = wk.quantize_int8_rotated(w) if rotated else (*wk.quantize_rows_int8(w), 1)
    y = wt.int8_linear(x.to(CUDA), q.to(CUDA), scale.to(CUDA), None, None, rotation)
    expected = wk.int8_linear_reference(x, q, scale, None, None, rotation)
    # The same int8 activations and exact int32 sums; only the float epilogue's rounding may differ.
    torch.testing.assert_close(y.cpu().float(), expected.float(), rtol=2 ** -7 if dtype != torch.float32 else 1e-6,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_k", [384, 128])
def test_fp8_triton_matches_float64(dtype, block_k):
    from pagellm.ops import w8a8_triton as wt

    generator = torch.Generator().manual_seed(block_k)
    x = torch.randn(33, 384, generator=generator).to(dtype)
    w8 = (torch.randn(272, 384, generator=generator) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(272, 384 // block_k, generator=generator) * 0.02 + 1e-3
    y = wt.fp8_linear(x.to(CUDA), w8.to(CUDA), scales.to(CUDA), block_k, None)
    _assert_within(y, x, wk.dequantize_fp8(w8, scales, block_k).double(), None, dtype)


@pytest.fixture(scope="module")
def quantized_dirs(gpu_tiny_dir, module_tmp_path_factory):
    from tests.quant_checkpoints import QuantSpec, write_quantized
    from tests.w8a8_checkpoints import write_quantized as write_w8a8

    root = module_tmp_path_factory.mktemp("gpu-quantized")
    dirs = {}
    for name, spec in (("awq", QuantSpec("awq", group_size=32)),
                       ("gptq", QuantSpec("gptq", bits=4, group_size=32, desc_act=True)),
                       ("w4a16", QuantSpec("compressed-tensors", bits=4, group_size=32, sym=False))):
        write_quantized(gpu_tiny_dir, root / name, root / f"{name}-dequantized", spec)
        dirs[name] = str(root / name)
    dirs["w8a8"] = write_w8a8(gpu_tiny_dir, root / "w8a8", "int8-channel-dynamic")[0]
    dirs["fp8"] = write_w8a8(gpu_tiny_dir, root / "fp8", "fp8-channel-dynamic")[0]
    from tests.nvfp4_checkpoints import compressed_checkpoint, write_checkpoint

    modules, _ = compressed_checkpoint(gpu_tiny_dir)
    dirs["nvfp4"] = write_checkpoint(gpu_tiny_dir, root / "nvfp4", modules, "compressed-tensors", "NVFP4A16")
    return dirs


def _check_cpu_and_cuda_agree(path: str, **engine) -> None:
    from pagellm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [1, 17 + i, 40, 99, 7 * i + 3]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for device in ("cpu", "cuda"):
        llm = LLM(path, device=device, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20,
                  enforce_eager=device == "cpu", **engine)
        tokens[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    # float32 on both: the products differ only in summation order, far below a greedy margin on most steps.
    agree = sum(a == b for a, b in zip(tokens["cpu"], tokens["cuda"]))
    assert agree >= 3, (tokens["cpu"], tokens["cuda"])


@pytest.mark.parametrize("name", ["awq", "gptq", "w4a16", "w8a8", "fp8", "nvfp4"])
def test_quantized_checkpoints_give_the_cpu_engine_s_tokens_on_cuda(quantized_dirs, name):
    _check_cpu_and_cuda_agree(quantized_dirs[name])


@pytest.mark.parametrize("shorthand", ["fp8_per_channel", "fp8_per_block", "mxfp8"])
def test_vllms_online_shorthands_give_the_cpu_engine_s_tokens_on_cuda(gpu_tiny_dir, shorthand):
    """Quantized on the GPU as the layers load (the scales computed there), then the Triton fp8 kernel."""
    _check_cpu_and_cuda_agree(gpu_tiny_dir, quantization=shorthand)
