"""On a CUDA device: the Triton GGUF kernels (pagellm/ops/triton_gguf.py) for every block type against float64
products of the weights as pagellm.models.gguf_quants dequantizes them (bit for bit the gguf package's), in
bfloat16, float16 and float32; dequantize_rows bit for bit; ids on the device outside the rows; a CUDA graph's
replay. benchmarks/gpu_check.sh runs this file in its own section (`gguf_tests`), several processes compiling at
once. tests/test_triton_gguf.py runs the same kernels on CPU tensors under TRITON_INTERPRET=1.

Weights are random bytes with small finite float16 scales (the gguf package, which can quantize real weights,
is not on the device machine), 300 output features (a tail for every program width) and 15 blocks of 32 or 5 of
256 per row (a tail for every step). Bounds, per output, with S = sum_k |w_k x_k|: bfloat16 x 2^-8 S (the dot
tiles round the weight to bfloat16, 2^-9 each, and y is rounded to bfloat16), float16 2^-10 S, float32 1e-5 S.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.models import gguf_quants
from pagellm.ops.gguf_kernels import KERNEL_TYPES, _format, gguf_ops

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
OUT_FEATURES = 300
IN_FEATURES = {name: 1280 if name.endswith("_K") else 480 for name in KERNEL_TYPES}
# The byte offsets of each type's float16 scales (random bytes elsewhere).
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
               "NF4": (0,), "BNB_FP4": (0,), "MXFP4_F16": (0,), "NVFP4_F16": (0, 2),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
BOUND = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10, torch.float32: 1e-5}


def _case(type_name: str, seed: int = 0) -> tuple[torch.Tensor, int, np.ndarray]:
    """(the weight on the device, in_features, its float64 dequantization)."""
    type_id, fmt = _format(type_name)
    in_features = IN_FEATURES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(OUT_FEATURES, in_features // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
    for offset in HALF_FIELDS[type_name]:
        halves = (rng.standard_normal(blocks.shape[:2]) * 0.02).astype(np.float16)
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    raw = np.ascontiguousarray(blocks.reshape(OUT_FEATURES, -1))
    dense = gguf_quants.dequantize(raw, type_id, (OUT_FEATURES, in_features))
    return torch.from_numpy(raw).to(CUDA), in_features, dense.astype(np.float64)


def _x(rows: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(CUDA, dtype)


def _assert_product(y: torch.Tensor, x: torch.Tensor, dense: np.ndarray) -> None:
    x64 = x.double().cpu().numpy()
    got = y.double().cpu().numpy()
    bound = BOUND[x.dtype] * (np.abs(x64) @ np.abs(dense).T) + 1e-30
    error = np.abs(got - x64 @ dense.T)
    assert np.isfinite(got).all()
    assert (error <= bound).all(), f"{x.dtype}, {x.shape[0]} rows: worst error {(error / bound).max():.2f} x the bound"


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_every_type_matches_float64(type_name):
    ops = gguf_ops(device=CUDA)
    weight, in_features, dense = _case(type_name)
    ids = [OUT_FEATURES - 1, 0, 17, 17]
    expected = dense[ids].astype(np.float32)
    rows = ops.dequantize_rows(weight, type_name, torch.tensor(ids, device=CUDA), in_features)
    assert np.array_equal(rows.cpu().numpy().view(np.int32), expected.view(np.int32)), "float32 rows differ from gguf's"
    rows = ops.dequantize_rows(weight, type_name, ids, in_features, torch.bfloat16)
    assert torch.equal(rows.cpu(), torch.from_numpy(expected).to(torch.bfloat16))
    # Decode products (1 row, 3 rows padded to 4), then the dot tiles (5 rows padded to 16, 64).
    for dtype, count in ((torch.bfloat16, 1), (torch.float16, 3), (torch.bfloat16, 5), (torch.bfloat16, 64)):
        x = _x(count, in_features, dtype)
        y = ops.matmul(x, weight, type_name, OUT_FEATURES, in_features)
        assert y.dtype == dtype and y.device == x.device
        _assert_product(y, x, dense)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_float32_activations_stay_float32(type_name):
    """float32 dots at IEEE precision: tf32 (Triton's default on a GPU) would miss 1e-5 by far."""
    ops = gguf_ops(device=CUDA)
    weight, in_features, dense = _case(type_name, seed=1)
    for count in (3, 40):
        x = _x(count, in_features, torch.float32)
        _assert_product(ops.matmul(x, weight, type_name, OUT_FEATURES, in_features), x, dense)


def test_device_ids_outside_the_rows_give_nan_rows():
    """Ids already on the device are not checked on the host (that would wait for the device): the kernel reads
    nothing outside the weight for them and writes NaN; the other rows are exact."""
    ops = gguf_ops(device=CUDA)
    weight, in_features, dense = _case("Q4_K", seed=2)
    rows = ops.dequantize_rows(weight, "Q4_K", torch.tensor([5, -1, OUT_FEATURES, 6], device=CUDA), in_features)
    got = rows.cpu().numpy()
    assert np.isnan(got[1:3]).all()
    assert np.array_equal(got[[0, 3]], dense[[5, 6]].astype(np.float32))
    with pytest.raises(IndexError, match=f"row id {OUT_FEATURES} is outside"):
        ops.dequantize_rows(weight, "Q4_K", [0, OUT_FEATURES], in_features)


def test_decode_product_replays_in_a_cuda_graph():
    """A decode step is captured once and replayed: the product syncs nothing and allocates nothing given `out`."""
    ops = gguf_ops(device=CUDA)
    weight, in_features, dense = _case("Q6_K", seed=3)
    x = _x(4, in_features, torch.bfloat16)
    out = torch.empty(4, OUT_FEATURES, dtype=torch.bfloat16, device=CUDA)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.matmul(x, weight, "Q6_K", OUT_FEATURES, in_features, out=out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.matmul(x, weight, "Q6_K", OUT_FEATURES, in_features, out=out)
    x.copy_(_x(4, in_features, torch.bfloat16) * 2)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _assert_product(out, x, dense)
