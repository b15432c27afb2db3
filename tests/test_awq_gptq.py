"""AWQ, GPTQ and compressed-tensors W4A16/W8A16 checkpoints: the test packers against AutoAWQ's, AutoGPTQ's and
compressed-tensors' own code, the CPU kernels against a
float64 reference of the dequantized weights (every instruction set this CPU runs, 1..130 rows), the layers'
loading of fused shards and tensor-parallel slices, the configs, and the engine's greedy output against pagellm
and transformers on the dequantized float weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagellm import LLM, SamplingParams
from pagellm.cpu_features import cpu_has_amx_bf16
from pagellm.distributed.parallel_state import TensorParallelGroup, building_with
from pagellm.ops import cpu_build
from pagellm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagellm.layers.quantization import quantization_config_for
from pagellm.layers.quantization.awq import AWQConfig, AWQLinearMethod, pack_awq, unpack_awq
from pagellm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from pagellm.layers.quantization.compressed_tensors_wna16 import CompressedTensorsWNA16Method
from pagellm.layers.quantization.gptq import GPTQConfig, GPTQLinearMethod
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.ops import wna16
from pagellm.ops.linear_bf16 import LinearBF16
from tests.helpers import PROMPTS, built_or_skip, decoder_linear_bytes, hf_greedy
from tests.quant_checkpoints import (
    QuantSpec,
    awq_tensors,
    compressed_tensors_tensors,
    gptq_tensors,
    pack_gptq_qweight,
    pack_gptq_qzeros,
    quantize_awq,
    quantize_compressed_tensors,
    quantize_gptq,
    random_group_quant_weight,
    write_quantized,
)

REFERENCE = Path(__file__).parent / "data" / "awq_gptq_reference.safetensors"
REFERENCE_CASES = {
    "awq_g32": QuantSpec("awq", group_size=32),
    "gptq4_sym_desc_act_g16": QuantSpec("gptq", bits=4, group_size=16, sym=True, desc_act=True),
    "gptq4_asym_desc_act_g16": QuantSpec("gptq", bits=4, group_size=16, sym=False, desc_act=True),
    "gptq8_asym_g32": QuantSpec("gptq", bits=8, group_size=32, sym=False),
}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(REFERENCE))


# ---- the formats, against AutoAWQ's and AutoGPTQ's own code ---------------------------------------------------


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_test_packers_write_the_bytes_autoawq_and_autogptq_write(reference, case):
    spec = REFERENCE_CASES[case]
    weight = reference[f"{case}.weight"]
    if spec.method == "awq":
        q, scales, zeros = quantize_awq(weight, spec.group_size)
        qweight, qzeros = pack_awq(q.t().contiguous()), pack_awq(zeros)
    else:
        q, scales, zeros, g_idx = quantize_gptq(weight, spec, _act_order(reference[f"{case}.g_idx"], spec))
        assert torch.equal(g_idx, reference[f"{case}.g_idx"])
        qweight, qzeros = pack_gptq_qweight(q.t().contiguous(), spec.bits), pack_gptq_qzeros(zeros, spec.bits, 1)
    assert torch.equal(qweight, reference[f"{case}.qweight"])
    assert torch.equal(qzeros, reference[f"{case}.qzeros"])
    assert torch.equal(scales, reference[f"{case}.scales"])


def _act_order(g_idx: torch.Tensor, spec: QuantSpec) -> torch.Tensor | None:
    """An input order that gives `g_idx` (the reference's own permutation is not stored; any order with the same
    groups quantizes alike, since a group's scale depends only on its members)."""
    return torch.sort(g_idx.long(), stable=True).indices if spec.desc_act else None


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_pagellm_reads_their_tensors_as_their_dequantization_does(reference, case):
    spec = REFERENCE_CASES[case]
    out_features, in_features = reference[f"{case}.weight"].shape
    config = _config(spec)
    layer = ReplicatedLinear(in_features, out_features, False, config, "model.layers.0.mlp.down_proj")
    names = ("qweight", "qzeros", "scales") + (("g_idx",) if spec.method == "gptq" else ())
    tensors = {name: reference[f"{case}.{name}"] for name in names}
    _load(layer, tensors)
    (first, part), = layer.quant_method.parts(layer)
    assert first == 0
    assert torch.equal(wna16.dequantize(part), reference[f"{case}.dequantized"].t())


def test_awq_nibble_order_is_autoawqs():
    values = torch.arange(16, dtype=torch.int32).remainder(16).view(2, 8)
    packed = pack_awq(values)
    # Column 1 sits in nibble 4 and column 2 in nibble 1 (AWQ_ORDER = 0 2 4 6 1 3 5 7).
    assert (int(packed[0, 0]) >> 16) & 0xF == 1 and (int(packed[0, 0]) >> 4) & 0xF == 2
    assert torch.equal(unpack_awq(packed), values)


# ---- the CPU kernels ----------------------------------------------------------------------------------------


def _assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """y against x W^T (+ bias) in float64, the error relative to the sum of the products' magnitudes."""
    expected = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    magnitude = x.double().abs() @ w.double().abs().t() + 1e-30
    error = ((y.double() - expected).abs() / magnitude).max().item()
    assert torch.isfinite(y).all() and error < 2e-6, f"relative error {error:.2e}"


def _kernels(isa: str) -> wna16.WNA16Kernels:
    kernels = built_or_skip(wna16.wna16_kernels(isa), f"the AWQ/GPTQ kernels' {isa} build")
    assert kernels.isa == isa
    return kernels


ISAS = cpu_build.runnable_isas()


@pytest.fixture
def one_thread():
    """The row sweeps run on one thread: on a machine whose cores other processes hold, every parallel region
    waits for its second thread to be scheduled (tens of ms here), and results do not depend on the thread count
    (test_results_do_not_depend_on_the_thread_count)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("variant", ["plain", "act_order", "uneven", "per_channel"])
def test_packed_path_every_row_count(isa, bits, variant, one_thread):
    kernels = _kernels(isa)
    weight = random_group_quant_weight(bits, 96, 72, variant, seed=bits)  # 72 outputs: a tail block of 8 columns
    layout = wna16.cpu_layout(weight)
    assert (layout.src is None) == (variant in ("plain", "per_channel"))
    w = wna16.dequantize(weight)
    x = torch.randn(130, 96, generator=torch.Generator().manual_seed(1))
    for rows in range(1, 131):
        _assert_close(kernels.matmul_packed(x[:rows], layout), x[:rows], w)


@pytest.mark.parametrize("bits", [4, 8])
def test_results_do_not_depend_on_the_thread_count(bits):
    kernels = _kernels(ISAS[0])
    layout = wna16.cpu_layout(random_group_quant_weight(bits, 256, 256, "act_order", seed=6))
    x = torch.randn(13, 256)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.matmul_packed(x, layout)
        torch.set_num_threads(2)
        assert torch.equal(kernels.matmul_packed(x, layout), alone)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_dense_path_bias_bf16_and_column_slices(isa, bits, one_thread):
    kernels = _kernels(isa)
    weight = random_group_quant_weight(bits, 128, 40, "act_order", seed=3)
    layout = wna16.cpu_layout(weight)
    w = wna16.dequantize(weight)
    bias = torch.randn(40)
    for rows in (1, 7, 33, 130):
        x = torch.randn(rows, 128)
        _assert_close(kernels.matmul_dense(x, layout, bias=bias), x, w, bias)
        _assert_close(kernels.matmul(x, layout, bias=bias), x, w, bias)
        x16 = x.bfloat16()
        _assert_close(kernels.matmul_packed(x16, layout, bias=bias), x16.float(), w, bias)
        wide = torch.full((rows, 100), float("nan"))
        kernels.matmul_packed(x, layout, out=wide[:, 30:70], bias=bias)
        _assert_close(wide[:, 30:70], x, w, bias)
        assert torch.isnan(wide[:, :30]).all() and torch.isnan(wide[:, 70:]).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("variant", ["plain", "act_order", "uneven"])
def test_bfloat16_rows_run_linear_bf16_on_the_weight_rounded_once(bits, variant, monkeypatch):
    kernels = _kernels(ISAS[0])
    if kernels._linear_bf16 is None:
        pytest.skip("linear_bf16 needs avx512_bf16's dot product, which this CPU or build lacks")
    weight = random_group_quant_weight(bits, 96, 80, variant, seed=bits)  # 80 outputs: a last block of 16 columns
    layout = wna16.cpu_layout(weight)
    expected = LinearBF16.pack(kernels.dequantize(layout).to(torch.bfloat16))
    packed = torch.empty(5, 48, 16, 2, dtype=torch.bfloat16)
    assert kernels._dequantize_packed(*layout.kernel_args, 96, 0, 80, packed.data_ptr()) == 0
    assert torch.equal(packed, expected)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    bias = torch.randn(80, generator=torch.Generator().manual_seed(3))
    y = kernels.matmul_bf16_tiles(x, layout, bias=bias)
    assert torch.equal(y, kernels._linear_bf16(x, expected, None).float() + bias)
    monkeypatch.setattr(wna16, "DENSE_TILE_BYTES", 96 * 2 * 32)  # one block of 32 columns per tile
    assert torch.equal(kernels.matmul_bf16_tiles(x, layout, bias=bias), y)
    taken = []
    monkeypatch.setattr(kernels, "matmul_bf16_tiles", lambda x, layout, out=None, bias=None: taken.append(len(x)))
    monkeypatch.setattr(kernels, "bf16_tile_min_rows", {bits: 20})
    kernels.matmul(x, layout)
    kernels.matmul(x[:19], layout)
    kernels.matmul(x.float(), layout)
    assert taken == [20]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("variant", ["plain", "act_order", "uneven"])
def test_the_bf16_layout_is_the_weight_rounded_once_on_every_isa(isa, bits, variant):
    """wna16_dequantize_bf16_packed, on every build (in registers where it has avx512_bf16, through a float32
    block elsewhere and for act order without it), from a block-aligned first column."""
    kernels = _kernels(isa)
    weight = random_group_quant_weight(bits, 96, 80, variant, seed=bits + 7)
    layout = wna16.cpu_layout(weight)
    expected = LinearBF16.pack(kernels.dequantize(layout).to(torch.bfloat16))
    for first, count in ((0, 80), (32, 48), (64, 16)):
        packed = torch.full((count // 16, 48, 16, 2), float("nan"), dtype=torch.bfloat16)
        assert kernels._dequantize_packed(*layout.kernel_args, 96, first, count, packed.data_ptr()) == 0
        assert torch.equal(packed, expected[first // 16 : (first + count) // 16]), (first, count)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("variant", ["plain", "act_order"])
def test_bfloat16_products_write_bfloat16_as_the_float32_result_rounds(bits, variant, monkeypatch):
    """`product` on bfloat16 rows (the packed path, the tiles, the dense path past them) gives matmul's float32
    result rounded to bfloat16, bias included, also into a column slice of a wider tensor; a layer of two parts
    (GPTQ shards in different orders) fills its two column ranges."""
    kernels = _kernels(ISAS[0])
    weight = random_group_quant_weight(bits, 96, 80, variant, seed=bits + 3)
    layout = wna16.cpu_layout(weight)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(4))
    for rows in (1, 7, 8, 12, 20, 40):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        for b in (None, bias):
            y = kernels.product(x, layout, bias=b)
            assert y.dtype == torch.bfloat16 and torch.equal(y, kernels.matmul(x, layout, bias=b).bfloat16()), rows
        wide = torch.full((rows, 120), float("nan"), dtype=torch.bfloat16)
        kernels.product(x, layout, out=wide[:, 20:100], bias=bias)
        assert torch.equal(wide[:, 20:100], y)
        assert torch.isnan(wide[:, :20]).all() and torch.isnan(wide[:, 100:]).all()
    taken = []
    monkeypatch.setattr(kernels, "_tiles_into", lambda x, layout, y: taken.append(len(x)))
    monkeypatch.setattr(kernels, "bf16_tile_min_rows", {bits: 20})
    for rows in (19, 20):
        kernels.product(torch.zeros(rows, 96, dtype=torch.bfloat16), layout)
    assert taken == ([20] if kernels._linear_bf16 is not None else [])
    monkeypatch.undo()
    other = random_group_quant_weight(bits, 96, 48, "act_order", seed=9)
    two_parts = wna16.CpuGroupQuant([(0, weight), (80, other)], kernels)
    for rows in (3, 30):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        expected = torch.cat([kernels.matmul(x, wna16.cpu_layout(w)) for w in (weight, other)], dim=1).bfloat16()
        assert torch.equal(two_parts(x, None), expected)


@pytest.mark.parametrize("bits", [4, 8])
def test_experts_own_products_compute_what_their_one_call_does(bits):
    """A mixture-of-experts projection: up to EXPERTS_BF16_TILE_MIN_ROWS rows an expert, the one call takes the
    step, and each expert's own product (for the steps it does not take) stays on the packed path too, so that the
    two agree bit for bit whatever this CPU's tiles' threshold for a lone weight."""
    kernels = _kernels(ISAS[0])
    layouts = [wna16.cpu_layout(random_group_quant_weight(bits, 96, 80, "act_order", seed=seed)) for seed in (1, 2)]
    together = wna16.ExpertsPackedProduct(kernels, layouts)
    rows = wna16.EXPERTS_BF16_TILE_MIN_ROWS - 1
    assert together.takes([rows, 1], torch.bfloat16)
    x = torch.randn(rows + 1, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = torch.empty(rows + 1, 80, dtype=torch.bfloat16)
    together([1, 0], [rows, 1], x, out)
    products = together.expert_products()
    assert torch.equal(out[:rows], products[1](x[:rows])) and torch.equal(out[rows:], products[0](x[rows:]))


def test_the_tiles_product_over_several_tiles_writes_a_column_slice(monkeypatch):
    """wna16_tiles_product with tiles of 32 columns (80 columns: 32 + 32 + 16) into a column slice of a wider
    bfloat16 tensor: each tile's columns at their place, rows a wide row apart, nothing outside the slice."""
    kernels = _kernels(ISAS[0])
    if kernels._linear_bf16 is None:
        pytest.skip("no linear_bf16 here (avx512_bf16)")
    monkeypatch.setattr(wna16, "DENSE_TILE_BYTES", 2 * 96 * 32)
    layout = wna16.cpu_layout(random_group_quant_weight(4, 96, 80, "act_order", seed=5))
    assert wna16._tile_columns(96) == 32
    x = torch.randn(24, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    wide = torch.full((24, 120), float("nan"), dtype=torch.bfloat16)
    kernels._tiles_into(x, layout, wide[:, 20:100])
    assert torch.equal(wide[:, 20:100], kernels.matmul(x, layout).bfloat16())
    assert torch.isnan(wide[:, :20]).all() and torch.isnan(wide[:, 100:]).all()


def test_bfloat16_rows_take_the_tiles_from_this_cpus_threshold():
    """AMX's tiles from BF16_TILE_MIN_ROWS, avx512_bf16's vector products from BF16_VECTOR_TILE_MIN_ROWS (each
    measured on a CPU of its kind); without linear_bf16, bfloat16 rows switch where float32 rows do."""
    kernels = _kernels(ISAS[0])
    if kernels._linear_bf16 is None:
        expected = kernels.dense_min_rows
    else:
        expected = wna16.BF16_TILE_MIN_ROWS if cpu_has_amx_bf16() else wna16.BF16_VECTOR_TILE_MIN_ROWS
    assert kernels.bf16_tile_min_rows == expected
    layout = wna16.cpu_layout(random_group_quant_weight(4, 96, 80, "plain", seed=1))
    assert kernels.packed_below(layout, torch.bfloat16) == min(expected[4], kernels.dense_min_rows[4])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_prepared_product_equals_the_kernels_call(isa, bits):
    """The decode steps' product (the kernel called straight, bfloat16 rows' output written as bfloat16) gives the
    layer's call bit for bit, on the packed path and past it (dense or bfloat16 tiles)."""
    weight = random_group_quant_weight(bits, 96, 80, "act_order", seed=bits)
    kernel = wna16.CpuGroupQuant([(0, weight)], _kernels(isa))
    product = kernel.prepared_product()
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 3, 8, 19, 40, 600):
            x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
            y = product(x)
            assert y.dtype == dtype and torch.equal(y, kernel(x, None)), (dtype, rows)
    x = torch.randn(2, 3, 96)
    assert torch.equal(product(x), kernel(x, None))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("variant", ["plain", "act_order", "uneven"])
def test_layout_holds_the_weight_exactly(bits, variant):
    weight = random_group_quant_weight(bits, 64, 40, variant, seed=5)
    layout = wna16.cpu_layout(weight)
    expected = wna16.dequantize(weight)
    assert torch.equal(wna16.dequantize_cpu_layout(layout), expected)
    for isa in ISAS:
        assert torch.equal(_kernels(isa).dequantize(layout), expected)


def test_unused_groups_are_dropped():
    weight = random_group_quant_weight(4, 64, 8, "plain", seed=2)
    halved = wna16.GroupQuantWeight(4, weight.qweight, torch.cat([weight.scales] * 2),
                                    torch.cat([weight.offsets] * 2), weight.g_idx + 2)
    compact = wna16.compact_groups(halved)
    assert compact.num_groups == 2
    assert torch.equal(wna16.dequantize(compact), wna16.dequantize(weight))


def test_torch_path_where_the_kernels_are_switched_off(monkeypatch):
    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    weight = random_group_quant_weight(4, 64, 16, "act_order", seed=4)
    kernel = wna16.choose_kernel([(0, weight)], torch.device("cpu"))
    assert isinstance(kernel, wna16.TorchGroupQuant)
    x = torch.randn(3, 64)
    _assert_close(kernel(x, None), x, wna16.dequantize(weight))


# ---- layers: fused shards, tensor-parallel slices -------------------------------------------------------------


def _config(spec: QuantSpec):
    if spec.method == "compressed-tensors":
        return CompressedTensorsConfig.from_config(spec.quantization_config())
    return AWQConfig(spec.quantization_config()) if spec.method == "awq" else GPTQConfig(spec.quantization_config())


def _checkpoint(spec: QuantSpec, weight: torch.Tensor, perm: torch.Tensor | None = None):
    if spec.method == "awq":
        return awq_tensors(weight, spec)
    if spec.method == "compressed-tensors":
        return compressed_tensors_tensors(weight, spec, perm)
    return gptq_tensors(weight, spec, perm)


def _load(layer, tensors: dict[str, torch.Tensor], shard=None) -> None:
    params = dict(layer.named_parameters())
    for name, tensor in tensors.items():
        params[name].weight_loader(params[name], tensor, shard)


SPECS = {
    "awq": QuantSpec("awq", group_size=16),
    "gptq4_desc_act": QuantSpec("gptq", bits=4, group_size=16, desc_act=True),
    "gptq8_asym": QuantSpec("gptq", bits=8, group_size=16, sym=False),
    "gptq4_v2_per_channel": QuantSpec("gptq", bits=4, group_size=-1, sym=False, checkpoint_format="gptq_v2"),
    "ct_w4a16": QuantSpec("compressed-tensors", bits=4, group_size=16),
    "ct_w4a16_asym_act_order": QuantSpec("compressed-tensors", bits=4, group_size=16, sym=False, desc_act=True),
    "ct_w8a16_asym_per_channel": QuantSpec("compressed-tensors", bits=8, group_size=-1, sym=False),
}


def _shard_weights(sizes: dict, in_features: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {shard: torch.randn(size, in_features, generator=generator) * 0.3 for shard, size in sizes.items()}


@pytest.mark.parametrize("name", SPECS)
def test_fused_qkv_and_gate_up_shards_load_where_they_go(name):
    spec = SPECS[name]
    generator = torch.Generator().manual_seed(0)
    perm = torch.randperm(64, generator=generator) if spec.desc_act else None
    qkv = QKVParallelLinear(64, 16, 4, 2, False, _config(spec), "model.layers.0.self_attn.qkv_proj")
    gate_up = MergedColumnParallelLinear(64, [48, 48], False, _config(spec), "model.layers.0.mlp.gate_up_proj")
    for layer, sizes in ((qkv, {"q": 64, "k": 32, "v": 32}), (gate_up, {0: 48, 1: 48})):
        dense = []
        for shard, weight in _shard_weights(sizes, 64, seed=len(sizes)).items():
            tensors, dequantized = _checkpoint(spec, weight, perm)
            _load(layer, tensors, shard)
            dense.append(dequantized)
        layer.process_weights_after_loading()
        packed = getattr(layer, layer.quant_method.checkpoint_params[0])
        assert packed.numel() == 0, "the checkpoint's layout is freed once the kernel's is built"
        x = torch.randn(5, 64)
        _assert_close(layer(x), x, torch.cat(dense))


def test_gptq_shards_quantized_in_different_orders_run_as_parts():
    spec = SPECS["gptq4_desc_act"]
    generator = torch.Generator().manual_seed(1)
    layer = MergedColumnParallelLinear(64, [32, 32], False, _config(spec), "model.layers.0.mlp.gate_up_proj")
    dense = []
    for shard, weight in _shard_weights({0: 32, 1: 32}, 64, seed=3).items():
        tensors, dequantized = _checkpoint(spec, weight, torch.randperm(64, generator=generator))
        _load(layer, tensors, shard)
        dense.append(dequantized)
    layer.process_weights_after_loading()
    assert len(layer.group_quant_kernel.tensors()) > 4, "two parts, each with its own layout"
    for rows in (1, 40):
        x = torch.randn(rows, 64)
        _assert_close(layer(x), x, torch.cat(dense))


def _rank_layers(build, size: int):
    layers = []
    for rank in range(size):
        with building_with(TensorParallelGroup(rank, size)):
            layers.append(build())
    return layers


@pytest.mark.parametrize("name", SPECS)
def test_tensor_parallel_slices_add_up_to_the_whole_layer(name):
    """Each rank of a 2-way split loads the whole checkpoint tensors and keeps its slice: column-parallel outputs
    concatenate, row-parallel partial products sum (the all-reduce) to the unsplit product."""
    spec = SPECS[name]
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(2)) if spec.desc_act else None
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.3
    tensors, dense = _checkpoint(spec, weight, perm)
    x = torch.randn(6, 128)
    columns = _rank_layers(lambda: ColumnParallelLinear(128, 64, False, _config(spec), "model.layers.0.x_proj"), 2)
    rows = _rank_layers(lambda: RowParallelLinear(128, 64, False, _config(spec), "model.layers.0.mlp.down_proj"), 2)
    for layer in columns + rows:
        _load(layer, tensors)
        layer.process_weights_after_loading()
    _assert_close(torch.cat([layer.matmul(x) for layer in columns], dim=1), x, dense)
    partial = [layer.matmul(x[:, rank * 64 : (rank + 1) * 64]) for rank, layer in enumerate(rows)]
    _assert_close(partial[0] + partial[1], x, dense)


def test_a_rank_whose_inputs_are_not_whole_groups_is_refused():
    with building_with(TensorParallelGroup(0, 4)):
        with pytest.raises(ValueError, match="not whole groups of 64.*tensor_parallel_size"):
            RowParallelLinear(128, 64, False, _config(QuantSpec("awq", group_size=64)), "model.layers.0.o_proj")


def test_g_idx_outside_the_groups_is_refused():
    spec = SPECS["gptq4_desc_act"]
    layer = ReplicatedLinear(64, 32, False, _config(spec), "model.layers.0.mlp.down_proj")
    tensors, _ = _checkpoint(spec, torch.randn(32, 64), torch.randperm(64))
    _load(layer, {**tensors, "g_idx": tensors["g_idx"] + 10})
    with pytest.raises(ValueError, match="g_idx holds groups outside"):
        layer.process_weights_after_loading()


# ---- configs ------------------------------------------------------------------------------------------------


def test_layers_the_checkpoint_leaves_unquantized_stay_dense():
    awq = AWQConfig({**QuantSpec("awq").quantization_config(), "modules_to_not_convert": ["mlp.down_proj"]})
    assert isinstance(awq.linear_method("model.layers.3.mlp.down_proj"), UnquantizedLinearMethod)
    assert isinstance(awq.linear_method("model.layers.3.mlp.gate_up_proj"), AWQLinearMethod)
    for prefix in ("model.embed_tokens", "lm_head"):
        assert isinstance(awq.linear_method(prefix), UnquantizedLinearMethod)
    with pytest.raises(ValueError, match="fuses .*q_proj.*k_proj.*v_proj"):
        AWQConfig({**QuantSpec("awq").quantization_config(), "modules_to_not_convert": ["k_proj"]}).linear_method(
            "model.layers.0.self_attn.qkv_proj")

    base = QuantSpec("gptq").quantization_config()
    listed = GPTQConfig({**base, "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj",
                                                                     "self_attn.v_proj"], ["mlp.down_proj"]]})
    assert isinstance(listed.linear_method("model.layers.0.self_attn.qkv_proj"), GPTQLinearMethod)
    assert isinstance(listed.linear_method("model.layers.0.self_attn.o_proj"), UnquantizedLinearMethod)
    assert isinstance(GPTQConfig({**base, "lm_head": True}).linear_method("lm_head"), GPTQLinearMethod)
    assert isinstance(GPTQConfig(base).linear_method("lm_head"), UnquantizedLinearMethod)


def test_gptqmodel_dynamic_rules_skip_or_override_modules():
    config = GPTQConfig({**QuantSpec("gptq").quantization_config(),
                         "dynamic": {r"-:.*\.1\.mlp\..*": {}, r"+:.*\.2\..*": {"bits": 8, "group_size": 64}}})
    assert isinstance(config.linear_method("model.layers.1.mlp.down_proj"), UnquantizedLinearMethod)
    overridden = config.linear_method("model.layers.2.self_attn.qkv_proj")
    assert (overridden.bits, overridden.group_size) == (8, 64)
    assert config.linear_method("model.layers.0.mlp.down_proj").bits == 4
    with pytest.raises(ValueError, match="bits=3"):
        GPTQConfig({**QuantSpec("gptq").quantization_config(), "dynamic": {r"+:.*": {"bits": 3}}})


@pytest.mark.parametrize("method, overrides, words", [
    ("awq", {"version": "gemv"}, ["version='gemv'", "gemm"]),
    ("awq", {"zero_point": False}, ["zero_point=false"]),
    ("awq", {"bits": 8}, ["bits=8", "4-bit"]),
    ("gptq", {"bits": 3}, ["bits=3", "4 and 8"]),
    ("gptq", {"checkpoint_format": "marlin"}, ["checkpoint_format='marlin'", "gptq_v2"]),
    ("gptq", {"group_size": 0}, ["group_size=0", "-1"]),
])
def test_formats_pagellm_does_not_run_are_refused_naming_the_setting(method, overrides, words):
    config = {**QuantSpec(method).quantization_config(), **overrides}
    with pytest.raises(ValueError) as refusal:
        quantization_config_for({"quantization_config": config})
    assert all(word in str(refusal.value) for word in words), str(refusal.value)


def test_describe_names_the_format_and_its_settings():
    assert quantization_config_for({"quantization_config": QuantSpec("awq", group_size=128).quantization_config()}
                                   ).describe() == "awq (4-bit weights with zero points, group size 128, GEMM layout)"
    gptq = quantization_config_for({"quantization_config": QuantSpec("gptq", bits=8, desc_act=True, sym=False,
                                                                     checkpoint_format="gptq_v2").quantization_config()})
    assert gptq.describe() == ("gptq (8-bit weights, group size 32, desc_act, asymmetric, "
                               "checkpoint_format gptq_v2)")


def test_asking_for_awq_on_a_float_checkpoint_says_it_needs_an_awq_checkpoint():
    with pytest.raises(ValueError, match="needs an AWQ checkpoint"):
        quantization_config_for({}, "awq")


def test_vllms_kernel_names_take_checkpoints_of_their_method():
    """quantization="awq_marlin", "gptq_marlin", "moe_wna16" ... (vLLM's kernel choices, which its users pass):
    the checkpoint's method on pagellm's kernels; anything else refused naming what the name is for."""
    from pagellm.config import EngineArgs

    awq = {"quantization_config": QuantSpec("awq", group_size=128).quantization_config()}
    gptq = {"quantization_config": QuantSpec("gptq", bits=4).quantization_config()}
    for name, checkpoint, config in (("awq_marlin", awq, AWQConfig), ("auto_awq", awq, AWQConfig),
                                     ("moe_wna16", awq, AWQConfig), ("gptq_marlin", gptq, GPTQConfig),
                                     ("auto_gptq", gptq, GPTQConfig), ("moe_wna16", gptq, GPTQConfig)):
        assert EngineArgs(quantization=name).quantization == name
        assert isinstance(quantization_config_for(checkpoint, name), config), name
    with pytest.raises(ValueError, match="'gptq_marlin' is vLLM's name for kernels of gptq checkpoints; this "
                                         "checkpoint is quantized with 'awq'"):
        quantization_config_for(awq, "gptq_marlin")
    with pytest.raises(ValueError, match="'awq_marlin' .* this checkpoint is not quantized"):
        quantization_config_for({}, "awq_marlin")


# ---- the engine -------------------------------------------------------------------------------------------

ENGINE_SPECS = {
    "awq_g32": QuantSpec("awq", group_size=32),
    "ct_w4a16_asym_g32": QuantSpec("compressed-tensors", bits=4, group_size=32, sym=False),
    "gptq4_desc_act_sym_g32": QuantSpec("gptq", bits=4, group_size=32, desc_act=True),
    "gptq8_asym_g64": QuantSpec("gptq", bits=8, group_size=64, sym=False),
}
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def quantized_dirs(module_tmp_path_factory, tiny_llama_dir) -> dict[str, tuple[str, str]]:
    dirs = {}
    for name, spec in ENGINE_SPECS.items():
        root = module_tmp_path_factory.mktemp(name)
        write_quantized(tiny_llama_dir, root / "quantized", root / "dequantized", spec)
        dirs[name] = (str(root / "quantized"), str(root / "dequantized"))
    return dirs


def _greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("name", ENGINE_SPECS)
def test_greedy_output_equals_the_dequantized_model_in_pagellm_and_transformers(name, quantized_dirs,
                                                                                 default_tokenizer):
    from transformers import AutoModelForCausalLM

    quantized_dir, dequantized_dir = quantized_dirs[name]
    quantized = LLM(quantized_dir, **ENGINE)
    ours = _greedy(quantized)
    # Decode steps skip the layers' module calls (the group-quantized products are prepared at load).
    assert quantized.llm_engine.core.runner.model.model.direct_layers() is not None
    dense = LLM(dequantized_dir, **ENGINE)
    assert ours == _greedy(dense)
    # transformers on four of the prompts (it is slow here; pagellm's float path matches it on all of them in
    # test_correctness.py).
    hf = AutoModelForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32).eval()
    for prompt, tokens in list(zip(PROMPTS, ours))[:4]:
        assert tokens == hf_greedy(hf, default_tokenizer, default_tokenizer.encode(prompt), MAX_TOKENS, True), prompt
    # 4 (or 8) bits per weight and a scale and offset per group of 32 (64), against 32 bits per float weight.
    bits, group_size = ENGINE_SPECS[name].bits, ENGINE_SPECS[name].group_size
    expected_ratio = (bits + 64 / group_size) / 32
    assert decoder_linear_bytes(quantized) <= 1.1 * expected_ratio * decoder_linear_bytes(dense)


# ---- compressed-tensors W4A16 / W8A16 ---------------------------------------------------------------------------

CT_PACKAGE_SPECS = {
    "w4a16_g16": QuantSpec("compressed-tensors", bits=4, group_size=16),
    "w4a16_asym_g16": QuantSpec("compressed-tensors", bits=4, group_size=16, sym=False),
    "w8a16_per_channel": QuantSpec("compressed-tensors", bits=8, group_size=-1),
    "w8a16_asym_g32": QuantSpec("compressed-tensors", bits=8, group_size=32, sym=False),
}


def _package_scheme(spec: QuantSpec):
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate(spec.quantization_config()).config_groups["group_0"]


def _package_decompress(spec: QuantSpec, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own dequantization of our tensors, with the scales widened to float32 (the package
    multiplies in the scales' dtype, which would round the float16 products)."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    state = {**tensors, "weight_scale": tensors["weight_scale"].float()}
    return compressor.decompress(state, _package_scheme(spec))["weight"]


@pytest.mark.parametrize("name", CT_PACKAGE_SPECS)
def test_compressed_tensors_packer_writes_the_bytes_the_package_writes(name):
    """The package (compressed-tensors, a test dependency) compresses the float weight, given our scales and zero
    points, into our bytes, and decompresses them to our dequantized weight."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor

    spec = CT_PACKAGE_SPECS[name]
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(7)) * 0.2
    tensors, dequantized = compressed_tensors_tensors(weight, spec, None)
    q, scales, zeros, _ = quantize_compressed_tensors(weight, spec, None)
    state = {"weight": weight, "weight_scale": scales}
    if not spec.sym:
        state["weight_zero_point"] = zeros.to(torch.int8)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    theirs = compressor.compress(state, _package_scheme(spec))
    assert set(theirs) == set(tensors)
    for key in ("weight_packed", "weight_zero_point", "weight_shape"):
        if key in tensors:
            assert torch.equal(theirs[key], tensors[key]), key
    assert torch.equal(_package_decompress(spec, tensors), dequantized)


@pytest.mark.parametrize("name", CT_PACKAGE_SPECS)
def test_pagellm_reads_compressed_tensors_as_the_package_dequantizes(name):
    pytest.importorskip("compressed_tensors")
    spec = CT_PACKAGE_SPECS[name]
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(8)) * 0.2
    tensors, _ = compressed_tensors_tensors(weight, spec, None)
    layer = ReplicatedLinear(96, 48, False, _config(spec), "model.layers.0.mlp.down_proj")
    assert isinstance(layer.quant_method, CompressedTensorsWNA16Method)
    _load(layer, tensors)
    (first, part), = layer.quant_method.parts(layer)
    assert first == 0 and part.bits == spec.bits
    assert torch.equal(wna16.dequantize(part), _package_decompress(spec, tensors))


def test_act_order_groups_follow_weight_g_idx():
    """"group" act order (older llm-compressor; weight_g_idx): the inputs of a group are scattered, and each
    input's scale is its group's."""
    spec = SPECS["ct_w4a16_asym_act_order"]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(4))
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)) * 0.3
    tensors, dense = _checkpoint(spec, weight, perm)
    assert not torch.equal(tensors["weight_g_idx"], torch.arange(64, dtype=torch.int32) // 16)
    layer = ReplicatedLinear(64, 32, False, _config(spec), "model.layers.0.mlp.down_proj")
    _load(layer, tensors)
    layer.process_weights_after_loading()
    x = torch.randn(3, 64)
    _assert_close(layer(x), x, dense)


def test_a_weight_shape_that_does_not_match_the_layer_is_refused():
    spec = SPECS["ct_w4a16"]
    layer = ReplicatedLinear(64, 32, False, _config(spec), "model.layers.0.mlp.down_proj")
    tensors, _ = _checkpoint(spec, torch.randn(32, 64))
    _load(layer, {**tensors, "weight_shape": torch.tensor([32, 60])})
    shapes = r"weight_shape \[\[32, 60\]\] does not match the layer's shards \[\[32, 64\]\]"
    with pytest.raises(ValueError, match=shapes):
        layer.process_weights_after_loading()


def _ct_config(**weights) -> dict:
    config = QuantSpec("compressed-tensors", bits=4, group_size=128).quantization_config()
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize("change, words", [
    (dict(num_bits=3), "3-bit int weights in the pack-quantized format"),
    (dict(type="float"), "4-bit float weights in the pack-quantized format"),
    (dict(strategy="tensor", group_size=None), "strategy 'tensor'"),
    (dict(group_size=None), "group_size=None"),
    (dict(actorder="sideways"), "actorder='sideways'"),
])
def test_pack_quantized_schemes_pagellm_does_not_run_are_refused_naming_them(change, words):
    with pytest.raises(ValueError) as refusal:
        CompressedTensorsConfig.from_config(_ct_config(**change))
    assert words in str(refusal.value) and "W4A16 and W8A16" in str(refusal.value), str(refusal.value)


def test_packed_weights_with_quantized_activations_are_refused():
    w4a8 = _ct_config()
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token",
                                                             "dynamic": True}
    with pytest.raises(ValueError, match=r"\(W4A8\)"):
        CompressedTensorsConfig.from_config(w4a8)


def test_compressed_tensors_describe_names_the_packed_scheme():
    config = CompressedTensorsConfig.from_config(_ct_config(symmetric=False, actorder="weight"))
    assert config.describe() == ("compressed-tensors (int4 group 128 weights (with zero points, act order weight), "
                                 "float activations for Linear; dense: lm_head)")
    method = config.linear_method("model.layers.0.self_attn.qkv_proj")
    assert isinstance(method, CompressedTensorsWNA16Method) and not method.group_act_order
    assert isinstance(config.linear_method("lm_head"), UnquantizedLinearMethod)


@pytest.mark.parametrize("spec", [QuantSpec("compressed-tensors", bits=4, group_size=32),
                                  QuantSpec("compressed-tensors", bits=8, group_size=-1)], ids=["w4a16_g32", "w8a16"])
def test_transformers_reads_the_test_checkpoint_as_its_dequantized_weights(spec, tmp_path, tiny_llama_dir):
    """The whole test checkpoint (config.json and tensors) read by a third party: transformers, through the
    compressed-tensors package, computes the dequantized model's logits. (Asymmetric checkpoints are left out:
    transformers 5.25 sizes weight_zero_point unpacked, [out, groups], while compressed-tensors 0.20 writes and vLLM
    reads it packed, [out / pack, groups], as the test packer does and the byte test above checks.)"""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    write_quantized(tiny_llama_dir, tmp_path / "quantized", tmp_path / "dequantized", spec)
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32)(ids).logits
                  for name in ("quantized", "dequantized")]
    assert torch.equal(logits[0], logits[1])
