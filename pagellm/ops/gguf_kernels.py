"""Linear layers and embedding gathers on GGUF weights kept in their quantized blocks.

A GGUF weight stays a uint8 tensor [out_features, in_features / block_weights * block_bytes] (each output row's
blocks contiguous, as the file stores them), at its file size in memory. csrc/gguf_quant.c computes with it:

- `matmul` at decode sizes quantizes each row of x to int8 (llama.cpp's Q8_1 blocks of 32 for Q4_0..Q8_0 and
  IQ4_NL, Q8_K blocks of 256 for the k-quants) and takes integer dot products on the blocks (AVX2 VPMADDUBSW,
  VNNI VPDPBUSD where the CPU has AVX-512 VNNI or AVX-VNNI, generic C elsewhere); from `dense_min_rows[type]` rows on (a
  measured table, DENSE_MIN_ROWS; bfloat16 rows have their own where the CPU multiplies bfloat16 natively), it
  dequantizes tiles of the weight into float32 (bfloat16 where the CPU multiplies it natively) and runs torch's
  GEMM on them, which outran the int8 products there; the AVX-512 VNNI build runs every type on 512-bit
  VPDPBUSD tiles from 64 rows on (`tile_min_rows`, activations in blocks of 32), which outrun both;
- `dequantize_rows` gathers rows as float32 or bfloat16: an embedding's lookup, and a tied LM head shares the
  embedding's blocks with it.

The library is built per instruction set from one source by pagellm.ops.cpu_build's machinery (flags per ISA,
cache, PAGELLM_CPU_ISA to force one, PAGELLM_NATIVE_KERNELS=0 to switch kernels off). `gguf_ops()` returns the
kernels, or `TorchGGUFOps` (dequantize with pagellm.models.gguf_quants, then F.linear) where they cannot be
built, so that a model always runs; the same class is the reference the kernels are tested against.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import pathlib
import subprocess
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.cpu_features import cpu_flags, cpu_has_amx_bf16, cpu_has_native
from pagellm.models.gguf_quants import FORMATS_BY_NAME, QuantFormat, dequantize
from pagellm.ops import cpu_build
from pagellm.ops.linear_bf16 import (AMX_K, BF16TilesStruct, LinearBF16, linear_bf16, run_tiles_product,
                                     tiles_product_function)
from pagellm.ops.scratch import thread_scratch

if TYPE_CHECKING:
    from pagellm.ops.triton_gguf import TritonGGUFKernels

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "gguf_quant.c"]
_HEADERS = [_CSRC / "gguf_simd.h", _CSRC / "isa_name.h", _CSRC / "bf16_tiles.h"]
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

# The block types the kernels compute with (GGML type ids); the others (F32, F16, BF16) are plain tensors.
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "NF4", "BNB_FP4", "MXFP4_F16", "NVFP4_F16", "Q2_K",
                "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# IQ4_NL's blocks on another grid (pagellm's own types, for bitsandbytes' 4-bit weights and MXFP4's): the same code
# paths.
GRID_TWINS = ("NF4", "BNB_FP4", "MXFP4_F16")
_FORMATS = FORMATS_BY_NAME
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)

# Rows of x from which `matmul` runs torch's GEMM on dequantized weight tiles instead of the int8 products, per
# instruction set and type (None: the int8 products at every row count). Measured on a 2-core AMD EPYC (Zen 3,
# avx2 only, no VNNI), one thread, a 2048 x 2048 layer, float32 activations, GFLOP/s int8 / dense (the machine
# shared with other jobs, so CPU time, best of 7; F.linear on float32 weights reached 70-77 from 512 rows):
#   rows   Q4_0   Q4_1   Q5_0   Q5_1   Q8_0   Q2_K   Q3_K   Q4_K   Q5_K   Q6_K
#     64  47/47  48/44  41/36  42/40  54/33  80/39  49/43  59/35  60/40  72/51
#    128  39/42  48/56  34/45  42/54  45/45  81/54  50/53  75/54  64/54  71/55
#    256  38/48      -      -      -  46/50      -  49/61  77/69  63/62  70/62
#    512  46/70  46/68  40/66  37/67  42/52  75/64  46/57  72/70  60/67  69/69
#   1024  45/72  46/71  39/70  38/69  49/66  72/66  47/67  71/70  52/65  63/71
#   2048  46/72  44/68  40/71  39/71  47/67  71/69  46/68  68/71  57/71  50/56
# The int8 products stay flat from ~16 rows on while the GEMM keeps rising, so the dense path takes over where
# they meet: early for the 32-weight types, which pay a float scale per 32 weights per row (the k-quants pay one
# per 256), never within 2048 rows for Q2_K. The AVX-512 build without VNNI is given the same table (not measured
# there; with VNNI it has its own, below; benchmarks/gguf_kernels.py prints both paths). The
# generic build's integer products are plain vector extensions, several times slower than the AVX2 ones; the GEMM
# wins there from a handful of rows.
_AVX2_DENSE_MIN_ROWS: dict[str, int | None] = {
    "Q4_0": 96, "Q4_1": 96, "Q5_0": 96, "Q5_1": 96, "Q8_0": 128, "IQ4_NL": 96,
    "Q2_K": None, "Q3_K": 128, "Q4_K": 1024, "Q5_K": 256, "Q6_K": 1024,
}
# The AVX-512 VNNI build multiplies every type on 512-bit VPDPBUSD tiles from 64 rows on (csrc/gguf_quant.c's
# vnni_tiles: each weight repacked once per call, one float scale per 32 inputs, 16 for the k-quants, for 16
# outputs; GGUFKernels.tile_min_rows, from the library).
# There they outran the dense path at every row count measured, in both dtypes, so `matmul` sends such rows to
# them (except bfloat16 rows on a CPU with AMX, whose bfloat16 GEMM runs on AMX tiles: not measured against
# them); float32 rows never take the dense path in that build (the row kernel outran it below 64 rows). Zen 4,
# 2 threads, bfloat16 x, 640 -> 8192 from memory, GFLOP/s tiles / dense tiles:
#   rows   Q5_0     Q8_0     Q4_1
#     16  274/158  245/175  170/150
#     64  480/301  456/317  389/286
#    512  585/325  519/379  548/390
# and on 2048 -> 2048 at 64 / 512 rows: Q4_K 314/275, 454/414; Q6_K 289/291, 432/336; Q3_K 302/265, 423/332.
DENSE_MIN_ROWS: dict[str, dict[str, int | None]] = {
    # the AVX-512 build with VNNI: the row kernel below 64 rows, its 512-bit tiles from there, for every type
    "avx512_vnni": dict.fromkeys(KERNEL_TYPES),
    "avx512": _AVX2_DENSE_MIN_ROWS,
    "avx2": _AVX2_DENSE_MIN_ROWS,
    "generic": {name: 8 for name in _AVX2_DENSE_MIN_ROWS},
}
# Rows from which bfloat16 activations take the dense path where the CPU has AMX's bfloat16 tiles (linear_bf16's
# tiles on W dequantized into their layout, while the int8 products keep the vector units' rate): the first row
# count at which it beat them on both layers measured, 1,536 -> 576 and 2,048 -> 2,048 from memory, on a 2-core
# Intel Xeon with AMX (cpu family 6 model 167), 2 threads, wall clock, bfloat16 x (benchmarks/gguf_kernels.py
# --types all --activations bfloat16 --rows 8 12 16 20 24 32 40 48 --min-mib 64), ms int8 / dense:
#   rows   Q4_0        Q8_0        Q2_K        Q4_K        Q6_K          (1,536 -> 576; 2,048 -> 2,048 below)
#     12  .194/.176   .186/.228   .125/.190   .134/.200   .156/.197
#     16  .253/.176   .239/.229   .162/.189   .175/.197   .198/.195
#     20  .310/.181   .289/.225   .199/.190   .213/.199   .240/.200
#     24  .368/.180   .339/.223   .237/.192   .255/.201   .283/.199
#     12  .837/.856   .798/1.135  .508/.850   .565/.919   .646/.868
#     16  1.10/.882   1.03/1.17   .671/.860   .725/.881   .828/.891
#     20  1.37/.901   1.27/1.18   .839/.860   .902/.914   1.03/.923
#     24  1.63/.900   1.50/1.20   1.01/.875   1.08/.924   1.22/.921
# (Q4_1, Q5_0 and Q5_1 as Q4_0; Q3_K from 16, Q5_K from 20.) But no fewer than 20 rows: a decode step whose products
# all take the int8 path runs whole in C (ops/decode_stack.py), which at 16 streams outran the per-layer path and
# its faster products (engine, 16 streams decoding 48 tokens, tok/s with the int8 path / with 16 as the threshold:
# Q4_1 325-328 / 318-328, the Q4_K_M file's mostly-Q5_0 layers 328-330 / 301-304), while from 18-20 rows the dense
# path led (Q4_1 at 20: 334-336 / 386-392; Q8_0 at 20: 353-357 / 367-370). With torch's GEMM on row-major tiles,
# before 2026-12-07, the thresholds were 24-48.
_AMX_BF16_DENSE_MIN_ROWS: dict[str, int | None] = {
    "Q4_0": 20, "Q4_1": 20, "Q5_0": 20, "Q5_1": 20, "Q8_0": 20, "IQ4_NL": 20,
    "Q2_K": 24, "Q3_K": 20, "Q4_K": 24, "Q5_K": 20, "Q6_K": 20,
}
# The same for CPUs whose vector units multiply bfloat16 (avx512_bf16's VDPBF16PS) but have no AMX: torch's
# bfloat16 GEMM reaches ~2x its float32 rate there, and bfloat16 tiles dequantize at 12-16 G weights/s on 2
# threads, so the dense path overtakes the int8 products (flat at 110-230 GFLOP/s) from a dozen or two rows on.
# Measured on a 2-core AMD EPYC Zen 4 (family 25 model 17), 2 threads, wall clock, layers from memory, bfloat16 x
# (benchmarks/gguf_kernels.py --activations bfloat16; 32-weight types on 640 -> 8192, k-quants on 2048 -> 2048),
# GFLOP/s int8 / dense:
#   rows  Q4_0     Q4_1     Q5_0     Q5_1     Q8_0     Q2_K     Q3_K     Q4_K     Q5_K     Q6_K
#      8  107/89   131/95   112/96   113/93   142/108  217/90   142/87   202/87   176/86   187/93
#     16  134/159  133/153  115/158  114/154  143/168  223/145  132/122  212/147  178/138  194/154
#     24  137/200  136/194  113/197  114/198  145/213  226/176  151/182  208/187  182/189  198/204
#     32  134/230  136/218  114/223  114/226  148/249  218/197  154/222  205/215  180/214  201/227
#     48  133/275  130/258  108/267  114/269  148/288  183/224  149/261  215/255  185/258  198/269
# Not measured on an Intel CPU with avx512_bf16 and no AMX (Cooper Lake); it takes this table too.
_AVX512_BF16_DENSE_MIN_ROWS: dict[str, int | None] = {
    "Q4_0": 16, "Q4_1": 16, "Q5_0": 16, "Q5_1": 16, "Q8_0": 16, "IQ4_NL": 16,
    "Q2_K": 48, "Q3_K": 24, "Q4_K": 32, "Q5_K": 24, "Q6_K": 24,
}
# IQ4_NL (Q4_0's nibble blocks, each nibble looked up in a 16-value grid by one byte shuffle, multiplied as Q8_0's
# signed quants) takes Q4_0's thresholds in every table. Its paths ran as Q4_0's where measured: 2-core Intel Xeon
# with AMX (cpu family 6 model 167), 2 threads, bfloat16 x, 1,536 -> 576 from memory (benchmarks/gguf_kernels.py
# --types Q4_0 IQ4_NL --activations bfloat16), ms int8 / dense, Q4_0 | IQ4_NL:
#   rows 1: .039/.177 | .038/.154; 8: .141/.202 | .130/.190; 16: .260/.199 | .256/.217; 20: .310/.196 | .304/.216;
#   64: .286/.213 | .298/.239.
# The grid twins are IQ4_NL's code with another 16 bytes in the shuffle: its thresholds. NVFP4_F16 is MXFP4_F16's
# code with a scale per 16 weights (a vector of two scales where the others broadcast one): the same.
for _table in (_AVX2_DENSE_MIN_ROWS, _AMX_BF16_DENSE_MIN_ROWS, _AVX512_BF16_DENSE_MIN_ROWS, DENSE_MIN_ROWS["generic"]):
    _table.update(dict.fromkeys((*GRID_TWINS, "NVFP4_F16"), _table["IQ4_NL"]))
# Weight bytes dequantized per tile of the dense path: one tile is the only dequantized copy that exists.
DENSE_TILE_BYTES = 4 << 20
# The same on AMX's tiles (bfloat16 bytes of W in linear_bf16's packed layout): half a tile per thread of a 2-core
# Intel Xeon with AMX (2 MiB of L2 a core) stays in its L2 between the tile's dequantization and its product;
# chosen over 4 MiB, 1 MiB and 512 KiB by benchmarks/gguf_amx_tiles.py (the figures: README, "NVFP4 checkpoints").
AMX_TILE_BYTES = 2 << 20


def _format(type_name: str) -> tuple[int, QuantFormat]:
    entry = _FORMATS.get(type_name)
    if entry is None:
        raise ValueError(f"GGML type {type_name!r} is unknown; pagellm reads {', '.join(_FORMATS)}")
    return entry


def row_bytes(type_name: str, in_features: int) -> int:
    """Bytes one output row of `in_features` weights takes in `type_name`'s blocks."""
    _, fmt = _format(type_name)
    if in_features <= 0 or in_features % fmt.block_size:
        raise ValueError(f"in_features={in_features} is not a positive multiple of {type_name}'s block of "
                         f"{fmt.block_size} weights; such a tensor cannot be stored in {type_name}")
    return in_features // fmt.block_size * fmt.block_bytes


def _check_weight(weight: torch.Tensor, type_name: str, out_features: int, in_features: int) -> None:
    # Called per product (~100 per decode step): the common case is a few attribute reads.
    expected = (out_features, row_bytes(type_name, in_features))
    if weight.dtype != torch.uint8 or weight.shape != expected or not weight.is_contiguous():
        raise ValueError(f"a {type_name} weight of {out_features} x {in_features} must be a contiguous uint8 tensor of "
                         f"shape {expected} (each output row's blocks), not {weight.dtype} {tuple(weight.shape)}")
    if not weight.is_cpu:
        raise ValueError(f"the GGUF CPU kernels read weights on the CPU, not on {weight.device}")


def _rows_of(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features in its last dimension; this weight takes {in_features}")
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()


def _output(x: torch.Tensor, rows: int, out_features: int, dtype: torch.dtype, out: torch.Tensor | None):
    if out is None:
        return torch.empty(rows, out_features, dtype=dtype)
    if out.dtype != dtype or out.numel() != rows * out_features or out.shape[-1] != out_features \
            or not out.is_contiguous():
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; this product writes a contiguous {dtype} tensor of "
                         f"{tuple(x.shape[:-1])} x {out_features}")
    return out.view(rows, out_features)


def _row_ids(row_ids: torch.Tensor | np.ndarray, out_features: int) -> torch.Tensor:
    ids = torch.as_tensor(row_ids).reshape(-1)
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"row_ids must be integers, not {ids.dtype}")
    ids = ids.to(torch.int64).contiguous()
    if not ids.numel():
        return ids
    low, high = (int(bound) for bound in torch.aminmax(ids))  # one pass: an embedding gather per step checks it
    if low < 0 or high >= out_features:
        bad = low if low < 0 else high
        raise IndexError(f"row id {bad} is outside this weight's {out_features} rows (0 .. {out_features - 1})")
    return ids


class TorchGGUFOps:
    """The same operations in numpy/torch: dequantize (pagellm.models.gguf_quants, equal to the gguf package's),
    then F.linear in float32: the reference the kernels are tested against. Where the C kernels cannot be built
    a model gets it with keeps_blocks=False: it takes no block type, so the layers dequantize once at load and
    run dense, instead of dequantizing the whole model at every step."""

    isa = "torch"

    def __init__(self, keeps_blocks: bool = True) -> None:
        self.keeps_blocks = keeps_blocks

    def supports(self, type_name: str) -> bool:
        return self.keeps_blocks and type_name in _FORMATS

    def dequantize_rows(self, weight: torch.Tensor, type_name: str, row_ids: torch.Tensor | np.ndarray,
                        in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        ids = _row_ids(row_ids, weight.shape[0])
        _check_weight(weight, type_name, weight.shape[0], in_features)
        type_id, _ = _format(type_name)
        rows = weight[ids].numpy()
        return torch.from_numpy(dequantize(rows, type_id, (len(ids), in_features))).to(dtype)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, type_name: str, out_features: int, in_features: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        _check_weight(weight, type_name, out_features, in_features)
        rows = _rows_of(x, in_features)
        type_id, _ = _format(type_name)
        dense = torch.from_numpy(dequantize(weight.numpy(), type_id, (out_features, in_features)))
        y = _output(x, rows.shape[0], out_features, x.dtype, out)
        y.copy_(F.linear(rows.float(), dense))
        return y.view(*x.shape[:-1], out_features)


def _bf16_dense_table(isa: str) -> dict[str, int | None] | None:
    """bfloat16 activations' own thresholds where torch's GEMM multiplies bfloat16 natively (on AMX tiles, or on
    avx512_bf16's vector instructions); None: they take dense_min_rows, as float32 does."""
    if isa != "avx512":
        return None
    if cpu_has_amx_bf16():
        return dict(_AMX_BF16_DENSE_MIN_ROWS)
    if cpu_has_native(torch.bfloat16):
        return dict(_AVX512_BF16_DENSE_MIN_ROWS)
    return None


class GGUFKernels:
    """csrc/gguf_quant.c with its argument types declared. Activations are float32 or bfloat16 (others are
    computed from float32 and returned in their dtype); outputs have x's dtype."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.isa = cpu_build.library_isa(library)
        self.library = library  # for the decode stack's product (pagellm/ops/decode_stack.py)
        library.gguf_dot_instructions.restype = ctypes.c_char_p
        self.dot_instructions = library.gguf_dot_instructions().decode()
        self._matmul = library.gguf_matmul
        self._matmul.restype = _INT
        self._matmul.argtypes = [_INT, _PTR, _PTR, _INT, _I64, _I64, _I64, _PTR, _INT]
        self._matmul_experts = library.gguf_matmul_experts
        self._matmul_experts.restype = _INT
        self._matmul_experts.argtypes = [_INT, _PTR, _PTR, _PTR, _I64, _PTR, _INT, _I64, _I64, _PTR, _INT]
        self._dequantize = library.gguf_dequantize_rows
        self._dequantize.restype = _INT
        self._dequantize.argtypes = [_INT, _PTR, _I64, _PTR, _I64, _I64, _PTR, _INT]
        self._dequantize_packed = library.gguf_dequantize_packed
        self._dequantize_packed.restype = _INT
        self._dequantize_packed.argtypes = [_INT, _PTR, _I64, _I64, _I64, _PTR]
        self._tiles = tiles_product_function(library, "gguf_tiles_product")
        self._amx_tiles: dict[int, BF16TilesStruct] = {}  # _matmul_amx's, per columns of a tile
        for name in ("gguf_block_weights", "gguf_block_bytes", "gguf_tile_min_rows"):
            getattr(library, name).restype = _INT
            getattr(library, name).argtypes = [_INT]
        for type_name in KERNEL_TYPES:  # the C tables must be the loader's
            type_id, fmt = _format(type_name)
            geometry = (library.gguf_block_weights(type_id), library.gguf_block_bytes(type_id))
            if geometry != (fmt.block_size, fmt.block_bytes):
                raise RuntimeError(f"gguf_quant.c has {type_name} blocks of {geometry}, gguf_quants "
                                   f"{(fmt.block_size, fmt.block_bytes)}")
        # Per type, the rows from which the int8 products run on 512-bit tiles (absent: never)
        self.tile_min_rows = {name: rows for name in KERNEL_TYPES
                              if (rows := library.gguf_tile_min_rows(_format(name)[0]))}
        self.dense_min_rows = dict(DENSE_MIN_ROWS["avx512_vnni" if self.tile_min_rows else self.isa])
        self.bf16_dense_min_rows = _bf16_dense_table(self.isa)
        # bfloat16 rows from which the tiles, not the dense path, take a type (where the dense GEMM is not AMX's)
        self.bf16_tile_min_rows = {} if cpu_has_amx_bf16() else dict(self.tile_min_rows)
        self.amx_product = _amx_product(self.isa)

    @staticmethod
    def supports(type_name: str) -> bool:
        return type_name in KERNEL_TYPES

    def _type_id(self, type_name: str) -> int:
        if not self.supports(type_name):
            raise ValueError(f"the GGUF kernels compute with {', '.join(KERNEL_TYPES)}, not {type_name!r}; "
                             f"use TorchGGUFOps (dequantized) for it")
        return _format(type_name)[0]

    def dense_threshold(self, type_name: str, dtype: torch.dtype) -> int | None:
        """Rows of x in `dtype` from which `matmul` takes the dense path (None: never), unless the int8 products'
        tiles take them back (tile_threshold)."""
        if dtype is torch.bfloat16 and self.bf16_dense_min_rows is not None:
            return self.bf16_dense_min_rows.get(type_name)
        return self.dense_min_rows.get(type_name)

    def tile_threshold(self, type_name: str, dtype: torch.dtype) -> int | None:
        """Rows of x in `dtype` from which `matmul` runs the int8 products on their 512-bit tiles (None: never)."""
        return (self.bf16_tile_min_rows if dtype is torch.bfloat16 else self.tile_min_rows).get(type_name)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, type_name: str, out_features: int, in_features: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in_features] @ W^T -> [..., out_features] in x's dtype (written into `out` if given): int8
        products below `dense_threshold(type_name, x.dtype)` rows of x, torch's GEMM on dequantized weight tiles
        from there, and the int8 products' 512-bit tiles from `tile_threshold` rows on where the build has them."""
        threshold = self.dense_threshold(type_name, x.dtype)
        if threshold is not None and x.numel() >= threshold * in_features:
            tiles = self.tile_threshold(type_name, x.dtype)
            if tiles is None or x.numel() < tiles * in_features:
                return self.matmul_dense(x, weight, type_name, out_features, in_features, out)
        return self.matmul_int8(x, weight, type_name, out_features, in_features, out)

    def prepare(self, weight: torch.Tensor, type_name: str, out_features: int, in_features: int) -> PreparedProduct:
        """`matmul` by this weight, checked once here: a layer calls it every step (a decode step makes ~100
        products of a few microseconds of host work each, which the per-call checks would double)."""
        _check_weight(weight, type_name, out_features, in_features)
        return PreparedProduct(self, weight, type_name, self._type_id(type_name), out_features, in_features)

    def matmul_int8(self, x: torch.Tensor, weight: torch.Tensor, type_name: str, out_features: int,
                    in_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`matmul` on the int8 products whatever the row count."""
        type_id = self._type_id(type_name)
        _check_weight(weight, type_name, out_features, in_features)
        if x.dtype not in ACTIVATION_DTYPES:  # e.g. float16: computed from float32, returned in its dtype
            y = self.matmul_int8(x.float(), weight, type_name, out_features, in_features)
            if out is None:
                return y.to(x.dtype)
            _output(x, x.numel() // in_features, out_features, x.dtype, out).view(y.shape).copy_(y)
            return out.view(y.shape)
        rows = _rows_of(x, in_features)
        y = _output(x, rows.shape[0], out_features, x.dtype, out)
        bf16 = int(x.dtype == torch.bfloat16)
        failed = self._matmul(type_id, weight.data_ptr(), rows.data_ptr(), bf16, rows.shape[0], in_features,
                              out_features, y.data_ptr(), bf16)
        if failed:
            raise _matmul_failure(failed, rows.shape[0], type_name, in_features)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)

    def matmul_dense(self, x: torch.Tensor, weight: torch.Tensor, type_name: str, out_features: int,
                     in_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`matmul` as a GEMM on tiles of the weight dequantized in turn (DENSE_TILE_BYTES each): linear_bf16 on
        AMX's tiles for bfloat16 x where the CPU has them, else torch's GEMM, in bfloat16 where x is bfloat16 and
        the CPU multiplies it natively, else float32."""
        type_id = self._type_id(type_name)
        _check_weight(weight, type_name, out_features, in_features)
        rows = _rows_of(x, in_features)
        if x.dtype == torch.bfloat16 and self.amx_product is not None and in_features % AMX_K == 0 \
                and out_features % LinearBF16.PANEL == 0:
            return self._matmul_amx(rows, weight, type_id, out_features, in_features, out).view(*x.shape[:-1],
                                                                                               out_features)
        gemm_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 and cpu_has_native(torch.bfloat16) else torch.float32
        operand = rows.to(gemm_dtype)
        y = _output(x, rows.shape[0], out_features, x.dtype, out)
        element = torch.finfo(gemm_dtype).bits // 8
        tile_rows = max(1, min(out_features, DENSE_TILE_BYTES // (in_features * element)))
        tile = self._tile(tile_rows * in_features, gemm_dtype)
        direct = y.dtype == gemm_dtype
        for first in range(0, out_features, tile_rows):
            n = min(tile_rows, out_features - first)
            dense = tile[: n * in_features].view(n, in_features)
            if self._dequantize(type_id, weight.data_ptr(), in_features, None, first, n, dense.data_ptr(),
                                int(gemm_dtype == torch.bfloat16)):
                raise ValueError(f"gguf_dequantize_rows refused {type_name} with in_features={in_features}")
            if direct:
                torch.mm(operand, dense.t(), out=y[:, first : first + n])
            else:
                y[:, first : first + n] = torch.mm(operand, dense.t())
        return y.view(*x.shape[:-1], out_features)

    def amx_dense_takes(self, type_name: str, out_features: int, in_features: int) -> bool:
        """Whether bfloat16 rows from `dense_threshold` on always run on AMX's tiles (`_matmul_amx`) for this
        weight: the tiles here, whole blocks of inputs and panels of outputs, no int8 tiles taking rows back."""
        return (self.amx_product is not None and in_features % AMX_K == 0 and out_features % LinearBF16.PANEL == 0
                and self.dense_threshold(type_name, torch.bfloat16) is not None
                and self.tile_threshold(type_name, torch.bfloat16) is None)

    def _matmul_amx(self, rows: torch.Tensor, weight: torch.Tensor, type_id: int, out_features: int,
                    in_features: int, out: torch.Tensor | None) -> torch.Tensor:
        """matmul_dense on AMX's tiles (linear_bf16), each tile of W dequantized straight into that kernel's
        packed layout and multiplied into its columns of y: no oneDNN, which keeps a primitive and its JIT code
        for every row count it has seen (README, "Memory that grows with use")."""
        y = _output(rows, rows.shape[0], out_features, torch.bfloat16, out)
        columns = _amx_tile_rows(out_features, in_features)
        tiles = self._amx_tiles.get(columns)
        if tiles is None:
            tiles = self._amx_tiles[columns] = BF16TilesStruct.of(self.amx_product, 0, columns)
        run_tiles_product(self._tiles, GgufStackLayer(weight.data_ptr(), type_id, tiles), rows, in_features,
                          out_features, y, f"type {type_id} with in_features={in_features}")
        return y

    def dequantize_packed(self, weight: torch.Tensor, type_name: str, first_row: int, n_rows: int,
                          in_features: int) -> torch.Tensor:
        """Rows first_row .. first_row + n_rows - 1 of W in bfloat16 (dequantize_rows' values), in linear_bf16's
        packed layout [n_rows / 16, in_features / 2, 16, 2]; n_rows a multiple of 16."""
        _check_weight(weight, type_name, weight.shape[0], in_features)
        if n_rows % LinearBF16.PANEL or first_row < 0 or first_row + n_rows > weight.shape[0]:
            raise ValueError(f"rows {first_row} + {n_rows} of a {weight.shape[0]}-row weight: packing takes whole "
                             f"panels of {LinearBF16.PANEL} rows within the weight")
        out = torch.empty(n_rows * in_features, dtype=torch.bfloat16)
        return self._packed_rows(self._type_id(type_name), weight, first_row, n_rows, in_features, out)

    def _packed_rows(self, type_id: int, weight: torch.Tensor, first_row: int, n_rows: int, in_features: int,
                     out: torch.Tensor) -> torch.Tensor:
        if self._dequantize_packed(type_id, weight.data_ptr(), in_features, first_row, n_rows, out.data_ptr()):
            raise ValueError(f"gguf_dequantize_packed refused type {type_id} with in_features={in_features} and "
                             f"{n_rows} rows")
        return out.view(n_rows // LinearBF16.PANEL, in_features // 2, LinearBF16.PANEL, 2)

    @staticmethod
    def _tile(elements: int, dtype: torch.dtype) -> torch.Tensor:
        return thread_scratch("gguf", "tile", elements, dtype)

    def dequantize_rows(self, weight: torch.Tensor, type_name: str, row_ids: torch.Tensor | np.ndarray,
                        in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows row_ids of W as a [len(row_ids), in_features] tensor of `dtype` (float32 or bfloat16 computed
        directly, others through float32), equal to gguf's dequantization (rounded once for bfloat16)."""
        type_id = self._type_id(type_name)
        ids = _row_ids(row_ids, weight.shape[0])
        _check_weight(weight, type_name, weight.shape[0], in_features)
        kernel_dtype = dtype if dtype in ACTIVATION_DTYPES else torch.float32
        out = torch.empty(len(ids), in_features, dtype=kernel_dtype)
        if self._dequantize(type_id, weight.data_ptr(), in_features, ids.data_ptr(), 0, len(ids), out.data_ptr(),
                            int(kernel_dtype == torch.bfloat16)):
            raise ValueError(f"gguf_dequantize_rows refused {type_name} with in_features={in_features}")
        return out.to(dtype)


class GGUFExpertsProduct:
    """One projection of a mixture-of-experts layer's experts (their PreparedProducts: one library, type and
    shape) in one gguf_matmul_experts call per step: each expert's rows on the int8 row kernels, as each
    expert's own product computes them (the same bits), with one call and one fork of the threads for all.
    A step where an expert has rows for the dense path or the 512-bit tiles goes expert by expert instead
    (`takes`)."""

    def __init__(self, products: list[PreparedProduct]) -> None:
        first = products[0]
        self.kernels, self.type_id = first.kernels, first.type_id
        self.in_features, self.out_features = first.in_features, first.out_features
        self.products = products  # held: the table points into their weights
        self.table = (ctypes.c_void_p * len(products))(*(p.weight_address for p in products))
        # the library's own tiles (gguf_matmul_experts refuses rows for them), whatever the dtype
        tiles = first.kernels.tile_min_rows.get(first.type_name)
        self.rows_below: dict[torch.dtype, float] = {}
        for dtype in ACTIVATION_DTYPES:
            int8_rows = first.int8_max_rows(dtype)
            dense = math.inf if int8_rows is None else int8_rows + 1
            self.rows_below[dtype] = min(dense, tiles or math.inf)

    @staticmethod
    def of(products: list[object]) -> GGUFExpertsProduct | None:
        """The one call for these experts' products, or None where they are not all prepared int8 products of one
        library, type and shape."""
        if not products or not all(type(p) is PreparedProduct for p in products):
            return None
        first = products[0]
        same = all((p.kernels, p.type_id, p.in_features, p.out_features)
                   == (first.kernels, first.type_id, first.in_features, first.out_features) for p in products)
        return GGUFExpertsProduct(products) if same else None

    def takes(self, sizes: list[int], dtype: torch.dtype) -> bool:
        """Whether every expert's rows are few enough for the row kernels (as their own products send them)."""
        return max(sizes) < self.rows_below.get(dtype, 0)

    def __call__(self, experts: list[int], sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows of expert i] = x[the same rows] @ W_{experts[i]}^T, rows in the order of `experts`; x and out
        contiguous, float32 or bfloat16, one dtype."""
        ids, counts = cpu_build.expert_arrays(experts, sizes)
        failed = self.kernels._matmul_experts(self.type_id, self.table, ids, counts, len(experts), x.data_ptr(),
                                              x.dtype is torch.bfloat16, self.in_features, self.out_features,
                                              out.data_ptr(), out.dtype is torch.bfloat16)
        if failed:
            raise (MemoryError if failed == 1 else ValueError)(
                f"gguf_matmul_experts failed ({failed}) on {len(experts)} experts of {sum(sizes)} rows")


class PreparedProduct:
    """x @ W^T for one weight checked at load (GGUFKernels.prepare). A call whose x is a contiguous float32 or
    bfloat16 matrix of rows below the dense path's threshold goes straight to the int8 kernel; any other x
    takes GGUFKernels.matmul, with its checks and conversions."""

    __slots__ = ("kernels", "weight", "type_name", "type_id", "out_features", "in_features", "weight_address",
                 "int8_max_elements", "bf16_int8_max_elements", "function")

    def __init__(self, kernels: GGUFKernels, weight: torch.Tensor, type_name: str, type_id: int, out_features: int,
                 in_features: int) -> None:
        self.kernels = kernels
        self.weight = weight  # held: the kernel reads it by address
        self.type_name = type_name
        self.type_id = type_id
        self.out_features = out_features
        self.in_features = in_features
        self.weight_address = weight.data_ptr()
        self.int8_max_elements = self._limit(kernels.dense_threshold(type_name, torch.float32))
        self.bf16_int8_max_elements = self._limit(kernels.dense_threshold(type_name, torch.bfloat16))
        self.function = kernels._matmul

    def _limit(self, threshold: int | None) -> int | None:
        return None if threshold is None else threshold * self.in_features

    def int8_max_rows(self, dtype: torch.dtype) -> int | None:
        """The most rows of x in `dtype` a call takes on the int8 kernel before the dense path's threshold (None:
        no threshold; the 512-bit tiles, where the build has them, take rows from `tile_threshold` on)."""
        limit = self.bf16_int8_max_elements if dtype is torch.bfloat16 else self.int8_max_elements
        return None if limit is None else limit // self.in_features - 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        limit = self.bf16_int8_max_elements if dtype is torch.bfloat16 else self.int8_max_elements
        if (x.dim() != 2 or x.shape[1] != self.in_features or not x.is_contiguous()
                or (dtype is not torch.float32 and dtype is not torch.bfloat16)
                or (limit is not None and x.numel() >= limit)):
            return self.kernels.matmul(x, self.weight, self.type_name, self.out_features, self.in_features)
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=dtype)
        bf16 = dtype is torch.bfloat16
        failed = self.function(self.type_id, self.weight_address, x.data_ptr(), bf16, rows, self.in_features,
                               self.out_features, y.data_ptr(), bf16)
        if failed:
            raise _matmul_failure(failed, rows, self.type_name, self.in_features)
        return y


def _matmul_failure(code: int, rows: int, type_name: str, in_features: int) -> Exception:
    """The error of gguf_matmul's non-zero return `code`."""
    if code == 1:
        return MemoryError(f"gguf_matmul could not allocate the quantized activations of {rows} rows")
    return ValueError(f"gguf_matmul refused {type_name} with in_features={in_features}")


def build_flags(isa: str, flags: frozenset[str] | None = None) -> list[str]:
    """The compiler flags of the kernels for `isa` on a CPU with `flags` (default: this one's): cpu_build.py's, plus
    the VNNI dot product and AMX's int8 tiles where the CPU has them, and no contracted multiply-adds (the
    dequantizers round as gguf's)."""
    flags = cpu_flags() if flags is None else flags
    extra = ["-ffp-contract=off"]
    if isa == "avx512" and "avx512_vnni" in flags:
        extra.append("-mavx512vnni")
        if {"amx_tile", "amx_int8"} <= flags:
            extra += ["-mamx-tile", "-mamx-int8"]
    elif isa == "avx2" and "avx_vnni" in flags:
        extra.append("-mavxvnni")
    return cpu_build.compiler_flags(isa) + extra


def _amx_tile_rows(out_features: int, in_features: int) -> int:
    """Rows of W per tile of the dense path on AMX (about AMX_TILE_BYTES of bfloat16): whole 32-output blocks
    of linear_bf16 in each tile but the last."""
    block = 2 * LinearBF16.PANEL
    return min(out_features, max(block, AMX_TILE_BYTES // (2 * in_features) // block * block))


class GgufStackLayer(ctypes.Structure):
    """csrc/gguf_quant.c's GgufStackLayer: one GGUF weight as the decode stack's product (gguf_stack_product)
    reads it, bfloat16 rows going to linear_bf16 on AMX's tiles where and from where `GGUFKernels.matmul` sends
    them."""

    _fields_ = [("blocks", _PTR), ("type", _I64), ("tiles", BF16TilesStruct)]

    @classmethod
    def of(cls, product: PreparedProduct) -> GgufStackLayer:
        kernels = product.kernels
        if not kernels.amx_dense_takes(product.type_name, product.out_features, product.in_features):
            return cls(product.weight_address, product.type_id, BF16TilesStruct.of(None))
        return cls(product.weight_address, product.type_id,
                   BF16TilesStruct.of(kernels.amx_product, kernels.dense_threshold(product.type_name, torch.bfloat16),
                                      _amx_tile_rows(product.out_features, product.in_features)))


def _amx_product(isa: str) -> LinearBF16 | None:
    """linear_bf16 where its library for `isa` runs on AMX's bfloat16 tiles here (the dense path's product then),
    else None (torch's GEMM takes the dense tiles)."""
    product = linear_bf16(isa)
    return product if product is not None and product.amx else None


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    try:
        path = cpu_build.build_library(f"pagellm_gguf_{isa}", _SOURCES, _HEADERS, build_flags(isa))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        detail = (getattr(error, "stderr", None) or str(error)).strip()
        logger.warning("GGUF CPU kernels unavailable (%s); quantized layers run dequantized in torch",
                       detail.splitlines()[0] if detail else type(error).__name__)
        return None


def gguf_kernels(isa: str | None = None) -> GGUFKernels | None:
    """The kernels built for `isa` (default: cpu_build.best_isa(), which honours PAGELLM_CPU_ISA), or None where
    there is no compiler or PAGELLM_NATIVE_KERNELS=0."""
    if os.environ.get("PAGELLM_NATIVE_KERNELS", "1") == "0":
        return None
    library = _library(isa or cpu_build.best_isa())
    return GGUFKernels(library) if library is not None else None


def gguf_ops(isa: str | None = None,
             device: torch.device | str | None = None) -> GGUFKernels | TorchGGUFOps | TritonGGUFKernels:
    """The kernels for weights on `device`: on CUDA the Triton kernels (pagellm.ops.triton_gguf); on the CPU the C
    kernels where they can be built, else the torch path: a GGUF model always runs."""
    if device is not None and torch.device(device).type == "cuda":
        from pagellm.ops.triton_gguf import TritonGGUFKernels

        return TritonGGUFKernels()
    return gguf_kernels(isa) or TorchGGUFOps(keeps_blocks=False)
