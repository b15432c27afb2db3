"""The 8-bit weight kernels (pagellm/ops/csrc/w8a8.c) on every instruction set this CPU runs, against float64
products; the builds it cannot run (VNNI) are compile-checked.

int8 W8A8, per output y[r, n] of x [m, K] W^T (W = q_w s_w per channel):
- bit for bit equal to the torch reference (w8a8_kernels.int8_linear_reference: the same int8 activations, the
  int32 sums exact in float64, the same float32 epilogue), in float32 and bfloat16, dynamic and static scales;
- against float64: |y - x_hat W^T| <= 1e-6 |x_hat| |W|^T (x_hat the activations as quantized: only the float32
  epilogue's rounding), and |y - x W^T| <= s_x / 2 sum_k |W[n, k]| + that (each activation moves by at most half
  its step: a dropped or misplaced group of weights exceeds it).
fp8 weights (fused kernel, dequantized-tile path): within 2e-6 |x| |W|^T of the float64 product with the dequantized
weight, per-tensor (expanded), per-channel and block scales; the widening equals torch's fp8 cast on every finite
value. Shapes have row tails (1, 3, 5 rows of the 4-row tile), column tails (N not a multiple of 8 or 16) and,
for int8, K not a multiple of 4.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from pagellm.cpu_features import cpu_has_native
from pagellm.ops import cpu_build
from pagellm.ops import gguf_kernels as gk
from pagellm.ops import w8a8_kernels as wk
from pagellm.ops.linear_bf16 import LinearBF16
from tests.helpers import built_or_skip

ISAS = cpu_build.runnable_isas()
ROWS = (1, 3, 5, 8, 33, 70)
# (K, N): K and N tails; K a multiple of 64 (what AMX's tiles take, in one or three tile steps) with an odd
# number of 16-column strips.
SHAPES = [(67, 21), (128, 40), (130, 9), (192, 48)]


def _kernels(isa: str) -> wk.W8A8Kernels:
    kernels = built_or_skip(wk.w8a8_kernels(isa), f"the 8-bit kernels' {isa} build")
    assert kernels.isa == isa
    return kernels


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight quantized per channel from Gaussian weights, one row all zero and one reaching -128."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, scale = wk.quantize_rows_int8(w)
    q[0] = 0
    scale[0] = 0.0
    q[-1, 0] = -128  # a checkpoint may hold -128 (compressed-tensors clamps to [-128, 127])
    return q, scale


def _x(m: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, :5] = torch.tensor([0.5, -2.5, 1.5, 127.5, -0.0])  # values that round to even at some scale
    if m > 2:
        x[2] = 0.0  # an all-zero row: scale 0, outputs 0
    return x.to(dtype)


def _on_path(kernels: wk.W8A8Kernels, path: str) -> wk.W8A8Kernels:
    """The int8 product made to take `path` at every row count: "vector" or "amx" (the tiles, where the build and
    the OS have them; K not a multiple of 64 stays on the vector path)."""
    if path == "amx" and not kernels.amx:
        pytest.skip("no AMX int8 tiles in this build, or the OS does not grant them")
    kernels.amx_min_rows = 1 if path == "amx" else cpu_build.NEVER_ROWS
    return kernels


@pytest.mark.parametrize("path", ["vector", "amx"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [None, 0.04])
def test_int8_equals_the_reference_and_float64(path, isa, dtype, static):
    kernels = _on_path(_kernels(isa), path)
    for index, (k, n) in enumerate(SHAPES):
        q, scale = _weight(n, k, index)
        packed = wk.pack_int8(q, scale)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(9)).to(dtype)
        w64 = q.double() * scale.double()[:, None]
        for m in ROWS:
            x = _x(m, k, m + index, dtype)
            for b in (bias, None):
                y = kernels.int8_linear(x, packed, b, static)
                assert y.dtype == dtype and y.shape == (m, n)
                assert torch.equal(y, wk.int8_linear_reference(x, q, scale, static, b)), (k, n, m)
            if dtype != torch.float32:
                continue
            y = kernels.int8_linear(x, packed, None, static).double()
            xq, xs = wk.quantize_rows_int8(x, static)
            x_hat = xq.double() * xs.double()[:, None]
            assert ((y - x_hat @ w64.T).abs() <= 1e-6 * (x_hat.abs() @ w64.abs().T) + 1e-30).all()
            if static is None:  # static scales clamp outliers: the bound below is for unclamped activations
                bound = xs.double()[:, None] / 2 * w64.abs().sum(1)[None, :] + 1e-6 * (x.double().abs() @ w64.abs().T)
                assert ((y - x.double() @ w64.T).abs() <= bound + 1e-30).all()


# (K, rotation): blocks of 64 (SmolLM2's 576 and 1,536 inputs), of 16 (the vector stages only), below 16 (the
# scalar stages), larger than 64, and one block over all of K.
ROTATIONS = [(576, 64), (192, 16), (100, 4), (24, 8), (256, 128), (64, 64)]


@pytest.mark.parametrize("path", ["vector", "amx"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_int8_equals_the_reference(path, isa, dtype):
    """quantization="int8"'s rotated weights: the kernels rotate each row (csrc/w8a8.c's hadamard_row) to the
    bit as hadamard_rows does, then quantize and multiply as for any int8 weight; NaN rows stay in their row."""
    kernels = _on_path(_kernels(isa), path)
    for k, rotation in ROTATIONS:
        w = torch.randn(40, k, generator=torch.Generator().manual_seed(k))
        q, scale, got = wk.quantize_int8_rotated(w, rotation)
        assert got == rotation
        packed = wk.pack_int8(q, scale, rotation)
        for m in (1, 5, 33):
            x = _x(m, k, m + k, dtype)
            if m > 3:
                x[3, k - 1] = float("nan")
            y = kernels.int8_linear(x, packed, None)
            expected = wk.int8_linear_reference(x, q, scale, None, None, rotation)
            assert torch.equal(y.isnan(), expected.isnan()), (k, m)
            assert torch.equal(y.nan_to_num(), expected.nan_to_num()), (k, rotation, m)
            xq, xs = kernels.quantize_rows(x, None, rotation)
            q_ref, s_ref = wk.quantize_rows_int8(x, None, rotation)
            assert torch.equal(xq, q_ref) and torch.equal(xs.nan_to_num(), s_ref.nan_to_num())


@pytest.mark.parametrize("rotation", [3, 48, 256])
def test_a_rotation_the_kernels_cannot_take_is_refused(rotation):
    kernels = _kernels(ISAS[0])
    q, scale = _weight(16, 96, 1)
    with pytest.raises(ValueError, match=f"rotation={rotation}"):
        kernels.int8_linear(_x(2, 96, 1), wk.pack_int8(q, scale, rotation), None)
    with pytest.raises(ValueError, match="power of two dividing"):
        wk.hadamard_rows(_x(2, 96, 1), rotation)


def test_hadamard_rows_is_the_block_hadamard_matrix():
    """hadamard_rows(x, b) = x H for H block-diagonal of Sylvester's H_b (entries +-1, H H^T = b I), so that a
    weight rotated the same way and divided by b leaves the product unchanged."""
    for block in (1, 2, 8, 64):
        h = wk.hadamard_rows(torch.eye(128, dtype=torch.float64), block)
        assert set(h.unique().tolist()) <= {-1.0, 0.0, 1.0}
        assert torch.equal(h, h.T) and torch.equal(h @ h.T, block * torch.eye(128, dtype=torch.float64))
        assert (h[:block, block:] == 0).all() and (h[:block, :block].abs() == 1).all()
        x = torch.randn(3, 128, dtype=torch.float64)
        assert torch.allclose(wk.hadamard_rows(x, block), x @ h)
    assert [wk.rotation_block(k) for k in (576, 1536, 100, 7, 4096)] == [64, 64, 4, 1, 64]
    assert wk.rotation_block(4096, 512) == 512


def test_rotation_spreads_an_outlier_channel():
    """The reason for the rotation: with one input channel 100 times the others, per-row int8 flattens every other
    channel to a few steps; rotated, the product's error falls by more than 5x."""
    generator = torch.Generator().manual_seed(5)
    w = torch.randn(64, 576, generator=generator) * 0.05
    x = torch.randn(16, 576, generator=generator)
    x[:, 100] *= 100
    exact = x.double() @ w.double().T

    def relative_error(y: torch.Tensor) -> float:
        return float((y.double() - exact).norm() / exact.norm())

    plain = wk.int8_linear_reference(x, *wk.quantize_rows_int8(w), None, None)
    q, scale, rotation = wk.quantize_int8_rotated(w)
    rotated = wk.int8_linear_reference(x, q, scale, None, None, rotation)
    assert rotation == 64 and relative_error(rotated) * 5 < relative_error(plain)


def test_fitted_weight_scales_are_never_further_than_the_largest_magnitude_s():
    """quantize_rows_int8_fitted picks per channel the clipping nearest the weights in squared error, the unclipped
    scale among its choices: no channel ends up further than quantize_rows_int8 puts it; a channel with one
    weight just above the rest is clipped; zero and non-finite channels as quantize_rows_int8 gives them."""
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(32, 1024, generator=generator)
    w[1] = 0.9  # 0.9 falls 0.3 of a step from max|w| / 127's grid, 0.17 from 0.97 max|w| / 127's: clipping 1.0 pays
    w[1, 3] = 1.0
    w[2] = 0.0
    w[3, 7] = float("nan")
    q, scale = wk.quantize_rows_int8_fitted(w)
    q_max, scale_max = wk.quantize_rows_int8(w)
    fitted = ((q.float() * scale[:, None] - w) ** 2).sum(1)
    plain = ((q_max.float() * scale_max[:, None] - w) ** 2).sum(1)
    finite = [r for r in range(32) if r not in (2, 3)]
    assert (fitted[finite] <= plain[finite] * (1 + 1e-6)).all()
    assert scale[1] < scale_max[1] and fitted[1] < plain[1]
    assert scale[2] == 0 and (q[2] == 0).all()
    assert scale[3].isnan() and (q[3] == 0).all()
    assert q.abs().max() <= 127


@pytest.mark.parametrize("isa", ISAS)
def test_the_c_search_of_fitted_scales_chooses_as_torch_does(isa):
    """w8a8_fit_int8_scales (the load's search) and fitted_scales (torch) sum their errors in different orders; on
    Gaussian rows, rows with a tail past K's multiple of 8, clipped, zero and non-finite rows they choose alike."""
    kernels = _kernels(isa)
    generator = torch.Generator().manual_seed(4)
    for k in (576, 67):
        w = torch.randn(200, k, generator=generator) * torch.rand(200, 1, generator=generator)
        w[1] = 0.9
        w[1, 3] = 1.0
        w[2] = 0.0
        w[3, 7] = float("inf")
        w[4, 60] = 30.0
        ours, theirs = kernels.fit_int8_scales(w), wk.fitted_scales(w)
        assert torch.equal(ours.nan_to_num(-1.0), theirs.nan_to_num(-1.0)), k
        assert ours[2] == 0 and ours[3].isnan()
        assert (ours[1] < w[1].abs().max() / 127) == (k == 576)  # clipping the 1.0 pays over 575 values, not 66


@pytest.mark.parametrize("rows, n", [(300, 1037), (530, 80)])
def test_int8_tiles_over_several_chunks_of_rows_equal_the_reference(rows, n):
    """More than one chunk of 256 rows on AMX's tiles: blocks of rows times groups of column blocks (unequal group
    sizes, an odd last strip, masked columns past N, a partial last chunk and a tail of rows), each block's rows
    stored during the next block's steps; the outputs are the reference's to the bit."""
    kernels = _on_path(_kernels(ISAS[0]), "amx")
    q, scale = _weight(n, 576, rows)
    packed = wk.pack_int8(q, scale)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    x = _x(rows, 576, rows, torch.bfloat16)
    y = kernels.int8_linear(x, packed, bias, None)
    assert torch.equal(y, wk.int8_linear_reference(x, q, scale, None, bias))


@pytest.mark.parametrize("isa", ISAS)
def test_quantize_rows_equals_the_reference(isa):
    kernels = _kernels(isa)
    x = _x(6, 37, 1)
    x[1, 4] = float("nan")
    x[3, 36] = float("inf")  # in the scalar tail
    x[4, 0] = -float("inf")
    for static in (None, 0.01, 2.0):
        for dtype in (torch.float32, torch.bfloat16):
            q, s = kernels.quantize_rows(x.to(dtype), static)
            q_ref, s_ref = wk.quantize_rows_int8(x.to(dtype), static)
            assert torch.equal(q, q_ref) and torch.equal(s.isnan(), s_ref.isnan())
            assert torch.equal(s[~s.isnan()], s_ref[~s_ref.isnan()])
            assert s[[1, 3, 4]].isnan().all() and (q[[1, 3, 4]] == 0).all()
            assert q.abs().max() <= 127


@pytest.mark.parametrize("isa", ISAS)
def test_non_finite_activations_reach_their_row_only(isa):
    kernels = _kernels(isa)
    q, scale = _weight(24, 64, 3)
    x = _x(5, 64, 4)
    x[1, 7] = float("nan")
    x[3, 0] = float("inf")
    y = kernels.int8_linear(x, wk.pack_int8(q, scale), None)
    assert y[[1, 3]].isnan().all()
    assert torch.isfinite(y[[0, 2, 4]]).all()
    assert torch.equal(y[[0, 2, 4]], kernels.int8_linear(x[[0, 2, 4]], wk.pack_int8(q, scale), None))


def _fp8_case(n: int, k: int, block_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=generator) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(n, -(-k // block_k), generator=generator) * 0.02 + 1e-3
    return w, scales


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_paths_match_float64(isa, dtype):
    kernels = _kernels(isa)
    for index, (k, n) in enumerate(SHAPES):
        for block_k in (k, 32):  # per channel (per tensor expanded), and K blocks with a tail block
            w, scales = _fp8_case(n, k, block_k, index)
            packed = wk.pack_fp8(w, scales, block_k)
            w64 = wk.dequantize_fp8(w, scales, block_k).double()
            bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(dtype)
            for m in ROWS:
                x = _x(m, k, m, dtype)
                x64 = x.double()
                reference = x64 @ w64.T + bias.double()
                scale = x64.abs() @ w64.abs().T
                tolerance = 2e-6 * scale + (0 if dtype == torch.float32 else 2 ** -8 * reference.abs())
                # The dense path multiplies bfloat16 natively where the CPU can: its tiles round each weight by up
                # to 2^-9, and the product rounds to bfloat16 before the bias is added.
                dense_rounding = 2 ** -8 * scale if dtype == torch.bfloat16 and cpu_has_native(dtype) else 0
                for path, bound in ((kernels.fp8_linear_fused, tolerance),
                                    (kernels.fp8_linear_dense, tolerance + dense_rounding)):
                    y = path(x, packed, bias)
                    assert y.dtype == dtype and y.shape == (m, n)
                    assert ((y.double() - reference).abs() <= bound + 1e-30).all(), (path.__name__, k, n, m)


@pytest.mark.parametrize("block_k", [32, 96, 7])  # in blocks, per channel, blocks that split input pairs
def test_fp8_dense_bf16_rows_run_linear_bf16_on_its_packed_layout(block_k, monkeypatch):
    kernels = _kernels(ISAS[0])
    if kernels._linear_bf16 is None:
        pytest.skip("linear_bf16 needs avx512_bf16's dot product, which this CPU or build lacks")
    k, n = 96, 72  # four whole 16-column blocks and a last 8 columns, which torch's GEMM takes
    w, scales = _fp8_case(n, k, block_k, 11)
    packed = wk.pack_fp8(w, scales, block_k)
    expected = LinearBF16.pack(kernels.fp8_dequantize(packed, torch.bfloat16)[:64])
    blocks = torch.empty(4, k // 2, 16, 2, dtype=torch.bfloat16)
    assert kernels._dequantize_packed(packed.packed.data_ptr(), k, packed.padded_out_features,
                                      packed.scales.data_ptr(), block_k, 0, 4, blocks.data_ptr()) == 0
    assert torch.equal(blocks, expected)
    x = _x(40, k, 12, torch.bfloat16)
    whole = kernels.fp8_linear_dense(x, packed, None)
    dense = kernels.fp8_dequantize(packed, torch.bfloat16)
    assert torch.equal(whole[:, :64], kernels._linear_bf16(x, expected, None))
    # The last 8 columns on torch's GEMM, whose blocking may order the sums otherwise: bfloat16 rounding apart.
    torch.testing.assert_close(whole[:, 64:], x @ dense[64:].T, rtol=2**-7, atol=2**-7)
    monkeypatch.setattr(wk, "DENSE_TILE_BYTES", k * 2 * 16)  # one block per tile
    assert torch.equal(kernels.fp8_linear_dense(x, packed, None), whole)


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_widening_is_exact_for_every_finite_value(isa):
    kernels = _kernels(isa)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the NaN codes, which check_fp8_finite refuses at load
    w = codes[: len(codes) // 6 * 6].reshape(-1, 6).view(torch.float8_e4m3fn)  # 6 columns: a panel tail
    scales = torch.ones(w.shape[0], 1)
    assert torch.equal(kernels.fp8_dequantize(wk.pack_fp8(w, scales, 6)), w.float())
    with pytest.raises(ValueError, match="NaN"):
        wk.check_fp8_finite(torch.tensor([0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn), "layer.weight")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", [64, 67])
def test_fp8_products_of_bfloat16_rows_widen_every_finite_value_exactly(isa, k):
    """Identity rows through the fused path give back each weight: bfloat16 rows of two panels run on
    avx512_bf16's pair dot products where the build has them (fp8_block_pairs, which widens fp8 to bfloat16),
    the float path elsewhere; an odd K leaves a last input to the float path, and the third panel has no pair."""
    kernels = _kernels(isa)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(7)[: 24 * k]  # every finite code, 24 columns (3 panels)
    w = codes.reshape(k, 24).t().contiguous().view(torch.float8_e4m3fn)
    scales = torch.ones(24, 1)
    y = kernels.fp8_linear_fused(torch.eye(k, dtype=torch.bfloat16), wk.pack_fp8(w, scales, k), None)
    assert torch.equal(y.t().float(), w.float())


# A mixture-of-experts step's experts: (expert, its rows) in the order the grouped call takes them, rows of 1 to
# 5 (two row tiles), an expert without rows, K and N with tails.
EXPERT_ROWS = [(3, 2), (0, 1), (4, 0), (1, 5), (2, 3)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "int8-static", "int8-rotated", "fp8-channel", "fp8-blocks"])
def test_experts_in_one_call_equal_each_experts_own_call(isa, dtype, fmt):
    """w8a8_int8_linear_experts / w8a8_fp8_linear_experts: every expert's rows times its own weight, bit for bit
    what each expert's own product gives (its own static input scale or rotation included)."""
    kernels = _kernels(isa)
    k, n = 67, 40
    if fmt == "int8-rotated":
        k = 96  # rotated by blocks of 32
        weights = [torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) for seed in range(5)]
        linears = [wk.NativeInt8Linear(*wk.quantize_int8_rotated(w)[:2], None, kernels, wk.rotation_block(k))
                   for w in weights]
        together = wk.ExpertsInt8Product(linears)
    elif fmt.startswith("int8"):
        linears = [wk.NativeInt8Linear(*_weight(n, k, seed), 0.03 + 0.01 * seed if fmt == "int8-static" else None,
                                       kernels) for seed in range(5)]
        together = wk.ExpertsInt8Product(linears)
    else:
        block_k = k if fmt == "fp8-channel" else 32
        linears = [wk.NativeFp8Linear(*_fp8_case(n, k, block_k, seed), block_k, kernels) for seed in range(5)]
        together = wk.ExpertsFp8Product(linears)
    experts, sizes = [e for e, _ in EXPERT_ROWS], [rows for _, rows in EXPERT_ROWS]
    assert together.takes(sizes, dtype)
    x = _x(sum(sizes), k, 11, dtype)
    out = torch.full((sum(sizes), n), float("nan"), dtype=dtype)
    together(experts, sizes, x, out)
    expected = torch.cat([linears[e](rows, None) for e, rows in zip(experts, x.split(sizes))])
    assert torch.equal(out, expected)


def test_threads_give_identical_results():
    kernels = _kernels(ISAS[0])
    q, scale = _weight(200, 576, 7)
    w, scales = _fp8_case(200, 576, 576, 8)
    x = _x(40, 576, 9)
    threads = torch.get_num_threads()
    results = {}
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results[count] = [kernels.int8_linear(x, wk.pack_int8(q, scale), None),
                              kernels.fp8_linear_fused(x, wk.pack_fp8(w, scales, 576), None)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[2]))


def test_float16_activations_go_through_float32():
    kernels = _kernels(ISAS[0])
    q, scale = _weight(16, 32, 1)
    x = _x(3, 32, 2)
    y = kernels.int8_linear(x.half(), wk.pack_int8(q, scale), None)
    assert y.dtype == torch.float16
    assert torch.equal(y, kernels.int8_linear(x.half().float(), wk.pack_int8(q, scale), None).half())


def test_fp8_rows_take_the_dense_path_from_their_dtypes_threshold(monkeypatch):
    kernels = _kernels(ISAS[0])
    expected = wk.FP8_BF16_DENSE_MIN_ROWS if kernels._linear_bf16 is not None else kernels.fp8_dense_min_rows
    assert kernels.fp8_bf16_dense_min_rows == expected
    w, scales = _fp8_case(16, 32, 32, 2)
    packed = wk.pack_fp8(w, scales, 32)
    taken = []
    monkeypatch.setattr(kernels, "fp8_linear_dense", lambda x, weight, bias: taken.append("dense"))
    monkeypatch.setattr(kernels, "fp8_linear_fused", lambda x, weight, bias: taken.append("fused"))
    monkeypatch.setattr(kernels, "fp8_dense_min_rows", 100)
    monkeypatch.setattr(kernels, "fp8_bf16_dense_min_rows", 4)
    for rows, dtype in ((5, torch.bfloat16), (3, torch.bfloat16), (5, torch.float32)):
        kernels.fp8_linear(_x(rows, 32, 3, dtype), packed, None)
    assert taken == ["dense", "fused", "fused"]


def test_torch_fallback_and_kernel_choice(monkeypatch):
    q, scale = _weight(16, 32, 1)
    w, scales = _fp8_case(16, 32, 32, 2)
    assert wk.choose_int8_linear(q, scale, None).name.startswith("native")
    assert wk.choose_fp8_linear(w, scales, 32).name == "native"
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    assert wk.w8a8_kernels() is None
    int8, fp8 = wk.choose_int8_linear(q, scale, 0.05), wk.choose_fp8_linear(w, scales, 32)
    assert type(int8) is wk.Int8Linear and type(fp8) is wk.Fp8Linear
    x = _x(3, 32, 4)
    assert torch.equal(int8(x, None), wk.int8_linear_reference(x, q, scale, 0.05, None))
    assert torch.equal(fp8(x, None), wk.fp8_linear_reference(x, w, scales, 32, None))


def test_bad_arguments_are_refused():
    kernels = _kernels(ISAS[0])
    q, scale = _weight(16, 32, 1)
    packed = wk.pack_int8(q, scale)
    with pytest.raises(ValueError, match="x has 31 features"):
        kernels.int8_linear(torch.randn(2, 31), packed, None)
    with pytest.raises(ValueError, match="bias has shape"):
        kernels.int8_linear(torch.randn(2, 32), packed, torch.randn(15))
    with pytest.raises(ValueError, match="static input scale"):
        kernels.int8_linear(torch.randn(2, 32), packed, None, -1.0)
    with pytest.raises(ValueError, match="1 .. 65536 input features"):
        wk.pack_int8(torch.zeros(8, 70000, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        wk.pack_fp8(q, torch.ones(16, 1), 32)


def test_isa_override_selects_the_library(monkeypatch):
    monkeypatch.setenv("PAGELLM_CPU_ISA", ISAS[-1])
    kernels = wk.w8a8_kernels()
    assert kernels.isa == ISAS[-1]
    if ISAS[-1] == "generic":
        assert kernels.dot_instructions == "generic"


def test_every_isa_compiles(tmp_path):
    """Compile-only: the VNNI builds (AVX-512 VNNI, AVX-VNNI), which this CPU may not run, and the others,
    without warnings."""
    try:
        compiler = cpu_build.find_compiler()
    except FileNotFoundError:
        pytest.skip("no C compiler")
    if "avx2" not in cpu_build.cpu_flags() and "sse2" not in cpu_build.cpu_flags():
        pytest.skip("x86 targets need an x86 compiler")
    builds = {
        "avx2_vnni": gk.build_flags("avx2", frozenset({"avx_vnni"})),
        "avx512_vnni": gk.build_flags("avx512", frozenset({"avx512_vnni"})),
        "avx512_amx": gk.build_flags("avx512", frozenset({"avx512_vnni", "amx_tile", "amx_int8"})),
        "avx512": gk.build_flags("avx512", frozenset()),
    }
    jobs = []
    for name, flags in builds.items():
        flags = ["-O0" if flag == "-O3" else flag for flag in flags]
        for source in wk._SOURCES:
            command = [compiler, *flags, "-Wall", "-Werror", "-c", str(source), "-o", str(tmp_path / f"{name}.o")]
            jobs.append((name, subprocess.Popen(command, stderr=subprocess.PIPE, text=True)))
    for name, job in jobs:
        _, errors = job.communicate(timeout=120)
        assert job.returncode == 0, f"{name}: {errors}"
