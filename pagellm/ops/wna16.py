"""Linear layers on group-quantized integer weights: AWQ and GPTQ checkpoints (vLLM calls the family "wNa16":
N-bit integer weights, activations in a float type), kept at 4 or 8 bits per weight in memory.

Both formats come down to one representation at load (`GroupQuantWeight`): the weights packed along the input
features into int32 words (GPTQ's order; AWQ's checkpoints pack along the outputs in an interleaved order and
are repacked once), and per group of input features a scale s and an offset o = -s * zero point, so that
W[n, k] = s[g_idx[k], n] * q[k, n] + o[g_idx[k], n]. `g_idx` names each input feature's group: GPTQ's act-order
(desc_act) checkpoints number their groups in the order the features were quantized, not in input order.

Where the product runs (`choose_kernel`):
- CPU: csrc/wna16.c on its own blocked layout (`CpuLayout`, built from the representation, which is then
  dropped: one copy of the weight). Up to `dense_min_rows` rows of x (decode, small batches) it reads the
  packed weights directly, each once per call; from there on (prefill) it dequantizes tiles of
  DENSE_TILE_BYTES into float32 and runs torch's GEMM on them (benchmarks/wna16_kernels.py measures both).
  bfloat16 rows on CPUs with avx512_bf16 go instead, from `bf16_tile_min_rows` rows, to linear_bf16 (AMX's tiles
  where the CPU has them) on tiles of the weight dequantized into its packed layout.
- CUDA: the Triton kernel in pagellm/ops/triton_quant.py on the representation itself.
- Elsewhere, or where the C kernels cannot be built (no compiler, PAGELLM_NATIVE_KERNELS=0): `TorchGroupQuant`,
  which dequantizes the weight per call and runs F.linear: slow, but a model always runs, and it is the
  reference the kernels are tested against.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagellm.cpu_features import cpu_has_amx_bf16
from pagellm.ops import cpu_build
from pagellm.ops.linear_bf16 import BF16TilesStruct, LinearBF16, linear_bf16, run_tiles_product, tiles_product_function
from pagellm.ops.scratch import thread_scratch
from pagellm.worker.huge_pages import to_weight_memory

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "wna16.c"]
_HEADERS = [_CSRC / "isa_name.h", _CSRC / "bf16_tiles.h"]
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

BITS = (4, 8)
# Output columns per block of the CPU layout (csrc/wna16.c's NB).
BLOCK_COLUMNS = 32
# Weight bytes dequantized per tile of the dense path: the only dequantized copy that ever exists.
DENSE_TILE_BYTES = 4 << 20
# Rows of x from which the CPU kernel's dense path (dequantized tiles into torch's GEMM) takes over, per
# instruction set and bits: where the two met in benchmarks/wna16_kernels.py on a 2048 x 2048 layer, groups of 128,
# one thread (README, "AWQ and GPTQ checkpoints", has the table). The packed path stays near float32's speed up to
# a few hundred rows, then falls off as each block re-reads all rows of x; the dense path pays for writing its
# float32 tiles. The AVX-512 build runs the AVX2 build's code (32-byte vectors) and takes its table until measured
# there. The generic build's packed path is the vector extensions lowered to SSE2, several times slower.
DENSE_MIN_ROWS: dict[str, dict[int, int]] = {
    "avx512": {4: 512, 8: 384},
    "avx2": {4: 512, 8: 384},
    "generic": {4: 16, 8: 16},
}
# bfloat16 rows from which linear_bf16 multiplies them by the weight dequantized into its packed layout, per bits,
# where the CPU has AMX's bfloat16 tiles (benchmarks/wna16_kernels.py --bf16 on a Sapphire Rapids Xeon since the
# one-pass dequantization: the tiles ahead from 8 rows at 4 bits, 8-10 at 8, on SmolLM2's shapes and 2048 x 2048;
# README "AWQ, GPTQ and fp8 on AMX's tiles"), and where it has avx512_bf16's vector products alone (the same
# benchmark on a Zen 4 before that change: the tiles ahead from 24-32 rows on 384 x 1024 to 2048 x 2048 layers,
# README "Quantized weights").
BF16_TILE_MIN_ROWS = {4: 8, 8: 10}
BF16_VECTOR_TILE_MIN_ROWS = {4: 32, 8: 32}
# A mixture-of-experts layer's experts take the tiles from at least this many rows an expert: below it a step's
# experts run on the packed path in one call (ExpertsPackedProduct), which at 8-15 rows an expert beat each expert's
# own tiles on AMX (benchmarks/moe_quantized.py --batch 8 32 64, README "AWQ, GPTQ and fp8 on AMX's tiles").
EXPERTS_BF16_TILE_MIN_ROWS = 16


def pack_factor(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"{bits}-bit weights are not supported; the kernels take {BITS}")
    return 32 // bits


@dataclass
class GroupQuantWeight:
    """One linear layer's weight (or a column range of it) as 4- or 8-bit integers with group scales."""

    bits: int
    qweight: torch.Tensor  # int32 [in_features / pack, out_features]: field j of word [k // pack, n] is q[k, n]
    scales: torch.Tensor  # float32 [groups, out_features]
    offsets: torch.Tensor  # float32 [groups, out_features]: -scale * zero point
    g_idx: torch.Tensor  # int32 [in_features], each in [0, groups)

    @property
    def in_features(self) -> int:
        return self.g_idx.numel()

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]

    def check(self, name: str = "weight") -> None:
        pack = pack_factor(self.bits)
        in_features, out_features = self.in_features, self.out_features
        expected = {
            "qweight": ((in_features // pack, out_features), torch.int32),
            "scales": ((self.num_groups, out_features), torch.float32),
            "offsets": ((self.num_groups, out_features), torch.float32),
            "g_idx": ((in_features,), torch.int32),
        }
        for field_name, (shape, dtype) in expected.items():
            tensor = getattr(self, field_name)
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"{name}: {field_name} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape}")
        if in_features % pack:
            raise ValueError(f"{name}: {in_features} input features are not a whole number of {pack}-value words")
        if in_features and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= self.num_groups):
            raise ValueError(f"{name}: g_idx holds groups outside 0 .. {self.num_groups - 1}")

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scales, self.offsets, self.g_idx]


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [rows, columns] packed along the rows (field j of word i is row i * pack + j) -> int32
    values [rows * pack, columns]."""
    pack = pack_factor(bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(1) >> shifts.view(1, pack, 1)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0] * pack, packed.shape[1])


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of unpack_rows: values [rows, columns] in 0 .. 2^bits - 1 -> int32 [rows / pack, columns]."""
    pack = pack_factor(bits)
    if values.shape[0] % pack:
        raise ValueError(f"{values.shape[0]} rows do not fill whole {pack}-value words")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    fields = values.to(torch.int64).view(values.shape[0] // pack, pack, values.shape[1]) << shifts.view(1, pack, 1)
    words = fields.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize(weight: GroupQuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [out_features, in_features] in `dtype` (the reference every kernel is tested against)."""
    q = unpack_rows(weight.qweight, weight.bits).to(torch.float32)  # [in, out]
    groups = weight.g_idx.long()
    w = q * weight.scales[groups] + weight.offsets[groups]
    return w.t().to(dtype)


def compact_groups(weight: GroupQuantWeight) -> GroupQuantWeight:
    """The same weight without the groups no input feature uses (a tensor-parallel rank of a row-parallel layer
    holds every group's scales but uses only its own features' groups)."""
    used, g_idx = torch.unique(weight.g_idx, sorted=True, return_inverse=True)
    if used.numel() == weight.num_groups:
        return weight
    return GroupQuantWeight(weight.bits, weight.qweight, weight.scales[used].contiguous(),
                            weight.offsets[used].contiguous(), g_idx.to(torch.int32))


# ---- the CPU kernels' layout ---------------------------------------------------------------------------------


@dataclass
class CpuLayout:
    """csrc/wna16.c's layout of one weight (see the C source): columns in blocks of BLOCK_COLUMNS, each block's
    packed rows contiguous, rows sorted by group and each group padded to whole words."""

    bits: int
    in_features: int
    out_features: int
    packed: torch.Tensor  # int32 [blocks, k_rows, BLOCK_COLUMNS]
    gparams: torch.Tensor  # float32 [blocks, groups, 2, BLOCK_COLUMNS]: scale, offset
    group_rows: torch.Tensor  # int32 [groups]: packed rows per group
    src: torch.Tensor | None  # int32 [k_rows * pack]: input feature of each internal row (-1: padding)
    # Per kernels' library (its id): the weight as wna16_tiles_product reads it (WNA16Kernels._tiles_layer).
    tiles_layers: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The C kernels' leading arguments, read once: a call costs microseconds of Python per product otherwise.
        self.kernel_args = (self.packed.data_ptr(), self.gparams.data_ptr(), self.group_rows.data_ptr(),
                            self.src.data_ptr() if self.src is not None else None, self.bits, self.num_groups,
                            self.k_rows)

    @property
    def k_rows(self) -> int:
        return self.packed.shape[1]

    @property
    def num_groups(self) -> int:
        return self.group_rows.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.gparams, self.group_rows] + ([self.src] if self.src is not None else [])


def cpu_layout(weight: GroupQuantWeight) -> CpuLayout:
    """The blocked layout of `weight` (its groups compacted first)."""
    weight = compact_groups(weight)
    bits, pack = weight.bits, pack_factor(weight.bits)
    in_features, out_features = weight.in_features, weight.out_features
    q = unpack_rows(weight.qweight, bits)  # [in, out]
    # Rows sorted by group (stable: input order within a group), each group padded to whole words.
    order = torch.sort(weight.g_idx.long(), stable=True).indices
    counts = torch.bincount(weight.g_idx.long(), minlength=weight.num_groups)
    padded = (counts + pack - 1) // pack * pack
    starts = torch.cumsum(padded, 0) - padded  # internal start of each group
    first_of_group = torch.cumsum(counts, 0) - counts  # position in `order` where each group begins
    groups_sorted = weight.g_idx.long()[order]
    internal = starts[groups_sorted] + torch.arange(in_features) - first_of_group[groups_sorted]
    k_internal = int(padded.sum())
    src = torch.full((k_internal,), -1, dtype=torch.int32)
    src[internal] = order.to(torch.int32)
    identity = k_internal == in_features and bool((src == torch.arange(in_features, dtype=torch.int32)).all())

    blocks = -(-out_features // BLOCK_COLUMNS)
    columns = blocks * BLOCK_COLUMNS
    q_internal = torch.zeros(k_internal, columns, dtype=torch.int32)
    q_internal[internal, :out_features] = q[order]
    packed = pack_rows(q_internal, bits)  # [k_rows, columns]
    packed = packed.view(k_internal // pack, blocks, BLOCK_COLUMNS).permute(1, 0, 2)

    gparams = torch.zeros(weight.num_groups, 2, columns, dtype=torch.float32)
    gparams[:, 0, :out_features] = weight.scales
    gparams[:, 1, :out_features] = weight.offsets
    gparams = gparams.view(weight.num_groups, 2, blocks, BLOCK_COLUMNS).permute(2, 0, 1, 3)
    # In the load's huge-page arena (worker/huge_pages.py): a decode step streams both once, and 4 KiB pages cut the
    # hardware prefetcher short at every page (README, "AWQ, GPTQ and W4A16 from memory", has the figures).
    return CpuLayout(bits, in_features, out_features, to_weight_memory(packed), to_weight_memory(gparams),
                     (padded // pack).to(torch.int32), None if identity else src)


def dequantize_cpu_layout(layout: CpuLayout) -> torch.Tensor:
    """W [out_features, in_features] float32 from the blocked layout, in torch (checks the layout builder
    independently of the C kernels)."""
    pack = pack_factor(layout.bits)
    blocks, k_rows, _ = layout.packed.shape
    q = unpack_rows(layout.packed.permute(1, 0, 2).reshape(k_rows, blocks * BLOCK_COLUMNS), layout.bits)
    params = layout.gparams.permute(1, 2, 0, 3).reshape(layout.num_groups, 2, blocks * BLOCK_COLUMNS)
    group_of_row = torch.repeat_interleave(torch.arange(layout.num_groups), layout.group_rows.long() * pack)
    w_internal = q.float() * params[group_of_row, 0] + params[group_of_row, 1]  # [k_internal, columns]
    src = layout.src.long() if layout.src is not None else torch.arange(layout.in_features)
    w = torch.zeros(layout.in_features, blocks * BLOCK_COLUMNS)
    w[src[src >= 0]] = w_internal[src >= 0]
    return w[:, : layout.out_features].t().contiguous()


# ---- the C kernels ----------------------------------------------------------------------------------------------


class WNA16Kernels:
    """csrc/wna16.c with its argument types declared."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.isa = cpu_build.library_isa(library)
        self.library = library  # for the decode stack's product pointer (pagellm/ops/decode_stack.py)
        library.wna16_block_columns.restype = _INT
        if library.wna16_block_columns() != BLOCK_COLUMNS:
            raise RuntimeError(f"wna16.c has blocks of {library.wna16_block_columns()} columns, wna16.py "
                               f"{BLOCK_COLUMNS}")
        self._matmul = library.wna16_matmul
        self._matmul.restype = _INT
        self._matmul.argtypes = [_PTR, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _PTR, _INT, _I64, _I64, _PTR, _INT,
                                 _I64, _PTR]
        self._matmul_experts = library.wna16_matmul_experts
        self._matmul_experts.restype = _INT
        self._matmul_experts.argtypes = [_PTR, _INT, _I64, _PTR, _PTR, _I64, _PTR, _INT, _I64, _PTR, _INT, _I64]
        self._dequantize_t = library.wna16_dequantize_t
        self._dequantize_t.restype = _INT
        self._dequantize_t.argtypes = [_PTR, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _I64, _PTR, _I64]
        self.dense_min_rows = dict(DENSE_MIN_ROWS[self.isa])
        self._dequantize_packed = library.wna16_dequantize_bf16_packed
        self._dequantize_packed.restype = _INT
        self._dequantize_packed.argtypes = [_PTR, _PTR, _PTR, _PTR, _INT, _I64, _I64, _I64, _I64, _I64, _PTR]
        self._tiles = tiles_product_function(library, "wna16_tiles_product")
        # bfloat16 rows on linear_bf16 (avx512_bf16; AMX's tiles too), from bf16_tile_min_rows rows on.
        self._linear_bf16 = linear_bf16(self.isa)
        if self._linear_bf16 is None:
            self.bf16_tile_min_rows = dict(self.dense_min_rows)
        else:
            self.bf16_tile_min_rows = dict(BF16_TILE_MIN_ROWS if cpu_has_amx_bf16() else BF16_VECTOR_TILE_MIN_ROWS)

    def matmul(self, x: torch.Tensor, layout: CpuLayout, out: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in_features] (float32 or bfloat16) @ W^T (+ bias) into `out` (float32 [rows, out_features],
        possibly a column slice of a wider tensor) or a new tensor: bfloat16 x from bf16_tile_min_rows rows on
        linear_bf16 where it can; else the packed path below dense_min_rows rows, the dense one from there."""
        rows = x.shape[0]
        if rows < self.packed_below(layout, x.dtype):
            return self.matmul_packed(x, layout, out, bias)
        if x.dtype is torch.bfloat16 and self._tiles_take(layout) and rows >= self.bf16_tile_min_rows[layout.bits]:
            return self.matmul_bf16_tiles(x, layout, out, bias)
        return self.matmul_dense(x, layout, out, bias)

    def product(self, x: torch.Tensor, layout: CpuLayout, out: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, tile_min_rows: int | None = None) -> torch.Tensor:
        """`matmul`, but bfloat16 rows give bfloat16 (rounded once, as `matmul(...).to(torch.bfloat16)` rounds)
        into `out` (possibly a column slice of a wider tensor) or a new tensor: the packed path and the tiles
        write them without the float32 result in between. Other rows give float32, as `matmul`. tile_min_rows:
        the tiles' threshold where not this CPU's (see packed_below)."""
        if x.dtype is not torch.bfloat16:
            return self.matmul(x, layout, out, bias)
        if x.dim() != 2 or x.shape[1] != layout.in_features:
            raise ValueError(f"x is {tuple(x.shape)}; this weight takes [rows, {layout.in_features}]")
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        if out is None:
            out = torch.empty(rows, layout.out_features, dtype=torch.bfloat16)
        elif out.dtype is not torch.bfloat16 or out.shape != (rows, layout.out_features) or out.stride(1) != 1:
            raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; this product writes bfloat16 "
                             f"[{rows}, {layout.out_features}] with unit column stride")
        if rows < self.packed_below(layout, torch.bfloat16, tile_min_rows):
            return self._packed_into(x, layout, out, bias)
        if self._tiles_take(layout) and rows >= (tile_min_rows or self.bf16_tile_min_rows[layout.bits]):
            self._tiles_into(x, layout, out)
            return out if bias is None else out.add_(bias)
        return out.copy_(self.matmul_dense(x, layout, bias=bias))

    def _packed_into(self, x: torch.Tensor, layout: CpuLayout, y: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """The packed path writing y in y's dtype (float32, or bfloat16 rounded once)."""
        if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
            bias = bias.to(torch.float32).contiguous()
        failed = self._matmul(*layout.kernel_args, layout.out_features, x.data_ptr(), x.dtype is torch.bfloat16,
                              x.shape[0], x.stride(0), y.data_ptr(), y.dtype is torch.bfloat16, y.stride(0),
                              bias.data_ptr() if bias is not None else None)
        if failed == 1:
            raise MemoryError(f"wna16_matmul could not allocate the gathered activations of {x.shape[0]} rows")
        if failed:
            raise ValueError(f"wna16_matmul refused {layout.bits}-bit weights")
        return y

    def _tiles_into(self, x: torch.Tensor, layout: CpuLayout, y: torch.Tensor) -> None:
        """y (bfloat16, unit column stride) = bfloat16 x @ W^T on linear_bf16, the weight dequantized (about
        DENSE_TILE_BYTES at a time) into its packed layout, each weight rounded to bfloat16 once; one C call
        (wna16_tiles_product) writes y's columns in place."""
        in_features, panel = layout.in_features, LinearBF16.PANEL
        if in_features % 2 or layout.out_features % panel:
            raise ValueError(f"linear_bf16 takes an even in_features and out_features a multiple of {panel}, not "
                             f"{in_features}, {layout.out_features}")
        rows = x if x.is_contiguous() else x.contiguous()
        run_tiles_product(self._tiles, self._tiles_layer(layout), rows, in_features, layout.out_features, y,
                          f"{layout.bits}-bit weights of {in_features} inputs")

    def _tiles_layer(self, layout: CpuLayout) -> Wna16StackLayer:
        """`layout` with this library's tiles, made once (the C call reads it by address)."""
        layer = layout.tiles_layers.get(id(self.library))
        if layer is None:
            layer = layout.tiles_layers[id(self.library)] = Wna16StackLayer.on_tiles(self, layout)
        return layer

    def tiles_from_packed(self, layout: CpuLayout) -> bool:
        """Whether bfloat16 rows go from the packed path straight to the tiles (no dense path between them): what
        the decode stack's product (wna16_stack_product) computes too."""
        return self._tiles_take(layout) and \
            self.packed_below(layout, torch.bfloat16) == self.bf16_tile_min_rows[layout.bits]

    def _tiles_take(self, layout: CpuLayout) -> bool:
        """Whether linear_bf16 can multiply bfloat16 rows by this weight."""
        return self._linear_bf16 is not None and layout.in_features % 2 == 0 and \
            layout.out_features % LinearBF16.PANEL == 0

    def packed_below(self, layout: CpuLayout, dtype: torch.dtype, tile_min_rows: int | None = None) -> int:
        """Rows of x (of `dtype`) below which `matmul` takes the packed path; for bfloat16 rows with the tiles'
        threshold `tile_min_rows` in place of bf16_tile_min_rows where given."""
        dense = self.dense_min_rows[layout.bits]
        if dtype is torch.bfloat16 and self._tiles_take(layout):
            return min(dense, tile_min_rows or self.bf16_tile_min_rows[layout.bits])
        return dense

    def prepared(self, layout: CpuLayout, tile_min_rows: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """x [rows, in_features] -> x @ W^T in x's dtype, as `product` computes it (with `tile_min_rows`), with the
        checks made once: rows that go to the packed path (decode steps) go straight to the kernel."""
        args, call = layout.kernel_args, self._matmul
        in_features, out_features = layout.in_features, layout.out_features
        packed_below = {dtype: self.packed_below(layout, dtype, tile_min_rows)
                        for dtype in (torch.float32, torch.bfloat16)}

        def product(x: torch.Tensor) -> torch.Tensor:
            rows, dtype = x.shape[0], x.dtype
            if x.dim() != 2 or x.shape[1] != in_features or rows >= packed_below.get(dtype, 0) or x.stride(1) != 1:
                y = self.product(x.reshape(-1, x.shape[-1]), layout, tile_min_rows=tile_min_rows).to(dtype)
                return y.view(*x.shape[:-1], out_features)
            y = torch.empty(rows, out_features, dtype=dtype)
            bf16 = dtype is torch.bfloat16
            if call(*args, out_features, x.data_ptr(), bf16, rows, x.stride(0), y.data_ptr(), bf16, out_features, None):
                raise MemoryError(f"wna16_matmul could not allocate the gathered activations of {rows} rows")
            return y

        return product

    def matmul_bf16_tiles(self, x: torch.Tensor, layout: CpuLayout, out: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
        """`matmul` for bfloat16 x on linear_bf16, the weight dequantized (about DENSE_TILE_BYTES at a time) into
        its packed layout, each weight rounded to bfloat16 once; the bfloat16 products are widened into the
        float32 output. in_features even, out_features a multiple of 16."""
        x, y, bias = _operands(x, layout, out, bias)
        if x.dtype is not torch.bfloat16:
            raise ValueError(f"linear_bf16 takes bfloat16 rows, not {x.dtype}")
        products = torch.empty(y.shape, dtype=torch.bfloat16)
        self._tiles_into(x, layout, products)
        y.copy_(products)
        if bias is not None:
            y += bias
        return y

    def matmul_packed(self, x: torch.Tensor, layout: CpuLayout, out: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """`matmul` straight from the packed weights, whatever the row count."""
        x, y, bias = _operands(x, layout, out, bias)
        return self._packed_into(x, layout, y, bias)

    def matmul_dense(self, x: torch.Tensor, layout: CpuLayout, out: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        """`matmul` as torch's GEMM on tiles of W^T dequantized in turn (about DENSE_TILE_BYTES each)."""
        x, y, bias = _operands(x, layout, out, bias)
        operand = x.float()
        in_features = layout.in_features
        tile_columns = max(1, DENSE_TILE_BYTES // (4 * in_features) // BLOCK_COLUMNS) * BLOCK_COLUMNS
        tile = self._tile(min(tile_columns, layout.out_features) * in_features)
        for first in range(0, layout.out_features, tile_columns):
            n = min(tile_columns, layout.out_features - first)
            dense = self.dequantize_t_into(layout, first, tile[: in_features * n].view(in_features, n))
            target = y[:, first : first + n]
            if bias is None:
                torch.mm(operand, dense, out=target)
            else:
                torch.addmm(bias[first : first + n], operand, dense, out=target)
        return y

    def dequantize_t_into(self, layout: CpuLayout, first: int, out: torch.Tensor) -> torch.Tensor:
        """Columns first .. first + n of W^T (output features; first a multiple of BLOCK_COLUMNS) into out,
        float32 [in_features, n] with unit column stride."""
        if out.dtype != torch.float32 or out.stride(1) != 1 or out.shape[0] != layout.in_features:
            raise ValueError(f"out must be float32 [{layout.in_features}, n] with unit column stride")
        if first % BLOCK_COLUMNS or first < 0 or first + out.shape[1] > layout.out_features:
            raise IndexError(f"columns {first} .. {first + out.shape[1]} are not block-aligned within "
                             f"0 .. {layout.out_features}")
        failed = self._dequantize_t(*layout.kernel_args, first, out.shape[1], out.data_ptr(), out.stride(0))
        if failed:
            raise ValueError(f"wna16_dequantize_t refused {layout.bits}-bit weights (code {failed})")
        return out

    def dequantize(self, layout: CpuLayout) -> torch.Tensor:
        """The whole W [out_features, in_features] in float32."""
        return self.dequantize_t_into(layout, 0, torch.empty(layout.in_features, layout.out_features)).t().contiguous()

    @staticmethod
    def _tile(elements: int) -> torch.Tensor:
        return thread_scratch("wna16", "tile", elements, torch.float32)


class _Wna16Weight(ctypes.Structure):
    """csrc/wna16.c's Wna16Weight: one weight's leading arguments of wna16_matmul."""

    _fields_ = [("packed", ctypes.c_void_p), ("gparams", ctypes.c_void_p), ("group_rows", ctypes.c_void_p),
                ("src", ctypes.c_void_p), ("n_groups", ctypes.c_int64), ("k_rows", ctypes.c_int64)]

    @classmethod
    def of(cls, layout: CpuLayout) -> _Wna16Weight:
        return cls(layout.packed.data_ptr(), layout.gparams.data_ptr(), layout.group_rows.data_ptr(),
                   layout.src.data_ptr() if layout.src is not None else None, layout.num_groups, layout.k_rows)


class Wna16StackLayer(ctypes.Structure):
    """csrc/wna16.c's Wna16StackLayer: one weight as the decode stack's product (wna16_stack_product) reads it,
    bfloat16 rows going to linear_bf16's tiles where and from where `WNA16Kernels.product` sends them."""

    _fields_ = [("weight", _Wna16Weight), ("bits", ctypes.c_int64), ("tiles", BF16TilesStruct)]

    @classmethod
    def of(cls, kernels: WNA16Kernels, layout: CpuLayout) -> Wna16StackLayer:
        if not kernels.tiles_from_packed(layout):
            return cls(_Wna16Weight.of(layout), layout.bits, BF16TilesStruct.of(None))
        return cls.on_tiles(kernels, layout)

    @classmethod
    def on_tiles(cls, kernels: WNA16Kernels, layout: CpuLayout) -> Wna16StackLayer:
        """The weight with its bfloat16 tiles (from the rows where `WNA16Kernels.product` takes them)."""
        return cls(_Wna16Weight.of(layout), layout.bits,
                   BF16TilesStruct.of(kernels._linear_bf16, kernels.bf16_tile_min_rows[layout.bits],
                                      _tile_columns(layout.in_features)))


class ExpertsPackedProduct:
    """One projection of a mixture-of-experts layer's experts (their CpuLayouts, one shape) on the packed path,
    each expert over its own rows, in one wna16_matmul_experts call per step: what `expert_products` compute expert
    by expert, with one call, one scratch and one fork of the threads for all of them. The experts take the tiles
    from EXPERTS_BF16_TILE_MIN_ROWS rows an expert at the earliest."""

    def __init__(self, kernels: WNA16Kernels, layouts: list[CpuLayout]) -> None:
        first = layouts[0]
        if any((layout.bits, layout.in_features, layout.out_features) !=
               (first.bits, first.in_features, first.out_features) for layout in layouts):
            raise ValueError("the experts of one projection differ in shape or bits")
        self.layouts = layouts  # the table below points into their tensors
        self.bits, self.out_features = first.bits, first.out_features
        self.table = (_Wna16Weight * len(layouts))(*[_Wna16Weight.of(layout) for layout in layouts])
        self.call = kernels._matmul_experts
        self.kernels = kernels
        self.tile_min_rows = max(EXPERTS_BF16_TILE_MIN_ROWS, kernels.bf16_tile_min_rows[first.bits])
        self.packed_below = {dtype: min(kernels.packed_below(layout, dtype, self.tile_min_rows) for layout in layouts)
                             for dtype in (torch.float32, torch.bfloat16)}

    def expert_products(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """Each expert's own product, for the steps the one call does not take: `prepared` with the experts'
        tiles threshold, so that a step's result does not depend on which of the two ran it."""
        return [self.kernels.prepared(layout, self.tile_min_rows) for layout in self.layouts]

    def takes(self, sizes: list[int], dtype: torch.dtype) -> bool:
        """Whether every expert's rows are few enough for the packed path (as `expert_products` send them)."""
        return max(sizes) < self.packed_below.get(dtype, 0)

    def __call__(self, experts: list[int], sizes: list[int], x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows of expert i] = x[the same rows] @ W_{experts[i]}^T, rows in the order of `experts`; x and out
        float32 or bfloat16, rows contiguous."""
        ids, counts = cpu_build.expert_arrays(experts, sizes)
        failed = self.call(self.table, self.bits, self.out_features, ids, counts, len(experts), x.data_ptr(),
                           x.dtype is torch.bfloat16, x.stride(0), out.data_ptr(), out.dtype is torch.bfloat16,
                           out.stride(0))
        if failed:
            raise MemoryError(f"wna16_matmul_experts could not allocate the gathered activations of {sum(sizes)} rows")


def _tile_columns(in_features: int) -> int:
    """Columns of a weight of `in_features` inputs per bfloat16 tile for linear_bf16 (about DENSE_TILE_BYTES)."""
    return max(1, DENSE_TILE_BYTES // (2 * in_features) // BLOCK_COLUMNS) * BLOCK_COLUMNS


def _operands(x: torch.Tensor, layout: CpuLayout, out: torch.Tensor | None, bias: torch.Tensor | None):
    """x as the kernel reads it (float32 or bfloat16, unit column stride), the float32 output, the float32 bias.
    Called per product (~100 per decode step): the common case is a few attribute reads."""
    shape = x.shape
    if len(shape) != 2 or shape[1] != layout.in_features:
        raise ValueError(f"x is {tuple(shape)}; this weight takes [rows, {layout.in_features}]")
    if x.dtype is not torch.float32 and x.dtype is not torch.bfloat16:
        x = x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(shape[0], layout.out_features)
    elif out.dtype != torch.float32 or out.shape != (shape[0], layout.out_features) or out.stride(1) != 1:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)}; this product writes float32 "
                         f"[{shape[0]}, {layout.out_features}] with unit column stride")
    if bias is not None:
        if bias.shape != (layout.out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({layout.out_features},)")
        if bias.dtype is not torch.float32 or not bias.is_contiguous():
            bias = bias.to(torch.float32).contiguous()
    return x, out, bias


@functools.cache
def _library(isa: str) -> ctypes.CDLL | None:
    try:
        path = cpu_build.build_library(f"pagellm_wna16_{isa}", _SOURCES, _HEADERS, cpu_build.compiler_flags(isa))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as error:
        detail = (getattr(error, "stderr", None) or str(error)).strip()
        logger.warning("AWQ/GPTQ CPU kernels unavailable (%s); those layers run dequantized per call in torch",
                       detail.splitlines()[0] if detail else type(error).__name__)
        return None


def wna16_kernels(isa: str | None = None) -> WNA16Kernels | None:
    """The kernels built for `isa` (default: cpu_build.best_isa(), which honours PAGELLM_CPU_ISA), or None where
    there is no compiler or PAGELLM_NATIVE_KERNELS=0."""
    if os.environ.get("PAGELLM_NATIVE_KERNELS", "1") == "0":
        return None
    library = _library(isa or cpu_build.best_isa())
    return WNA16Kernels(library) if library is not None else None


# ---- a layer's product, per device ------------------------------------------------------------------------------

# A layer's weight as column ranges: (first output feature, weight of the following columns). One part, except
# where a fused layer's shards were quantized with different input orders (GPTQ desc_act g_idx per shard).
Parts = list[tuple[int, GroupQuantWeight]]


class GroupQuantKernel(ABC):
    """x @ W^T + bias for one layer, in whatever layout the kernel keeps its parts."""

    name = "torch"

    def __init__(self, out_features: int) -> None:
        self.out_features = out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            y = self._matmul(x, bias)
        else:
            y = self._matmul(x.reshape(-1, x.shape[-1]), bias).view(*x.shape[:-1], self.out_features)
        return y if y.dtype is x.dtype else y.to(x.dtype)

    @abstractmethod
    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in_features] @ W^T + bias."""

    def prepared_product(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """x [rows, in_features] -> self(x, None), made once at load where the kernel has a faster way to call it;
        else None."""
        return None

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors the kernel keeps (counted in the weights' bytes)."""


class TorchGroupQuant(GroupQuantKernel):
    """Dequantize each part per call and multiply with F.linear in float32 (the weights stay packed)."""

    def __init__(self, parts: Parts) -> None:
        super().__init__(sum(part.out_features for _, part in parts))
        self.parts = parts

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        pieces = [F.linear(x.float(), dequantize(part)) for _, part in self.parts]
        y = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        return y if bias is None else y + bias.float()

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, part in self.parts for t in part.tensors()]


class CpuGroupQuant(GroupQuantKernel):
    """csrc/wna16.c on each part's CpuLayout."""

    name = "cpu"

    def __init__(self, parts: Parts, kernels: WNA16Kernels) -> None:
        super().__init__(sum(part.out_features for _, part in parts))
        self.kernels = kernels
        self.layouts: list[tuple[int, CpuLayout]] = [(first, cpu_layout(part)) for first, part in parts]
        self.name = f"cpu-{kernels.isa}"

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if len(self.layouts) == 1:
            return self.kernels.product(x, self.layouts[0][1], bias=bias)
        dtype = torch.bfloat16 if x.dtype is torch.bfloat16 else torch.float32
        y = torch.empty(x.shape[0], self.out_features, dtype=dtype, device=x.device)
        for first, layout in self.layouts:
            columns = slice(first, first + layout.out_features)
            self.kernels.product(x, layout, y[:, columns], bias[columns] if bias is not None else None)
        return y

    def prepared_product(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.kernels.prepared(self.layouts[0][1]) if len(self.layouts) == 1 else None

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, layout in self.layouts for t in layout.tensors()]


class TritonGroupQuant(GroupQuantKernel):
    """pagellm/ops/triton_quant.py's kernel on each part (CUDA)."""

    name = "triton"

    def __init__(self, parts: Parts) -> None:
        super().__init__(sum(part.out_features for _, part in parts))
        self.parts = parts

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from pagellm.ops.triton_quant import group_quant_matmul

        if len(self.parts) == 1:
            return group_quant_matmul(x, self.parts[0][1], bias=bias)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for first, part in self.parts:
            columns = slice(first, first + part.out_features)
            y[:, columns] = group_quant_matmul(x, part, bias=bias[columns] if bias is not None else None)
        return y

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, part in self.parts for t in part.tensors()]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_kernel(parts: Parts, device: torch.device) -> GroupQuantKernel:
    """The product for a layer's parts on `device` (see the module docstring)."""
    if device.type == "cpu":
        kernels = wna16_kernels()
        if kernels is not None:
            return CpuGroupQuant(parts, kernels)
    elif device.type == "cuda" and triton_available():
        return TritonGroupQuant(parts)
    return TorchGroupQuant(parts)
