"""The CPU GEMM paths of dense linear layers (ops/dense_linear.py): oneDNN-packed weights (one copy where they
serve every row count) and pagellm's bf16 kernel, against the float32 product of the same weights."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from pagellm.cpu_features import cpu_has_amx_bf16, cpu_has_native
from pagellm.layers.linear import LinearBase, ReplicatedLinear
from pagellm.layers.vocab_embedding import VocabEmbedding
from pagellm.models.loader import default_dtype
from pagellm.ops import dense_linear
from pagellm.ops.cpu_build import NEVER_ROWS
from pagellm.ops.dense_linear import FLOAT32_PLAIN_MIN_ROWS, NativeBF16Packed, OneDNNPacked, can_pack_for_cpu
from tests.helpers import built_or_skip


def _layer(in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32,
           shared: bool = False) -> ReplicatedLinear:
    """A linear layer with random weights, prepared for this CPU as a loaded model's layers are."""
    with default_dtype(dtype):
        layer = ReplicatedLinear(in_features, out_features, bias, None, "test")
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    layer.shares_weight = shared
    layer.process_weights_after_loading()
    return layer

needs_native_bf16 = pytest.mark.skipif(not cpu_has_native(torch.bfloat16),
                                       reason="this CPU has no bf16 instructions (no avx512_bf16 / amx_bf16)")


def test_bf16_packs_only_where_the_cpu_has_bf16_instructions():
    cpu = torch.device("cpu")
    assert can_pack_for_cpu(cpu, torch.float32) == torch.backends.mkldnn.is_available()
    assert can_pack_for_cpu(cpu, torch.bfloat16) == (cpu_has_native(torch.bfloat16)
                                                      and torch.backends.mkldnn.is_available())
    assert not can_pack_for_cpu(cpu, torch.float16)


@needs_native_bf16
@pytest.mark.parametrize("rows", [1, 5, 64, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_matches_float32_product(rows, bias):
    torch.manual_seed(rows)
    with default_dtype(torch.bfloat16):
        layer = ReplicatedLinear(96, 160, bias, None, "test")
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    weight = layer.weight.detach().float().clone()
    b = layer.bias.detach().float().clone() if bias else None
    layer.process_weights_after_loading()
    assert layer.weight.numel() == 0, "bf16 keeps one copy: the packed weight"
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 160)
    # float32 accumulation, one bf16 rounding of the result: within a few bf16 ulps of the exact product.
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight, b), rtol=1.6e-2, atol=1e-2)


@needs_native_bf16
def test_shared_weight_keeps_its_plain_copy():
    torch.manual_seed(0)
    layer = _layer(32, 48, False, torch.bfloat16, shared=True)
    assert layer.weight.shape == (48, 32)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("flags, keeps_plain", [(frozenset({"avx2", "fma"}), True),
                                                (frozenset({"avx2", "avx512f"}), False)])
def test_float32_keeps_the_plain_weight_for_mkl_only_without_avx512(monkeypatch, flags, keeps_plain):
    """AVX2: MKL on the plain weight for prefill-sized calls, oneDNN below; AVX-512: oneDNN at every size."""
    monkeypatch.setattr(dense_linear, "cpu_flags", lambda: flags)
    torch.manual_seed(1)
    with default_dtype(torch.float32):
        layer = ReplicatedLinear(24, 40, True, None, "test")
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.process_weights_after_loading()
    assert isinstance(layer.dense_kernel, OneDNNPacked)
    assert (layer.weight.numel() > 0) == keeps_plain
    # Freed means freed: the kernel keeps no reference of its own to the plain weight.
    assert (layer.dense_kernel.weight is not None) == keeps_plain
    assert layer.dense_kernel.plain_min_rows == (FLOAT32_PLAIN_MIN_ROWS if keeps_plain else None)
    with torch.no_grad():
        for rows in (3, FLOAT32_PLAIN_MIN_ROWS + 1):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_loaded_bf16_model_runs_on_packed_weights_and_fused_ops(tiny_llama_dir):
    from pagellm.models import loader
    from pagellm.ops.cpu_ops import cpu_ops

    source = loader.resolve_model(str(tiny_llama_dir))
    config, _ = loader.load_hf_config(source)
    model = loader.load_model(source, config, None, torch.bfloat16, torch.device("cpu"), 64, "auto")
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and not isinstance(m, VocabEmbedding)]
    packed = can_pack_for_cpu(torch.device("cpu"), torch.bfloat16)
    assert linears and all(isinstance(m.dense_kernel, (OneDNNPacked, NativeBF16Packed)) == packed for m in linears)
    assert (model.model.ops is not None) == (cpu_ops() is not None)


# ---- pagellm's own bfloat16 kernel (linear_bf16.c) -------------------------------------------------------

def _linear_kernel():
    from pagellm.ops.linear_bf16 import linear_bf16

    kernel = linear_bf16()
    if kernel is None:
        pytest.skip("the native kernels have no avx512_bf16 dot product on this CPU")
    return kernel


def _on_path(kernel, path: str):
    """The kernel made to take `path` at every row count: "vector" (VDPBF16PS) or "amx" (the tiles, where it has
    them; in_features not a multiple of 32 stays on the vector path)."""
    if path == "amx":
        if not kernel.amx:
            pytest.skip("no AMX tiles in this build, or the OS does not grant them")
        kernel.amx_min_rows = 1
    else:
        kernel.amx_min_rows = NEVER_ROWS
    return kernel


@pytest.mark.parametrize("path", ["vector", "amx"])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 17, 64, 70])
@pytest.mark.parametrize("in_features, out_features", [(2, 16), (64, 48), (576, 80), (130, 64), (96, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_kernel_equals_the_exact_product_rounded(path, rows, in_features, out_features, bias):
    """Row and panel tails (rows not a multiple of 8 or of the tiles' 32, 1-3 panels of 16 left, an odd panel for
    the tiles' pairs), bias or none: float32 accumulation, one rounding, so at least 99% of results equal the
    float64 product rounded to bfloat16, the rest one ulp off."""
    kernel = _on_path(_linear_kernel(), path)
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    out = kernel(x, kernel.pack(weight), b)
    exact = x.double() @ weight.double().T + (b.double() if bias else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.float(), exact.float(), rtol=2**-7, atol=1e-6 * in_features)
    assert (out == exact.to(torch.bfloat16)).float().mean().item() >= 0.99


@pytest.mark.parametrize("path", ["vector", "amx"])
@pytest.mark.parametrize("rows, out_features", [(300, 1040), (530, 80)])
def test_linear_bf16_kernel_over_several_chunks_of_rows(path, rows, out_features):
    """More than one chunk of 256 rows: the tiles then hand each thread blocks of rows times groups of column
    blocks (of unequal counts where the panels do not divide evenly, an odd last panel, a partial last chunk and
    a tail of rows), each output still summed once and rounded once."""
    kernel = _on_path(_linear_kernel(), path)
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16)
    out = kernel(x, kernel.pack(weight), b)
    exact = x.double() @ weight.double().T + b.double()
    torch.testing.assert_close(out.float(), exact.float(), rtol=2**-7, atol=1e-6 * 576)
    assert (out == exact.to(torch.bfloat16)).float().mean().item() >= 0.99


@pytest.mark.parametrize("path", ["vector", "amx"])
def test_linear_bf16_into_writes_its_columns_of_a_wider_output(path):
    """`into` writes y's rows at their stride (a block of columns of a wider output, as the GGUF dense path's
    tiles do) and leaves the other columns as they were."""
    kernel = _on_path(_linear_kernel(), path)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    wide = torch.full((37, 100), 7.0, dtype=torch.bfloat16)
    kernel.into(x, kernel.pack(weight), wide[:, 20:68])
    assert torch.equal(wide[:, 20:68], kernel(x, kernel.pack(weight), None))
    assert (wide[:, :20] == 7).all() and (wide[:, 68:] == 7).all()
    with pytest.raises(ValueError, match="unit column stride"):
        kernel.into(x, kernel.pack(weight), torch.empty(100, 37, dtype=torch.bfloat16).t()[:, 20:68])
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        kernel.into(x.float(), kernel.pack(weight), wide[:, 20:68])


def test_linear_bf16_kernel_layout_and_refusals():
    kernel = _linear_kernel()
    weight = torch.arange(32 * 4, dtype=torch.float32).view(32, 4).to(torch.bfloat16)
    packed = kernel.pack(weight)
    # [out/16][in/2][16][2]: panel 1, column pair 1, output row 16 + 3, input 2 + 1.
    assert packed.shape == (2, 2, 16, 2) and packed[1, 1, 3, 1] == weight[19, 3]
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.pack(torch.zeros(40, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="takes bfloat16"):
        kernel(torch.zeros(3, 4), packed, None)
    with pytest.raises(ValueError, match=r"bias is torch.bfloat16 \(16,\)"):
        kernel(torch.zeros(3, 4, dtype=torch.bfloat16), packed, torch.zeros(16, dtype=torch.bfloat16))


def test_only_the_avx512_bf16_build_has_the_linear_kernel_and_only_with_amx_its_tiles():
    from pagellm.ops import cpu_build
    from pagellm.ops.linear_bf16 import LinearBF16, linear_bf16

    for isa in cpu_build.runnable_isas():
        library = built_or_skip(cpu_build.native_library(isa), "cpu_build.native_library(isa)")
        has_dot = isa == "avx512" and "avx512_bf16" in cpu_build.cpu_flags()
        assert LinearBF16.available(library) == has_dot
        assert (linear_bf16(isa) is not None) == has_dot
        has_tiles = has_dot and cpu_has_amx_bf16()
        assert ctypes.c_int.in_dll(library, "pagellm_linear_bf16_amx_available").value == has_tiles


@needs_native_bf16
def test_bf16_layers_the_kernel_cannot_take_stay_on_onednn():
    torch.manual_seed(0)
    fits, odd = _layer(64, 48, False, torch.bfloat16, shared=True), _layer(64, 40, False, torch.bfloat16, shared=True)
    from pagellm.ops.linear_bf16 import linear_bf16

    assert isinstance(fits.dense_kernel, NativeBF16Packed) == (linear_bf16() is not None)
    assert isinstance(odd.dense_kernel, OneDNNPacked)  # 40 outputs: not whole panels of 16
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        for layer in (fits, odd):
            torch.testing.assert_close(layer(x).float(), F.linear(x.float(), layer.weight.float()), rtol=1.6e-2,
                                       atol=1e-2)
