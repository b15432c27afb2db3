"""pagellm.models.gguf_quants against the `gguf` package's reference dequantisers, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagellm.models import gguf_quants
from pagellm.models.gguf_quants import QUANT_FORMATS, dequantize, quant_format, tensor_nbytes


def reference(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType(type_id)
    with np.errstate(all="ignore"):  # random bytes make some f16 scales inf/NaN, in both implementations
        return gguf.quants.dequantize(raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype)), qtype)


def random_tensor_bytes(shape: tuple[int, ...], type_id: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, tensor_nbytes(shape, type_id), dtype=np.uint8)


def dequantize_quietly(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    with np.errstate(all="ignore"):  # inf * 0 scales in random blocks
        return dequantize(raw, type_id, shape)


def assert_bit_identical(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    assert actual.flags.c_contiguous and actual.flags.writeable
    # Same bits, NaNs included: compare the raw words, not the values.
    assert np.array_equal(actual.view(np.uint32), np.asarray(expected, dtype=np.float32).view(np.uint32))


@pytest.mark.parametrize("type_id", sorted(QUANT_FORMATS), ids=lambda t: QUANT_FORMATS[t].name)
def test_random_blocks_equal_gguf(type_id):
    fmt = QUANT_FORMATS[type_id]
    assert (fmt.block_size, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    shape = (24, 4 * max(fmt.block_size, 64))
    raw = random_tensor_bytes(shape, type_id, seed=type_id)
    actual = dequantize_quietly(raw, type_id, shape)
    assert np.isfinite(actual).mean() > 0.8, "random scales should mostly be finite, else the test proves little"
    assert_bit_identical(actual, reference(raw, type_id, shape))


@pytest.mark.parametrize("type_id", sorted(QUANT_FORMATS), ids=lambda t: QUANT_FORMATS[t].name)
def test_whole_tensor_across_chunk_boundaries(type_id, monkeypatch):
    """A 3-d tensor whose blocks span several passes (the chunk is shrunk to 3 blocks' worth of weights)."""
    fmt = QUANT_FORMATS[type_id]
    monkeypatch.setattr(gguf_quants, "_CHUNK_WEIGHTS", 3 * fmt.block_size)
    shape = (3, 5, 2 * max(fmt.block_size, 32))
    raw = random_tensor_bytes(shape, type_id, seed=100 + type_id)
    assert_bit_identical(dequantize_quietly(raw, type_id, shape), reference(raw, type_id, shape))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16"])
def test_quantized_real_values_round_trip(name):
    """Weights quantised by gguf (realistic scales, not random bytes) decode as gguf decodes them."""
    qtype = gguf.GGMLQuantizationType[name]
    weights = np.random.default_rng(1).standard_normal((16, 256), dtype=np.float32)
    raw = gguf.quants.quantize(weights, qtype)
    actual = dequantize(raw, int(qtype), weights.shape)
    assert_bit_identical(actual, gguf.quants.dequantize(raw, qtype))
    assert np.abs(actual - weights).max() < 0.5


def test_unsupported_type_is_refused_with_its_name_and_the_supported_list():
    with pytest.raises(ValueError, match=r"Q8_1 \(id 9\) \(tensor 'blk\.0\.attn_q\.weight'\) is not supported.*Q4_K.*Q6_K"):
        quant_format(9, "blk.0.attn_q.weight")


def test_row_not_a_whole_number_of_blocks_is_refused():
    with pytest.raises(ValueError, match=r"row length 100 is not a multiple of the Q4_K block size 256"):
        tensor_nbytes((4, 100), 12, "w")


@pytest.mark.parametrize("name", sorted(gguf_quants.TRANSCODED_TYPES))
def test_kernel_less_types_become_blocks_of_their_values(name):
    """transcode_blocks against gguf's own values of the blocks: IQ3_XXS and IQ3_S as Q6_K blocks and MXFP4 as
    MXFP4_F16 blocks bit for bit, IQ4_XS as IQ4_NL blocks to within the f16 rounding of each sub-block's scale, the
    rest as Q8_0 blocks to within half a Q8_0 step (plus its f16 scale's rounding)."""
    qtype = gguf.GGMLQuantizationType[name]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    if name in ("TQ1_0", "TQ2_0", "MXFP4"):
        raw = gguf.quants.quantize(rng.standard_normal((8, 4 * block_size), dtype=np.float32), qtype)
    else:
        raw = rng.integers(0, 256, (32, block_bytes), dtype=np.uint8)
        d = int(np.float16(0.01).view(np.uint16))
        if name == "IQ1_M":  # its f16 scale is the top nibbles of its four uint16 scale words (bytes 48-55)
            words = raw[:, 48:56].copy().view(np.uint16)
            words[:] = (words & 0x0FFF) | (((d >> (4 * np.arange(4))) & 0xF) << 12).astype(np.uint16)
            raw[:, 48:56] = words.view(np.uint8)
        else:
            raw[:, :2] = np.full((32, 1), d, dtype=np.uint16).view(np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    values = reference(blocks, int(qtype), (len(blocks), block_size)).reshape(-1, 32)
    kept_id, kept = gguf_quants.FORMATS_BY_NAME[gguf_quants.kernel_type(name)]
    converted = gguf_quants.transcode_blocks(blocks, int(qtype))
    assert converted.shape == (values.size // kept.block_size, kept.block_bytes)
    ours = dequantize(converted, kept_id, (len(converted), kept.block_size)).reshape(-1, 32)
    finite = np.isfinite(values).all(axis=1)
    assert finite.mean() > 0.5
    values, ours = values[finite], ours[finite]
    if name in ("IQ3_XXS", "IQ3_S", "MXFP4"):  # the same floats as Q6_K / MXFP4_F16 blocks
        assert kept.name == ("MXFP4_F16" if name == "MXFP4" else "Q6_K")
        assert_bit_identical(np.ascontiguousarray(ours), np.ascontiguousarray(values))
        return
    if name == "IQ4_XS":
        assert kept.name == "IQ4_NL"
        assert np.all(np.abs(ours - values) <= np.abs(values) * 2.0 ** -11)
        assert not np.array_equal(ours, values)  # some scale was not an f16 already
        return
    assert kept.name == "Q8_0"
    amax = np.abs(values).max(axis=1, keepdims=True)
    assert np.all(np.abs(ours - values) <= amax / 127 * 0.51 + amax * 2.0 ** -10)


def test_mxfp4_scales_an_f16_cannot_hold():
    """Below f16's subnormals a block's scale rounds to zero or 2^-24 (its weights are at most 12 * 2^-25 in
    magnitude, and stay within that of gguf's values); beyond 2^16 it is refused, naming the tensor."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (16, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(88, 104)
    values = reference(blocks, 39, (16, 32))
    converted = gguf_quants.transcode_blocks(blocks, 39)
    assert np.abs(values).max() <= 12 * 2.0 ** -25
    assert np.abs(dequantize(converted, 1002, (16, 32)) - values).max() <= 12 * 2.0 ** -25
    blocks[3, 0] = 144
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up_exps.weight': an MXFP4 block scale of 2\^17"):
        gguf_quants.transcode_blocks(blocks, 39, "blk.0.ffn_up_exps.weight")


E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def test_nvfp4_weights_become_nvfp4_f16_blocks():
    """An NVFP4 weight (e2m1 codes two to a byte, the even weight in the low nibble; a scale per 16 weights; a
    global scale) as NVFP4_F16 blocks: bit for bit where each 16 weights' scale times the global one, halved, is
    an f16; within one f16 rounding of it (2^-11 relative) otherwise."""
    rng = np.random.default_rng(3)
    rows, cols = 5, 96
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(rows, cols)
    exact = 2.0 ** rng.integers(-8, 8, (rows, cols // 16)) * rng.integers(8, 16, (rows, cols // 16)) / 8
    for scales, global_scale, bound in ((exact, 0.5, 0.0), (rng.uniform(0.01, 448, (rows, cols // 16)), 1e-3, 2**-11)):
        blocks = gguf_quants.nvfp4_f16_blocks(packed, scales, global_scale)
        assert blocks.shape == (rows, cols // 32 * 20)
        expected = E2M1_VALUES[codes] * np.repeat(scales, 16, axis=1) * global_scale
        got = dequantize(blocks, 1003, (rows, cols)).astype(np.float64)
        scale_of_each = np.repeat(scales, 16, axis=1) * global_scale
        assert (np.abs(got - expected) <= bound * 6 * scale_of_each).all()


def test_nvfp4_scales_an_f16_cannot_hold_and_odd_widths_are_refused():
    packed = np.zeros((2, 16), dtype=np.uint8)
    scales = np.ones((2, 2))
    scales[1, 1] = 448.0
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.up_proj.weight': an NVFP4 block scale"):
        gguf_quants.nvfp4_f16_blocks(packed, scales, 448.0, "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"multiple of 32"):
        gguf_quants.nvfp4_f16_blocks(np.zeros((2, 8), dtype=np.uint8), np.ones((2, 1)), 1.0, "w")
