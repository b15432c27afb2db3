"""bfloat16 linear layers on the CPU (csrc/linear_bf16.c): avx512_bf16's dot product on a weight packed for
it, and AMX's tiles for calls of many rows where the CPU has them, from the library cpu_build.py builds."""

from __future__ import annotations

import ctypes

import torch

from pagellm.ops.cpu_build import NEVER_ROWS, amx_bf16_ready, library_isa, native_library

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# bfloat16 inputs per row of an AMX tile: the tiles take in_features that are a multiple of it (csrc/linear_bf16.c).
AMX_K = 32


class LinearBF16:
    """linear_bf16 (see linear_bf16.c): bfloat16 linear layers on a weight packed for it, where the library was
    built with avx512_bf16's dot product; `available(library)` says whether it was. Where it was also built with
    AMX's tiles and the OS grants them, calls of `amx_min_rows` rows or more run on the tiles (`amx` says so)."""

    PANEL = 16
    # From this many rows the tiles beat the vector path, over 30 layers of SmolLM2's shapes streamed from memory
    # (README, "On a CPU with AMX").
    AMX_MIN_ROWS = 8

    @staticmethod
    def available(library: ctypes.CDLL) -> bool:
        return bool(ctypes.c_int.in_dll(library, "pagellm_linear_bf16_available").value)

    @classmethod
    def supports(cls, in_features: int, out_features: int) -> bool:
        return in_features % 2 == 0 and out_features % cls.PANEL == 0 and in_features > 0 and out_features > 0

    def __init__(self, library: ctypes.CDLL) -> None:
        if not self.available(library):
            raise ValueError(f"the {library_isa(library)} kernels were built without avx512_bf16's dot product")
        self.isa = library_isa(library)
        self.library = library  # for the decode stack's product pointer (pagellm/ops/decode_stack.py)
        self._function = library.linear_bf16
        self._function.restype = _INT
        self._function.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
        self._strided = library.linear_bf16_strided
        self._strided.restype = _INT
        self._strided.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64]
        self.amx = amx_bf16_ready(library)
        self.amx_min_rows = self.AMX_MIN_ROWS if self.amx else NEVER_ROWS

    @classmethod
    def pack(cls, weight: torch.Tensor) -> torch.Tensor:
        """[out, in] bfloat16 -> [out / 16, in / 2, 16, 2]: one 64-byte vector per 16 outputs and input pair."""
        out_features, in_features = weight.shape
        if weight.dtype != torch.bfloat16 or not cls.supports(in_features, out_features):
            raise ValueError(f"linear_bf16 packs bfloat16 weights with an even in_features and out_features a "
                             f"multiple of {cls.PANEL}, not {weight.dtype} {tuple(weight.shape)}")
        return weight.view(out_features // cls.PANEL, cls.PANEL, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] bfloat16 -> [..., out] bfloat16."""
        panels, pairs, _, _ = packed.shape
        in_features, out_features = 2 * pairs, panels * self.PANEL
        if x.dtype != torch.bfloat16 or x.shape[-1] != in_features:
            raise ValueError(f"x is {x.dtype} {tuple(x.shape)}; this layer takes bfloat16 [..., {in_features}]")
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)):
            raise ValueError(f"bias is {bias.dtype} {tuple(bias.shape)}; this layer takes bfloat16 [{out_features}]")
        # A decode step makes ~120 of these calls: the usual 2-D contiguous input takes no reshape or copy.
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()
        y = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        if self._function(rows.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None,
                          y.data_ptr(), rows.shape[0], in_features, out_features, self.amx_min_rows):
            raise ValueError(f"linear_bf16 refused in_features={in_features}, out_features={out_features}")
        return y if rows is x else y.view(*x.shape[:-1], out_features)

    def into(self, rows: torch.Tensor, packed: torch.Tensor, y: torch.Tensor) -> None:
        """y = rows @ W^T, no bias, where y is [rows, out] bfloat16 whose rows may lie further apart than `out` (a
        block of columns of a wider output, which the product then writes in place); rows is contiguous
        [rows, in] bfloat16."""
        panels, pairs, _, _ = packed.shape
        in_features, out_features = 2 * pairs, panels * self.PANEL
        if rows.dtype != torch.bfloat16 or rows.dim() != 2 or rows.shape[1] != in_features or not rows.is_contiguous():
            raise ValueError(f"rows are {rows.dtype} {tuple(rows.shape)}; this product takes contiguous bfloat16 "
                             f"[n, {in_features}]")
        if y.dtype != torch.bfloat16 or y.shape != (rows.shape[0], out_features) or y.stride(1) != 1:
            raise ValueError(f"y is {y.dtype} {tuple(y.shape)} with strides {y.stride()}; this product writes "
                             f"bfloat16 [{rows.shape[0]}, {out_features}] with unit column stride")
        if self._strided(rows.data_ptr(), packed.data_ptr(), None, y.data_ptr(), y.stride(0), rows.shape[0],
                         in_features, out_features, self.amx_min_rows):
            raise ValueError(f"linear_bf16 refused in_features={in_features}, out_features={out_features}, "
                             f"row stride {y.stride(0)}")


class BF16TilesStruct(ctypes.Structure):
    """csrc/bf16_tiles.h's BF16Tiles: where a decode-stack layer whose weight is dequantized per call (AWQ/GPTQ,
    fp8) sends bfloat16 rows to `kernel` (linear_bf16_strided, by address): from `min_rows` rows, `columns`
    columns of the weight at a time."""

    _fields_ = [("linear", _PTR), ("min_rows", _I64), ("columns", _I64), ("amx_min_rows", _I64)]

    @classmethod
    def of(cls, kernel: LinearBF16 | None, min_rows: int = NEVER_ROWS, columns: int = 0) -> BF16TilesStruct:
        """kernel None: never."""
        if kernel is None:
            return cls(None, NEVER_ROWS, 0, NEVER_ROWS)
        return cls(ctypes.cast(kernel.library.linear_bf16_strided, _PTR).value, min_rows, columns,
                   kernel.amx_min_rows)


def tiles_product_function(library: ctypes.CDLL, name: str):
    """A library's tiles product (wna16_tiles_product, w8a8_fp8_tiles_product, gguf_tiles_product: csrc/bf16_tiles.h's
    loop over one weight's tiles, for the layers' own products) with its argument types declared."""
    function = getattr(library, name)
    function.restype = ctypes.c_int
    function.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _PTR, _I64]
    return function


def run_tiles_product(function, layer: ctypes.Structure, rows: torch.Tensor, in_features: int, columns: int,
                      y: torch.Tensor, what: str) -> None:
    """y[:, :columns] (bfloat16, rows y.stride(0) apart) = contiguous bfloat16 rows @ W^T through `function`
    (tiles_product_function's) on the weight `layer` describes; `what` names the weight in a refusal."""
    failed = function(ctypes.addressof(layer), rows.data_ptr(), rows.shape[0], in_features, columns, y.data_ptr(),
                      y.stride(0))
    if failed == 1:
        raise MemoryError(f"{function.__name__} could not allocate its tile")
    if failed:
        raise ValueError(f"{function.__name__} refused {what}")


def linear_bf16(isa: str | None = None) -> LinearBF16 | None:
    """The bfloat16 linear kernel, or None where the library for `isa` has none (no avx512_bf16, no compiler)."""
    library = native_library(isa)
    return LinearBF16(library) if library is not None and LinearBF16.available(library) else None
