"""A GGUF Llama's decode step as one C call for all its decoder layers (attention/csrc/decode_stack.c).

models/llama.py's direct path already runs each layer as its bare kernel calls, but each of those ~10 calls per
layer still pays for its Python: argument checks, a fresh output tensor, the ctypes call. For a small model a
decode step's kernels are short (tens of microseconds), so that host work was a third of the step. Here the same
kernels run in the same order from C, so the result is the direct path's bit for bit; this module checks once per
step that the step is one the C loop serves, and otherwise leaves it to the direct path:

- every layer's four products are GGUF int8 products (ops/gguf_kernels.py's PreparedProduct, one library), with
  the step's rows below the size where a product switches to dequantized tiles;
- the step is decode tokens only, on the CPU attention backend with its native decode kernel and K/V writer;
- the caches are float32/bfloat16 in the activations' dtype, or a quantized format the kernels read.

PAGELLM_DECODE_STACK=0 turns it off (for A/B measurements and for benchmarks that time the per-layer calls).
"""

from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagellm.attention.native import CpuOps, DecodeKernel, KVWriter, _cache_geometry
from pagellm.attention.paged import AttentionMetadata, TorchAttentionBackend
from pagellm.layers.rotary import RopeInputs
from pagellm.ops.gguf_kernels import PreparedProduct, _matmul_failure

if TYPE_CHECKING:
    from pagellm.models.llama import DirectLayer

ENV = "PAGELLM_DECODE_STACK"
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
# decode_stack.c's failure codes.
_MEMORY, _PRODUCT, _ATTENTION = 1, 10, 20


class _StackLayer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "k_cache", "v_cache")] + [
        ("sliding_window", ctypes.c_int64), ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
        ("scale", ctypes.c_float), ("qkv_type", ctypes.c_int32), ("o_type", ctypes.c_int32),
        ("gate_up_type", ctypes.c_int32), ("down_type", ctypes.c_int32)]


class _StackShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in
                ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "block_size")] + [
        ("kv_format", ctypes.c_int32), ("bf16", ctypes.c_int32)]


class _StackStep(ctypes.Structure):
    _fields_ = [("positions", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("kv_rows", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("context_lens", ctypes.c_void_p),
                ("tokens", ctypes.c_int64), ("table_stride", ctypes.c_int64)]


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class DecodeStack:
    """The direct layers' decode steps in one call (see the module's docstring). Made by `build`, which returns
    None for layers the C loop cannot run; `serves` says whether it runs a given step."""

    def __init__(self, layers: list[DirectLayer], ops: CpuOps, products: list[list[PreparedProduct]]) -> None:
        first = layers[0]
        qkv, o, gate_up, down = products[0]
        self.layers = layers  # held: the C structs point into their tensors
        self.dtype = first.input_norm.dtype
        self.hidden_size, self.intermediate_size = o.out_features, down.in_features
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        limits = [product.int8_max_elements // product.in_features for row in products for product in row
                  if product.int8_max_elements is not None]
        # PreparedProduct takes the int8 kernel below its dense threshold; the C loop only calls that kernel.
        self.max_tokens = min(limits) - 1 if limits else None
        self._function = ops.library.decode_layer_stack
        self._function.restype = ctypes.c_int
        self._function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p]
        self._product = ctypes.cast(qkv.function, ctypes.c_void_p).value
        self._products = products
        self._structs = (_StackLayer * len(layers))()
        for struct, layer, (qkv_p, o_p, gate_up_p, down_p) in zip(self._structs, layers, products):
            struct.input_norm, struct.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            struct.input_eps, struct.post_eps, struct.scale = layer.input_eps, layer.post_eps, layer.scale
            struct.sliding_window = layer.sliding_window or 0
            for name, product in (("qkv", qkv_p), ("o", o_p), ("gate_up", gate_up_p), ("down", down_p)):
                setattr(struct, name, product.weight_address)
                setattr(struct, f"{name}_type", product.type_id)
        self._shape = _StackShape(self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
                                  self.head_dim, 0, 0, int(self.dtype is torch.bfloat16))
        self._step = _StackStep()
        self._failed_layer = ctypes.c_int64(-1)
        # The caches the structs point at, and their format: checked when the model runner's list changes.
        self._caches: list | None = None
        self._caches_format: object = None
        self._caches_ok = False

    @classmethod
    def build(cls, layers: list[DirectLayer], ops: CpuOps) -> DecodeStack | None:
        if not enabled() or not layers or getattr(ops, "library", None) is None:
            return None
        products = [[layer.qkv, layer.o, layer.gate_up, layer.down] for layer in layers]
        flat = [product for row in products for product in row]
        if not all(type(product) is PreparedProduct for product in flat):
            return None
        if any(product.kernels is not flat[0].kernels or product.function is not flat[0].function
               for product in flat):
            return None
        first = layers[0]
        heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        hidden, intermediate = products[0][1].out_features, products[0][3].in_features
        wanted = ((hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden), (hidden, 2 * intermediate),
                  (intermediate, hidden))
        for layer, row in zip(layers, products):
            if ((layer.num_heads, layer.num_kv_heads, layer.head_dim) != (heads, kv_heads, head_dim)
                    or [(p.in_features, p.out_features) for p in row] != list(wanted)
                    or layer.input_norm.dtype != first.input_norm.dtype
                    or layer.post_norm.dtype != first.input_norm.dtype
                    or not (layer.input_norm.is_contiguous() and layer.post_norm.is_contiguous())):
                return None
        if first.input_norm.dtype not in _ACTIVATION_DTYPES or not DecodeKernel.supports(head_dim):
            return None
        return cls(layers, ops, products)

    def serves(self, hidden: torch.Tensor, rope: RopeInputs, kv_caches: list, meta: AttentionMetadata) -> bool:
        """Whether this step is one the C loop runs exactly as the direct path would (else the caller runs that)."""
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
        tables = rope.tables
        cos, sin, positions = tables.cos, tables.sin, rope.positions
        if not (cos.dtype is torch.float32 and sin.dtype is torch.float32 and cos.is_contiguous()
                and sin.is_contiguous() and positions.dtype is torch.int64 and positions.is_contiguous()
                and positions.numel() == tokens):
            return False
        rows = meta.kv_write_index
        if rows.dtype is not torch.int64 or not rows.is_contiguous() or rows.numel() != tokens * self.num_kv_heads:
            return False
        return self._check_caches(kv_caches, meta)

    def _check_caches(self, kv_caches: list, meta: AttentionMetadata) -> bool:
        if kv_caches is self._caches and meta.kv_format is self._caches_format:
            return self._caches_ok
        self._caches, self._caches_format, self._caches_ok = kv_caches, meta.kv_format, False
        if len(kv_caches) > len(self.layers):
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
                    or (not quantized and k_cache.dtype is not self.dtype)):
                return False
            codes.add((code, block_size))
            struct.k_cache, struct.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        if len(codes) != 1 or (meta.block_size and next(iter(codes))[1] != meta.block_size):
            return False
        self._shape.kv_format, self._shape.block_size = next(iter(codes))
        self._caches_ok = True
        return True

    def __call__(self, hidden: torch.Tensor, rope: RopeInputs, kv_caches: list,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the layers kv_caches has caches for, from the embeddings `hidden`: what
        run_direct_layers returns. Call only where `serves` said so."""
        tokens = hidden.shape[0]
        decode = meta.decode
        block_tables = np.ascontiguousarray(decode.block_tables, dtype=np.int64)
        context_lens = np.ascontiguousarray(decode.context_lens, dtype=np.int64)
        step = self._step
        step.positions, step.cos, step.sin = (rope.positions.data_ptr(), rope.tables.cos.data_ptr(),
                                              rope.tables.sin.data_ptr())
        step.kv_rows = meta.kv_write_index.data_ptr()
        step.block_tables, step.context_lens = block_tables.ctypes.data, context_lens.ctypes.data
        step.tokens, step.table_stride = tokens, block_tables.shape[1]
        out = torch.empty_like(hidden)
        residual = torch.empty_like(hidden)
        failed = self._function(ctypes.addressof(self._structs), len(kv_caches), ctypes.addressof(self._shape),
                                ctypes.addressof(step), self._product, hidden.data_ptr(), out.data_ptr(),
                                residual.data_ptr(), ctypes.addressof(self._failed_layer))
        if failed:
            raise self._failure(failed, tokens)
        return out, residual

    def _failure(self, code: int, tokens: int) -> Exception:
        layer = self._failed_layer.value
        if code == _MEMORY:
            return MemoryError(f"the decode stack could not allocate its row buffers for {tokens} tokens")
        if code >= _ATTENTION:
            return RuntimeError(f"layer {layer}: the decode attention kernel failed (code {code - _ATTENTION}) on "
                                f"{tokens} tokens, head_dim={self.head_dim}")
        product = self._products[max(layer, 0)][0]
        return _matmul_failure(code - _PRODUCT, tokens, product.type_name, product.in_features)
