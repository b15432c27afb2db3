"""A GGUF, bfloat16, int8 W8A8, fp8 or AWQ/GPTQ Llama's decode step as one C call for all its decoder layers, a Gemma
3's as one per layer (ops/csrc/decode_stack.c).

models/llama.py's direct path already runs each layer as its bare kernel calls, but each of those ~10 calls per
layer still pays for its Python: argument checks, a fresh output tensor, the ctypes call. For a small model a
decode step's kernels are short (tens of microseconds), so that host work was a third of the step. Here the same
kernels run in the same order from C, so the result is the layers' bit for bit; this module checks once per step
that the step is one the C loop serves, and otherwise leaves it to the direct path or the modules:

- every layer's linear layers are GGUF products (ops/gguf_kernels.py's PreparedProduct, one library; up to
  three parts each); or every one is a bfloat16 layer on pagellm's own kernel (ops/dense_linear.py's
  NativeBF16Packed, linear_bf16.c), or every one an int8 W8A8 layer (ops/w8a8_kernels.py's NativeInt8Linear,
  w8a8.c), which take any row count; or every one an fp8 layer (NativeFp8Linear), or every one a group-quantized
  layer (AWQ, GPTQ, compressed-tensors W4A16/W8A16, online rtn / int8 weight-only on ops/wna16.py's CpuGroupQuant,
  up to three parts each). The GGUF, fp8 and group-quantized products switch to dequantized tiles past some rows:
  bfloat16 rows go on to linear_bf16 on those tiles in C too (where the direct path runs them there: AMX's tiles
  for GGUF, avx512_bf16 for the others), other steps only below the switch;
- the step is decode tokens only, on the CPU attention backend with its native decode kernel and K/V writer;
- the caches are float32/bfloat16 in the activations' dtype, or a quantized format the kernels read.

Gemma 3 (GemmaDecodeStack) runs each layer's modules' kernel calls from C too, between its GELU: the gated
activation stays torch's (its tanh rounds as torch's own vectorised code does), one call between two C calls;
in float32 or bfloat16 (its norms on gemma_rms_norm, as its modules run them).

PAGELLM_DECODE_STACK=0 turns it off (for A/B measurements and for benchmarks that time the per-layer calls).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from pagellm.attention.native import DecodeKernel, KVWriter, _cache_geometry
from pagellm.attention.paged import AttentionMetadata, TorchAttentionBackend
from pagellm.layers.quantization.experts_int8 import OnlineGroupQuantMethod
from pagellm.layers.quantization.group_quant import GroupQuantLinearMethod
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import (Fp8LinearMethod, Int8LinearMethod, OnlineFp8LinearMethod,
                                              OnlineInt8LinearMethod)
from pagellm.layers.rotary import RopeInputs
from pagellm.ops.cpu_build import KERNEL_DTYPES, NEVER_ROWS
from pagellm.ops.cpu_ops import CpuOps
from pagellm.ops.dense_linear import NativeBF16Packed
from pagellm.ops.gguf_kernels import GgufStackLayer, PreparedProduct
from pagellm.ops.linear_bf16 import LinearBF16
from pagellm.ops.w8a8_kernels import Fp8StackLayer, Int8WeightStruct, NativeFp8Linear, NativeInt8Linear
from pagellm.ops.wna16 import CpuGroupQuant, CpuLayout, WNA16Kernels, Wna16StackLayer

ENV = "PAGELLM_DECODE_STACK"
# decode_stack.c's failure codes.
_MEMORY, _PRODUCT, _ATTENTION = 1, 10, 20


def _writes_unquantized(cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether decode_stack.c's write_kv puts activations of `dtype` into an unquantized cache of `cache_dtype`:
    a copy in their own dtype, or float32 rounded into a bfloat16 cache (kv_cache_dtype="bfloat16")."""
    return cache_dtype is dtype or (cache_dtype is torch.bfloat16 and dtype is torch.float32)


class _StackShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "block_size")] + [
        ("kv_format", ctypes.c_int32), ("bf16", ctypes.c_int32)]


_MAX_PARTS = 3


class _StackLinear(ctypes.Structure):
    _fields_ = [("weights", ctypes.c_void_p * _MAX_PARTS), ("out_features", ctypes.c_int64 * _MAX_PARTS),
                ("types", ctypes.c_int32 * _MAX_PARTS), ("parts", ctypes.c_int32)]


class _StackLayer(ctypes.Structure):
    _fields_ = [(name, _StackLinear) for name in ("qkv", "o", "gate_up", "down")] + [
        (name, ctypes.c_void_p) for name in ("input_norm", "post_norm", "k_cache", "v_cache")] + [
        ("sliding_window", ctypes.c_int64), ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
        ("scale", ctypes.c_float)]


class _GemmaLayer(ctypes.Structure):
    _fields_ = [(name, _StackLinear) for name in ("qkv", "o", "gate_up", "down")] + [
        (name, ctypes.c_void_p) for name in ("input_norm", "post_attention_norm", "pre_feedforward_norm",
                                             "post_feedforward_norm", "q_norm", "k_norm", "cos", "sin", "k_cache",
                                             "v_cache")] + [
        ("sliding_window", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _StackStep(ctypes.Structure):
    _fields_ = [("positions", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("kv_rows", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("context_lens", ctypes.c_void_p),
                ("tokens", ctypes.c_int64), ("table_stride", ctypes.c_int64)]


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@dataclass(frozen=True)
class _OnePart:
    """A linear layer the C loop runs as one product at any row count, through a library's adapter with
    gguf_matmul's signature (`function`, whose name its failures carry)."""

    kernels: ctypes.CDLL
    function: object
    in_features: int
    out_features: int

    def int8_max_rows(self, dtype: torch.dtype) -> int | None:
        return None  # one kernel at every row count


@dataclass(frozen=True)
class DenseBF16Part(_OnePart):
    """A bfloat16 linear layer on linear_bf16 (NativeBF16Packed): linear_bf16_stack_product, its `type` carrying
    the layer's amx_min_rows."""

    weight_address: int = 0
    type_id: int = 0
    product_name: ClassVar[str] = "linear_bf16"

    @classmethod
    def of(cls, dense: NativeBF16Packed) -> DenseBF16Part:
        library = dense.kernel.library
        out_features, in_features = dense.packed.shape[0] * LinearBF16.PANEL, dense.packed.shape[1] * 2
        return cls(library, library.linear_bf16_stack_product, in_features, out_features, dense.packed.data_ptr(),
                   min(dense.kernel.amx_min_rows, _INT32_MAX))


@dataclass(frozen=True)
class _StructPart(_OnePart):
    """A layer whose product function reads its weight's pointers from a struct `weight_address` points at (held
    here), below `rows_below` rows of float32 / of bfloat16 activations (where the layer's own product switches
    to another kernel; None: at any row count)."""

    struct: ctypes.Structure | None = None
    rows_below: tuple[int, int] | None = None
    type_id: int = 0

    def int8_max_rows(self, dtype: torch.dtype) -> int | None:
        below = None if self.rows_below is None else self.rows_below[dtype is torch.bfloat16]
        return None if below is None or below >= NEVER_ROWS else below - 1

    @property
    def weight_address(self) -> int:
        return ctypes.addressof(self.struct)


@dataclass(frozen=True)
class Int8Part(_StructPart):
    """An int8 W8A8 layer (NativeInt8Linear: a checkpoint's or quantization="int8"'s): w8a8_stack_product, at any
    row count."""

    product_name: ClassVar[str] = "w8a8_int8_linear"

    @classmethod
    def of(cls, linear: NativeInt8Linear) -> Int8Part:
        library = linear.kernels.library
        return cls(library, library.w8a8_stack_product, linear.in_features, linear.out_features,
                   Int8WeightStruct.of(linear))


@dataclass(frozen=True)
class Fp8Part(_StructPart):
    """An fp8 layer (NativeFp8Linear: a checkpoint's or quantization="fp8"'s): w8a8_fp8_stack_product, the fused
    kernel its product runs below the rows where it switches to dequantized tiles (per activation dtype, as
    W8A8Kernels.fp8_linear switches), and for bfloat16 rows where linear_bf16 takes the weight, both at every
    row count."""

    product_name: ClassVar[str] = "w8a8_fp8_linear"

    @classmethod
    def of(cls, linear: NativeFp8Linear) -> Fp8Part:
        kernels = linear.kernels
        bf16_below = NEVER_ROWS if kernels.fp8_stack_tiles_take(linear.packed) else kernels.fp8_bf16_dense_min_rows
        return cls(kernels.library, kernels.library.w8a8_fp8_stack_product, linear.in_features, linear.out_features,
                   Fp8StackLayer.of(linear), (kernels.fp8_dense_min_rows, bf16_below))


@dataclass(frozen=True)
class GroupQuantPart(_StructPart):
    """One part of an AWQ / GPTQ / compressed-tensors group-quantized layer (a CpuLayout of its CpuGroupQuant):
    wna16_stack_product, the packed path its product runs below the rows where it switches to dequantized tiles
    in float32 (torch's GEMM), and for bfloat16 rows where linear_bf16 takes them, both paths at every row count
    (per activation dtype, as WNA16Kernels.product switches)."""

    product_name: ClassVar[str] = "wna16_matmul"

    @classmethod
    def of(cls, kernels: WNA16Kernels, layout: CpuLayout) -> GroupQuantPart:
        bf16_below = NEVER_ROWS if kernels.tiles_from_packed(layout) else kernels.packed_below(layout, torch.bfloat16)
        return cls(kernels.library, kernels.library.wna16_stack_product, layout.in_features, layout.out_features,
                   Wna16StackLayer.of(kernels, layout), (kernels.packed_below(layout, torch.float32), bf16_below))


@dataclass(frozen=True)
class GgufPart(_StructPart):
    """One GGUF part of a layer (a PreparedProduct of its gguf_products): gguf_stack_product, gguf_matmul's int8
    products below the rows where its product switches to the dense path, and for bfloat16 rows where that path
    runs on AMX's tiles (GGUFKernels.amx_dense_takes), both at every row count."""

    product_name: ClassVar[str] = "gguf_matmul"

    @classmethod
    def of(cls, product: PreparedProduct) -> GgufPart:
        kernels, name = product.kernels, product.type_name
        amx = kernels.amx_dense_takes(name, product.out_features, product.in_features)
        f32_below, bf16_below = (NEVER_ROWS if (rows := kernels.dense_threshold(name, dtype)) is None else rows
                                 for dtype in (torch.float32, torch.bfloat16))
        return cls(kernels.library, kernels.library.gguf_stack_product, product.in_features, product.out_features,
                   GgufStackLayer.of(product), (f32_below, NEVER_ROWS if amx else bf16_below), product.type_id)


_INT32_MAX = 2**31 - 1
StackProduct = GgufPart | DenseBF16Part | Int8Part | Fp8Part | GroupQuantPart


def _same_kernels(products: list[StackProduct]) -> bool:
    """Whether every product is of one library and kind (the C loop calls one product function)."""
    return bool(products) and all(p.kernels is products[0].kernels and p.function is products[0].function
                                  for p in products)


def _int8_row_limit(products: list[StackProduct], dtype: torch.dtype) -> int | None:
    """The most rows of `dtype` every product takes in C (a product whose layer switches to a path the C loop does
    not run, torch's GEMM on dequantized tiles, limits them), or None for no limit."""
    limits = [limit for p in products if (limit := p.int8_max_rows(dtype)) is not None]
    return min(limits) if limits else None


class _Stack:
    """What both stacks check and pass per step: the step's shape, the attention metadata, the caches."""

    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    max_tokens: int | None
    _structs: ctypes.Array

    def _init_step(self, products: list[StackProduct], shape: _StackShape) -> None:
        self.max_tokens = _int8_row_limit(products, self.dtype)
        self._product = ctypes.cast(products[0].function, ctypes.c_void_p).value
        self._product_name = getattr(products[0], "product_name", "gguf_matmul")
        self._shape = shape
        self._step = _StackStep()
        self._failed = ctypes.c_int64(-1)
        # The structs' addresses, as every call passes them.
        self._shape_address, self._step_address, self._failed_address = (
            ctypes.addressof(x) for x in (self._shape, self._step, self._failed))
        self._structs_address = ctypes.addressof(self._structs)
        # The caches the structs point at, and their format: checked when the model runner's list changes.
        self._caches: list | None = None
        self._caches_format: object = None
        self._caches_ok = False

    def _serves_step(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                     meta: AttentionMetadata) -> bool:
        tokens = hidden.shape[0]
        if (hidden.dtype is not self.dtype or hidden.dim() != 2 or not hidden.is_contiguous()
                or (self.max_tokens is not None and tokens > self.max_tokens) or tokens == 0):
            return False
        backend = meta.backend
        if backend is not None and type(backend) is not TorchAttentionBackend:
            return False
        if (meta.num_decode_tokens != tokens or meta.prefill_chunks or meta.native_prefill is not None
                or meta.native_decode is None or type(meta.native_write) is not KVWriter or meta.decode is None):
            return False
        if positions.dtype is not torch.int64 or not positions.is_contiguous() or positions.numel() != tokens:
            return False
        rows = meta.kv_write_index
        if rows.dtype is not torch.int64 or not rows.is_contiguous() or rows.numel() != tokens * self.num_kv_heads:
            return False
        return self._check_caches(kv_caches, meta)

    def _check_caches(self, kv_caches: list, meta: AttentionMetadata) -> bool:
        if kv_caches is self._caches and meta.kv_format is self._caches_format:
            return self._caches_ok
        self._caches, self._caches_format, self._caches_ok = kv_caches, meta.kv_format, False
        if len(kv_caches) > len(self._structs):
            return False
        quantized = meta.kv_format is not None and meta.kv_format.quantized
        codes = set()
        for struct, (k_cache, v_cache) in zip(self._structs, kv_caches):
            try:
                code, kv_heads, block_size = _cache_geometry(k_cache, self.head_dim, meta.kv_format)
            except TypeError:
                return False
            if (v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or kv_heads != self.num_kv_heads
                    or not (k_cache.is_contiguous() and v_cache.is_contiguous())
                    or not (quantized or _writes_unquantized(k_cache.dtype, self.dtype))):
                return False
            codes.add((code, block_size))
            struct.k_cache, struct.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        if len(codes) != 1 or (meta.block_size and next(iter(codes))[1] != meta.block_size):
            return False
        self._shape.kv_format, self._shape.block_size = next(iter(codes))
        self._caches_ok = True
        return True

    def _fill_step(self, positions: torch.Tensor, meta: AttentionMetadata) -> list[np.ndarray]:
        """The step's struct; returns the arrays it points into, to be held until the call returns."""
        decode = meta.decode
        block_tables = np.ascontiguousarray(decode.block_tables, dtype=np.int64)
        context_lens = np.ascontiguousarray(decode.context_lens, dtype=np.int64)
        step = self._step
        step.positions = positions.data_ptr()
        step.kv_rows = meta.kv_write_index.data_ptr()
        step.block_tables, step.context_lens = block_tables.ctypes.data, context_lens.ctypes.data
        step.tokens, step.table_stride = positions.numel(), block_tables.shape[1]
        return [block_tables, context_lens]

    def _failure(self, code: int, tokens: int, layer: int) -> Exception:
        """The error of decode_stack.c's failure `code` in `layer` (which of its products failed, C does not say)."""
        if code == _MEMORY or code == _PRODUCT + 1:
            return MemoryError(f"layer {layer}: the decode stack could not allocate its buffers for {tokens} tokens")
        if code >= _ATTENTION:
            return RuntimeError(f"layer {layer}: the decode attention kernel failed (code {code - _ATTENTION}) on "
                                f"{tokens} tokens, head_dim={self.head_dim}")
        if self._product_name != "gguf_matmul":
            return ValueError(f"layer {layer}: {self._product_name} refused one of its products (code "
                              f"{code - _PRODUCT}: activations of another dtype, or a layer shape its packed layout "
                              f"cannot have)")
        return ValueError(f"layer {layer}: gguf_matmul refused one of its products (code {code - _PRODUCT}: a block "
                          f"type it does not know, or input features that are not whole blocks)")


def _linear_parts(linear, in_features: int, out_features: int) -> tuple[StackProduct, ...] | None:
    """The GGUF int8 products that make up `linear`'s forward (its parts' side by side, as GGUFLinearMethod.apply
    concatenates them), or its one bfloat16 product on linear_bf16, or its one int8 W8A8 or fp8 product, or a
    group-quantized layer's parts; None where its forward adds anything to them or computes otherwise."""
    if linear.bias is not None or linear.group.size != 1 or linear.lora is not None:
        return None
    method = type(linear.quant_method)
    if isinstance(linear.quant_method, (GroupQuantLinearMethod, OnlineGroupQuantMethod)):
        return _group_quant_parts(linear.quant_method.loaded_kernel(linear), in_features, out_features)
    eight_bit = (linear.quant_method.loaded_kernel(linear)
                 if issubclass(method, (Int8LinearMethod, OnlineInt8LinearMethod, Fp8LinearMethod,
                                        OnlineFp8LinearMethod))
                 else None)
    dense = getattr(linear, "dense_kernel", None)
    part: _OnePart | None = None
    if eight_bit is not None:
        if type(eight_bit) is NativeInt8Linear:
            part = Int8Part.of(eight_bit)
        elif type(eight_bit) is NativeFp8Linear:
            part = Fp8Part.of(eight_bit)
    elif dense is not None:
        if (type(dense) is NativeBF16Packed and getattr(linear, "gguf_products", None) is None
                and type(linear.quant_method) is UnquantizedLinearMethod):
            part = DenseBF16Part.of(dense)
    else:
        return _gguf_parts(linear, in_features, out_features)
    if part is None or (part.in_features, part.out_features) != (in_features, out_features):
        return None
    return (part,)


def _group_quant_parts(kernel, in_features: int, out_features: int) -> tuple[GroupQuantPart, ...] | None:
    """A group-quantized layer's layouts side by side (the order and columns CpuGroupQuant computes them in), or
    None for another kernel (torch's, Triton's) or more parts than the C loop takes."""
    if type(kernel) is not CpuGroupQuant or not 0 < len(kernel.layouts) <= _MAX_PARTS:
        return None
    column = 0
    for first, layout in kernel.layouts:
        if first != column or layout.in_features != in_features:
            return None
        column += layout.out_features
    if column != out_features:
        return None
    return tuple(GroupQuantPart.of(kernel.kernels, layout) for _, layout in kernel.layouts)


def _gguf_parts(linear, in_features: int, out_features: int) -> tuple[GgufPart, ...] | None:
    """`linear`'s GGUF products, or None (see _linear_parts)."""
    parts = getattr(linear, "gguf_products", None)
    if (parts is None or not 0 < len(parts) <= _MAX_PARTS
            or getattr(linear.quant_method, "ops", None) is not parts[0].kernels
            or any(type(p) is not PreparedProduct or p.in_features != in_features for p in parts)
            or sum(p.out_features for p in parts) != out_features):
        return None
    return tuple(GgufPart.of(p) for p in parts)


def _set_linear(struct: _StackLinear, parts: tuple[StackProduct, ...]) -> None:
    struct.parts = len(parts)
    for i, part in enumerate(parts):
        struct.weights[i], struct.out_features[i], struct.types[i] = (part.weight_address, part.out_features,
                                                                      part.type_id)


def _layer_linears(layers: list, hidden: int, intermediate: int) -> list[list[tuple[StackProduct, ...]]] | None:
    """Each layer's (qkv, o, gate_up, down) parts, or None where a layer's differ from the first's heads and sizes
    or one is not a product the C loop runs (_linear_parts)."""
    attn = layers[0].self_attn
    heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    wanted = ((hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden), (hidden, 2 * intermediate),
              (intermediate, hidden))
    linears = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (heads, kv_heads, head_dim):
            return None
        row = [_linear_parts(linear, *sizes)
               for linear, sizes in zip((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj), wanted)]
        if any(parts is None for parts in row):
            return None
        linears.append(row)
    return linears


class DecodeStack(_Stack):
    """A Llama model's decode steps in one call (see the module's docstring). Made by `build`, which returns None
    for layers the C loop cannot run; `serves` says whether it runs a given step."""

    def __init__(self, layers: list, ops: CpuOps, linears: list[list[tuple[StackProduct, ...]]],
                 hidden_size: int, intermediate_size: int) -> None:
        attn = layers[0].self_attn
        self.layers = layers  # held: the C structs point into their tensors
        self.linears = linears  # held: a struct part's struct is the memory its weights' pointer names
        self.dtype = layers[0].input_layernorm.weight.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self._function = ops.library.decode_layer_stack
        self._function.restype = ctypes.c_int
        argtypes = [ctypes.c_void_p] * 9
        argtypes[1] = ctypes.c_int64  # the layer count
        self._function.argtypes = argtypes
        self._structs = (_StackLayer * len(layers))()
        for struct, layer, row in zip(self._structs, layers, linears):
            for name, parts in zip(("qkv", "o", "gate_up", "down"), row):
                _set_linear(getattr(struct, name), parts)
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            struct.input_norm, struct.post_norm = (norm.weight.data_ptr() for norm in norms)
            struct.input_eps, struct.post_eps = (norm.eps for norm in norms)
            struct.scale = layer.self_attn.scale
            struct.sliding_window = layer.self_attn.sliding_window or 0
        shape = _StackShape(hidden_size, intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim, 0, 0,
                            int(self.dtype is torch.bfloat16))
        self._init_step([p for row in linears for parts in row for p in parts], shape)

    @classmethod
    def build(cls, layers: list, ops: CpuOps) -> DecodeStack | None:
        """`layers`: LlamaDecoderLayers the caller checked are plain (LlamaDecoderLayer.plain: Llama's own
        classes on `ops`). None unless their linear layers are all GGUF int8 products of one library (up to three
        parts each), all linear_bf16 layers or all int8 W8A8 layers (_linear_parts), their norms' weights contiguous in one float32 or bfloat16 dtype, and the heads
        fit the decode kernel."""
        if not enabled() or not layers or getattr(ops, "library", None) is None:
            return None
        hidden = layers[0].self_attn.o_proj.output_size
        intermediate = layers[0].mlp.down_proj.input_size
        linears = _layer_linears(layers, hidden, intermediate)
        if linears is None or not _same_kernels([p for row in linears for parts in row for p in parts]):
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        norms = [norm.weight for layer in layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        if (dtype not in KERNEL_DTYPES or any(w.dtype is not dtype or not w.is_contiguous() for w in norms)
                or not DecodeKernel.supports(layers[0].self_attn.head_dim)):
            return None
        return cls(layers, ops, linears, hidden, intermediate)

    def serves(self, hidden: torch.Tensor, rope: RopeInputs, kv_caches: list, meta: AttentionMetadata) -> bool:
        """Whether this step is one the C loop runs exactly as the layers would (else the caller runs those)."""
        cos, sin = rope.tables.cos, rope.tables.sin
        if not (cos.dtype is torch.float32 and sin.dtype is torch.float32 and cos.is_contiguous()
                and sin.is_contiguous()):
            return False
        return self._serves_step(hidden, rope.positions, kv_caches, meta)

    def __call__(self, hidden: torch.Tensor, rope: RopeInputs, kv_caches: list,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the layers kv_caches has caches for, from the embeddings `hidden`: what the
        layers return (and run_direct_layers). Call only where `serves` said so."""
        held = self._fill_step(rope.positions, meta)
        self._step.cos, self._step.sin = rope.tables.cos.data_ptr(), rope.tables.sin.data_ptr()
        out = torch.empty_like(hidden)
        residual = torch.empty_like(hidden)
        failed = self._function(self._structs_address, len(kv_caches), self._shape_address, self._step_address,
                                self._product, hidden.data_ptr(), out.data_ptr(), residual.data_ptr(),
                                self._failed_address)
        del held
        if failed:
            layer = max(self._failed.value, 0)
            raise self._failure(failed, hidden.shape[0], layer)
        return out, residual


class GemmaDecodeStack(_Stack):
    """A Gemma 3 model's decode steps as one C call per layer (gemma_decode_layer: the previous layer's down
    product and this layer up to its gate_up product) with the layer's gated activation, a torch module, called
    between them. Made by `build` from Gemma3Model's layers on the fused CPU ops, or None where a layer is not the
    kind it runs (see build)."""

    def __init__(self, layers: list, activations: list, linears: list[list[tuple[GgufPart, ...]]],
                 ops: CpuOps, tables: list[tuple], hidden_size: int, intermediate_size: int) -> None:
        attn = layers[0].self_attn
        self.layers = layers  # held: the C structs point into their tensors
        self.linears = linears  # held: the structs of the parts, which the layers' structs point at
        self.activations = activations
        self.dtype = layers[0].input_layernorm.weight.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate_size = intermediate_size
        self._tables = tables  # per layer the RotaryEmbedding whose cos/sin the struct points at, and them
        self._function = ops.library.gemma_decode_layer
        self._function.restype = ctypes.c_int
        self._function.argtypes = [ctypes.c_void_p] * 9
        self._structs = (_GemmaLayer * len(layers))()
        for struct, layer, row, (table, cos, sin) in zip(self._structs, layers, linears, tables):
            for name, parts in zip(("qkv", "o", "gate_up", "down"), row):
                _set_linear(getattr(struct, name), parts)
            norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm)
            for name, norm in zip(("input_norm", "post_attention_norm", "pre_feedforward_norm",
                                   "post_feedforward_norm", "q_norm", "k_norm"), norms):
                setattr(struct, name, norm.offset_weight.data_ptr())
            struct.cos, struct.sin = cos.data_ptr(), sin.data_ptr()
            struct.eps, struct.scale = layer.input_layernorm.eps, layer.self_attn.scale
            struct.sliding_window = layer.self_attn.sliding_window or 0
        shape = _StackShape(hidden_size, intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim, 0, 0,
                            int(self.dtype is torch.bfloat16))
        self._init_step([p for row in linears for parts in row for p in parts], shape)

    @classmethod
    def build(cls, layers: list, tables: list, ops: CpuOps) -> GemmaDecodeStack | None:
        """`layers`: Gemma3DecoderLayers; `tables`: each one's RotaryEmbedding. None unless the model's dtype (its
        norms' weights') is float32 or bfloat16, every layer's norms run on the fused kernel (`ops`, a float32
        1 + weight each), with one eps; its linear layers are GGUF int8 products of one library (no bias, one
        rank, no LoRA slots), up to three parts each; and the heads fit the decode kernel."""
        if not enabled() or not layers or getattr(ops, "library", None) is None:
            return None
        hidden = layers[0].self_attn.o_proj.output_size
        intermediate = layers[0].mlp.down_proj.input_size
        dtype = layers[0].input_layernorm.weight.dtype
        if dtype not in KERNEL_DTYPES or not DecodeKernel.supports(layers[0].self_attn.head_dim):
            return None
        linears = _layer_linears(layers, hidden, intermediate)
        # GGUF products only: the bfloat16 and int8 layers' products have not been checked against Gemma's modules.
        if linears is None or any(type(p) is not GgufPart for row in linears for parts in row for p in parts):
            return None
        activations, held = [], []
        for layer, table in zip(layers, tables):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm)
            if attn.ops is not ops or any(norm.ops is not ops or getattr(norm, "offset_weight", None) is None
                   or norm.offset_weight.dtype is not torch.float32 or not norm.offset_weight.is_contiguous()
                   or norm.weight.dtype is not dtype or norm.eps != norms[0].eps for norm in norms):
                return None
            cos, sin = table.cos, table.sin
            if not (cos.dtype is torch.float32 and sin.dtype is torch.float32 and cos.is_contiguous()
                    and sin.is_contiguous()):
                return None
            activations.append(mlp.act_fn)
            held.append((table, cos, sin))
        if not _same_kernels([p for row in linears for parts in row for p in parts]):
            return None
        return cls(layers, activations, linears, ops, held, hidden, intermediate)

    def serves(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
               meta: AttentionMetadata) -> bool:
        """Whether this step is one the C calls run exactly as the modules would (else the caller runs those)."""
        self._point_at_tables()
        return self._serves_step(hidden, positions, kv_caches, meta)

    def _point_at_tables(self) -> None:
        """Each layer's struct at its rotary tables as they are now: a CPU model's tables grow (RotaryEmbedding)."""
        for index, (table, cos, sin) in enumerate(self._tables):
            if table.cos is not cos or table.sin is not sin:
                self._structs[index].cos, self._structs[index].sin = table.cos.data_ptr(), table.sin.data_ptr()
                self._tables[index] = (table, table.cos, table.sin)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states after the layers kv_caches has caches for, from the scaled embeddings `hidden` (which
        it updates in place): what the layers' modules return. Call only where `serves` said so."""
        held = self._fill_step(positions, meta)
        tokens = hidden.shape[0]
        gate_up = torch.empty(tokens, 2 * self.intermediate_size, dtype=self.dtype)
        shape, step, failed_part = self._shape_address, self._step_address, self._failed_address
        address = self._structs_address
        size = ctypes.sizeof(_GemmaLayer)
        activated = None
        for index in range(len(kv_caches) + 1):
            previous = address + (index - 1) * size if index else None
            layer = address + index * size if index < len(kv_caches) else None
            failed = self._function(previous, activated.data_ptr() if activated is not None else None, layer, shape,
                                    step, self._product, hidden.data_ptr(), gate_up.data_ptr(), failed_part)
            if failed:
                where = index - 1 if self._failed.value == 0 else index
                raise self._failure(failed, tokens, where)
            if layer is not None:
                activated = self.activations[index](gate_up)
        del held
        return hidden
