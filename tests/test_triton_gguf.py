"""The Triton GGUF kernels (pagellm/ops/triton_gguf.py) on CPU tensors under TRITON_INTERPRET=1, every block type,
against float64 products of the weights as gguf dequantizes them (pagellm.models.gguf_quants, equal to the gguf
package's); tests/gpu/test_triton_gguf_gpu.py runs them on a CUDA device (bfloat16 too: the interpreter mishandles
it).

Shapes with tails everywhere: 10 output features (not a multiple of the 4, 8 or 64 of a program), 5 blocks of 32
or 3 blocks of 256 per row (fewer than, or not a multiple of, the blocks a step takes), 1 and 3 rows of x (the
decode products; 3 rows pad to 4) and 17 (the tl.dot tiles; 17 pad to 32); float16 activations through the dot
tiles for every type (where the weight tile is rounded to float16), through the decode products for one.

- matmul, float32 x: |y - y64| <= 1e-5 * sum_k |w_k x_k| (float32 sums of exact products);
- matmul, float16 x: within 2^-10 * sum_k |w_k x_k|: the dot tiles round the weights to float16 (2^-11 each), and
  y is rounded to float16;
- dequantize_rows: bit for bit gguf's float32, and that rounded once to float16.
An error in a decoder misplaces or mis-scales whole groups of weights, far above these bounds.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter tests are for machines without CUDA; tests/gpu run the kernels on the GPU",
                allow_module_level=True)
# Read when triton.jit decorates a kernel, so it must be set before the kernels are imported.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed: `pip install triton` runs these tests on CPU")

from pagellm.ops import gguf_kernels as gk  # noqa: E402
from pagellm.ops import triton_gguf as tg  # noqa: E402
from tests.test_gguf_kernels import dequantized, random_weight  # noqa: E402

OUT_FEATURES = 10
IN_FEATURES = {name: 768 if name.endswith("_K") else 160 for name in gk.KERNEL_TYPES}
ROW_IDS = [OUT_FEATURES - 1, 0, OUT_FEATURES - 1]


@pytest.fixture(scope="module")
def ops():
    return tg.TritonGGUFKernels()


def _case(type_name: str):
    in_features = IN_FEATURES[type_name]
    weight = random_weight(type_name, OUT_FEATURES, in_features, seed=7)
    return weight, in_features, dequantized(weight, type_name, in_features).astype(np.float64)


def _x(rows: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)


def _assert_product(y: torch.Tensor, x: torch.Tensor, dense: np.ndarray, tolerance: float) -> None:
    x64 = x.double().numpy()
    reference = x64 @ dense.T
    bound = tolerance * (np.abs(x64) @ np.abs(dense).T) + 1e-30
    error = np.abs(y.double().numpy() - reference)
    assert np.isfinite(y.double().numpy()).all()
    assert (error <= bound).all(), f"worst error {(error / bound).max():.2f} x the bound"


@pytest.mark.parametrize("type_name", gk.KERNEL_TYPES)
def test_every_type_matches_float64(ops, type_name):
    weight, in_features, dense = _case(type_name)
    rows = ops.dequantize_rows(weight, type_name, torch.tensor(ROW_IDS), in_features)
    expected = dense[ROW_IDS].astype(np.float32)
    assert rows.dtype == torch.float32 and np.array_equal(rows.numpy().view(np.int32), expected.view(np.int32))
    rows16 = ops.dequantize_rows(weight, type_name, np.array(ROW_IDS[:1]), in_features, torch.float16)
    assert np.array_equal(rows16.numpy(), expected[:1].astype(np.float16))

    for count in (1, 3, 17):
        x = _x(count, in_features, torch.float32)
        _assert_product(ops.matmul(x, weight, type_name, OUT_FEATURES, in_features), x, dense, 1e-5)
    x = _x(17, in_features, torch.float16)
    y = ops.matmul(x, weight, type_name, OUT_FEATURES, in_features)
    assert y.dtype == torch.float16
    _assert_product(y, x, dense, 2.0 ** -10)


def test_tile_choice():
    """Up to 4 rows of x the broadcast products, from 5 the dot tiles (tl.dot needs 16 rows)."""
    q4k = tg.GEOMETRY["Q4_K"]
    block_m = [tg.matmul_tiles(rows, q4k).block_m for rows in (1, 2, 3, 4, 5, 17, 64, 65, 1000)]
    assert block_m == [1, 2, 4, 4, 16, 32, 64, 128, 128]
    assert not tg.matmul_tiles(4, q4k).use_dot and tg.matmul_tiles(5, q4k).use_dot
    for g in tg.GEOMETRY.values():
        assert tg.matmul_tiles(1, g).block_b * g.lanes == 256 and tg.matmul_tiles(1, g).late_sum
        assert tg.matmul_tiles(1000, g).block_b * g.lanes == 64


def test_out_tensor_leading_dimensions_and_explicit_tiles(ops):
    """x [2, 3, in] into a given out [2, 3, out]; several programs along the rows of x (explicit 16-row tiles);
    float16 activations through the decode products."""
    weight, in_features, dense = _case("Q4_0")
    x = _x(6, in_features, torch.float32)
    out = torch.full((2, 3, OUT_FEATURES), float("nan"))
    y = ops.matmul(x.view(2, 3, in_features), weight, "Q4_0", OUT_FEATURES, in_features, out=out)
    assert y.data_ptr() == out.data_ptr() and y.shape == (2, 3, OUT_FEATURES)
    _assert_product(out.view(6, OUT_FEATURES), x, dense, 1e-5)
    x = _x(40, in_features, torch.float32)
    tiles = tg.TileConfig(block_m=16, block_n=16, block_b=2, use_dot=True, num_warps=4)
    _assert_product(ops.matmul(x, weight, "Q4_0", OUT_FEATURES, in_features, tiles=tiles), x, dense, 1e-5)
    x = _x(2, in_features, torch.float16)
    _assert_product(ops.matmul(x, weight, "Q4_0", OUT_FEATURES, in_features), x, dense, 2.0 ** -10)



@pytest.mark.parametrize("type_name", ["Q5_0", "Q6_K"])
def test_broadcast_tiles_summed_after_the_loop(ops, type_name):
    """The broadcast tiles that keep a [rows, outputs, weights per step] float32 sum and reduce it once at the end
    (a candidate of benchmarks/gguf_gpu_tiles.py), with a tail of output features and of blocks."""
    weight, in_features, dense = _case(type_name)
    for rows in (1, 3):
        x = _x(rows, in_features, torch.float32)
        tiles = tg.TileConfig(block_m=4 if rows == 3 else rows, block_n=32,
                              block_b=256 // tg.GEOMETRY[type_name].lanes, use_dot=False, num_warps=2, num_stages=2,
                              late_sum=True)
        _assert_product(ops.matmul(x, weight, type_name, OUT_FEATURES, in_features, tiles=tiles), x, dense, 1e-5)

def test_bad_input_is_refused_naming_it(ops, monkeypatch):
    weight, in_features, _ = _case("Q8_0")
    x = _x(1, in_features, torch.float32)
    with pytest.raises(ValueError, match="compute with .* not 'F16'"):
        ops.matmul(x, weight, "F16", OUT_FEATURES, in_features)
    with pytest.raises(ValueError, match=r"shape \(10, 170\)"):
        ops.matmul(x, weight[:, :-2].contiguous(), "Q8_0", OUT_FEATURES, in_features)
    with pytest.raises(ValueError, match="x has 128 features"):
        ops.matmul(x[:, :128], weight, "Q8_0", OUT_FEATURES, in_features)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16 activations"):
        ops.matmul(x.double(), weight, "Q8_0", OUT_FEATURES, in_features)
    with pytest.raises(IndexError, match="row id 10 is outside this weight's 10 rows"):
        ops.dequantize_rows(weight, "Q8_0", torch.tensor([0, 10]), in_features)
    with pytest.raises(TypeError, match="integers"):
        ops.dequantize_rows(weight, "Q8_0", torch.tensor([0.5]), in_features)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="take CUDA tensors .* the weight is on cpu"):
        ops.matmul(x, weight, "Q8_0", OUT_FEATURES, in_features)


def test_gguf_ops_picks_the_triton_kernels_for_cuda():
    assert isinstance(gk.gguf_ops(device="cuda"), tg.TritonGGUFKernels)
    assert isinstance(gk.gguf_ops(device=torch.device("cuda", 0)), tg.TritonGGUFKernels)
    assert not isinstance(gk.gguf_ops(device="cpu"), tg.TritonGGUFKernels)
    assert tg.TritonGGUFKernels.supports("Q6_K") and not tg.TritonGGUFKernels.supports("F16")


def test_gguf_layers_serve_through_the_triton_kernels(ops):
    """The layer library's GGUF method with the Triton kernels (as a model on CUDA gets them): a fused layer of
    two block types and the embedding's gather give what the torch path gives."""
    from pagellm.layers.linear import QKVParallelLinear
    from pagellm.layers.quantization.gguf import GGUFConfig, GGUFWeight
    from pagellm.layers.vocab_embedding import VocabEmbedding
    from pagellm.models.loader import default_dtype

    weights = {shard: GGUFWeight(random_weight(kind, rows, 256, seed), kind, rows, 256)
               for shard, kind, rows, seed in (("q", "Q4_K", 64, 1), ("k", "Q4_K", 32, 2), ("v", "Q6_K", 32, 3))}
    table = GGUFWeight(random_weight("Q8_0", 40, 256, 4), "Q8_0", 40, 256)
    x = _x(3, 256, torch.float32)
    ids = torch.tensor([[39, 0, 7]])
    results = []
    for kernels in (ops, gk.TorchGGUFOps()):
        with default_dtype(torch.float32):
            qkv = QKVParallelLinear(256, 32, num_heads=2, num_kv_heads=1, bias=False,
                                    quant_config=GGUFConfig(ops=kernels), prefix="model.layers.0.self_attn.qkv_proj")
            embedding = VocabEmbedding(40, 256, GGUFConfig(ops=kernels), "model.embed_tokens")
        for shard, weight in weights.items():
            qkv.weight.weight_loader(qkv.weight, weight, shard)
        qkv.process_weights_after_loading()
        embedding.weight.weight_loader(embedding.weight, table)
        embedding.process_weights_after_loading()
        assert qkv.quant_method.ops is kernels and [p.type_name for p in qkv.quantized_parts] == ["Q4_K", "Q6_K"]
        results.append((qkv(x), embedding(ids)))
    (triton_y, triton_rows), (torch_y, torch_rows) = results
    torch.testing.assert_close(triton_y, torch_y, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(triton_rows, torch_rows, rtol=0, atol=0)
