"""Linear methods on 8-bit weights, for the formats that store them (compressed_tensors.py, fp8.py) and for
online quantization of a float checkpoint (quantization="int8" here, "fp8" in fp8.py).

- Int8LinearMethod: int8 weights with per-channel or per-tensor scales, activations quantized to int8 per row
  (dynamically, or with the checkpoint's static input_scale).
- Fp8LinearMethod: float8_e4m3fn weights with per-tensor, per-channel or block-wise scales; activations stay in
  the model's dtype (no CPU multiplies fp8: see pagellm/ops/w8a8_kernels.py), so a static input_scale is loaded
  and not applied.
- OnlineInt8LinearMethod / OnlineFp8LinearMethod: the float weight of one layer is allocated when its first
  checkpoint tensor arrives and quantized as soon as its last shard has loaded, then freed: the float model and
  the quantized one never exist side by side, only one layer's float weight beside the quantized model.

Fused layers whose checkpoint shards (q/k/v, gate/up) each carry a per-tensor scale keep one scale per shard,
and each output channel takes its shard's scale (vLLM's convert_to_channelwise): exact, where requantizing to the
largest scale (vLLM's fp8 path) would round the other shards' weights again.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from pagellm.layers.quantization.base import (FUSED_CHECKPOINT_MODULES, LinearMethod, QuantizationConfig,
                                              is_lm_head)
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.weights import set_weight_attrs
from pagellm.ops import w8a8_kernels as wk
from pagellm.worker.huge_pages import note_freed


def checkpoint_module_names(prefix: str, matches: Callable[[str], bool]) -> list[str]:
    """The checkpoint's module names for pagellm's layer `prefix`, to test a config's patterns against: the
    prefix itself where a pattern names it (Phi-3 stores qkv_proj fused) or it fuses nothing, else its shards
    (model.layers.0.self_attn.qkv_proj -> ...q_proj, ...k_proj, ...v_proj)."""
    parent, _, last = prefix.rpartition(".")
    if matches(prefix) or last not in FUSED_CHECKPOINT_MODULES:
        return [prefix]
    return [f"{parent}.{shard}" if parent else shard for shard in FUSED_CHECKPOINT_MODULES[last]]


def all_or_none(prefix: str, names: list[str], flags: list[bool], what: str, fix: str = "") -> bool:
    """Whether every checkpoint module `names` of layer `prefix` is flagged (left dense by a format's ignore or
    exclude list, `what` naming it), refusing a fused layer only some of whose shards are, as vLLM refuses it."""
    if any(flags) and not all(flags):
        raise ValueError(f"{prefix} fuses {names}, of which {what} only some; pagellm (as vLLM) needs the fused "
                         f"shards quantized alike{fix}")
    return all(flags)


def _shard_index(layer: nn.Module, shard) -> int:
    return layer.shard_ids.index(shard)


def _load_per_shard_scale(layer: nn.Module, name: str, param: nn.Parameter, tensor: torch.Tensor, shard=None) -> None:
    """A per-tensor scale (one value) into its shard's slot; a fused checkpoint tensor's (shard None) into all."""
    where = f"{layer.prefix}.{name}" + (f" (shard {shard})" if shard is not None else "")
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {where!r} has shape {tuple(tensor.shape)}; a per-tensor scale holds "
                         "one value")
    value = tensor.reshape(()).to(param.dtype)
    if shard is None:
        param.data.fill_(value)
    else:
        param.data[_shard_index(layer, shard)] = value


def _load_channel_scale(layer: nn.Module, param: nn.Parameter, tensor: torch.Tensor, shard=None) -> None:
    """Per-channel scales are [N, 1] in compressed-tensors checkpoints; a flat [N] is taken too."""
    if tensor.dim() == 1:
        tensor = tensor[:, None]
    type(layer).weight_loader(layer, param, tensor, shard)


def per_shard_scale(layer: nn.Module, name: str, shards: int) -> None:
    """Register float32 [shards] parameter `name`: one per-tensor scale per fused checkpoint shard."""
    param = nn.Parameter(torch.empty(shards, dtype=torch.float32), requires_grad=False)
    param.weight_loader = functools.partial(_load_per_shard_scale, layer, name)
    layer.register_parameter(name, param)


def channelwise(per_shard: torch.Tensor, output_sizes: list[int]) -> torch.Tensor:
    """Per-shard scales [shards] as one per output channel [sum(output_sizes)]."""
    return torch.cat([per_shard[i].expand(size) for i, size in enumerate(output_sizes)]).float()


def _prepared(kernel) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A loaded layer's kernel (ops/w8a8_kernels.py's Int8Linear / Fp8Linear) as x -> x @ W^T, or None before it
    is made."""
    return None if kernel is None else functools.partial(kernel, bias=None)


class _OneKernel:
    """The prepared product and the kept tensors of a method whose loaded layer runs on one kernel object
    (ops/w8a8_kernels.py's Int8Linear / Fp8Linear, or an online method's), which `loaded_kernel` returns."""

    def prepared_product(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return _prepared(self.loaded_kernel(layer))

    def kernel_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        kernel = self.loaded_kernel(layer)
        return kernel.tensors() if kernel is not None else []


def _free(param: nn.Parameter) -> None:
    """Drop a parameter's storage once its kernel keeps its own copy of the weight."""
    note_freed(param.data.untyped_storage().nbytes())
    param.data = param.data.new_empty(0)


def _register_weight(layer: nn.Module, out_features: int, input_size: int, dtype: torch.dtype) -> None:
    weight = nn.Parameter(torch.empty(out_features, input_size, dtype=dtype), requires_grad=False)
    set_weight_attrs(weight, input_dim=1, output_dim=0)
    layer.register_parameter("weight", weight)


def _register_channel_scale(layer: nn.Module, name: str, out_features: int) -> None:
    """float32 [N, 1] parameter `name`: one scale per output channel."""
    scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
    set_weight_attrs(scale, output_dim=0)
    scale.weight_loader = functools.partial(_load_channel_scale, layer)
    layer.register_parameter(name, scale)


class Int8LinearMethod(_OneKernel, LinearMethod):
    """A checkpoint's int8 weights: `weight` int8 [N, K]; `weight_scale` float [N, 1] (per channel) or one per
    checkpoint shard (per tensor); `input_scale` one per shard with static activation scales (their largest is
    used, as vLLM does)."""

    def __init__(self, per_channel: bool, static_input: bool) -> None:
        self.per_channel = per_channel
        self.static_input = static_input

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        out_features = sum(output_sizes)
        _register_weight(layer, out_features, input_size, torch.int8)
        if self.per_channel:
            _register_channel_scale(layer, "weight_scale", out_features)
        else:
            per_shard_scale(layer, "weight_scale", len(output_sizes))
        if self.static_input:
            per_shard_scale(layer, "input_scale", len(output_sizes))
        layer.logical_widths = list(output_sizes)

    def _scales(self, layer: nn.Module) -> tuple[torch.Tensor, float | None]:
        scale = layer.weight_scale.data
        scale = scale.reshape(-1).float() if self.per_channel else channelwise(scale, layer.logical_widths)
        input_scale = float(layer.input_scale.data.max()) if self.static_input else None
        return scale, input_scale

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale, input_scale = self._scales(layer)
        if input_scale is not None and not 0 < input_scale < float("inf"):
            raise ValueError(f"{layer.prefix}.input_scale is {input_scale}; a static activation scale must be a "
                             "finite number > 0")
        layer.int8_linear = wk.choose_int8_linear(layer.weight.data, scale, input_scale)
        if layer.int8_linear.weight is None:
            _free(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = self.loaded_kernel(layer)
        if kernel is None:  # not processed yet (a model used before loading finished, e.g. in a unit test)
            scale, input_scale = self._scales(layer)
            return wk.int8_linear_reference(x, layer.weight, scale, input_scale, bias)
        return kernel(x, bias)

    def loaded_kernel(self, layer: nn.Module) -> wk.Int8Linear | None:
        return getattr(layer, "int8_linear", None)


class Fp8LinearMethod(_OneKernel, LinearMethod):
    """A checkpoint's fp8 weights: `weight` float8_e4m3fn [N, K] and its scale `scale_name` ("weight_scale", or
    "weight_scale_inv" in quant_method fp8's block-wise checkpoints): one per checkpoint shard ("tensor"),
    [N, 1] ("channel") or [N / bn, K / bk] ("block", `block` = (bn, bk)); `input_scale` one per shard with
    static activation scales (loaded, not applied: activations stay in the model's dtype)."""

    def __init__(self, strategy: str, block: tuple[int, int] | None = None, static_input: bool = False,
                 scale_name: str = "weight_scale") -> None:
        if strategy not in ("tensor", "channel", "block") or (strategy == "block") != (block is not None):
            raise ValueError(f"fp8 weights take tensor, channel or block scales (with a block shape), not "
                             f"{strategy!r} with block {block}")
        self.strategy = strategy
        self.block = block
        self.static_input = static_input
        self.scale_name = scale_name

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        out_features = sum(output_sizes)
        _register_weight(layer, out_features, input_size, torch.float8_e4m3fn)
        if self.strategy == "tensor":
            per_shard_scale(layer, self.scale_name, len(output_sizes))
        elif self.strategy == "channel":
            _register_channel_scale(layer, self.scale_name, out_features)
        else:
            block_n, block_k = self.block
            whole = len(output_sizes) == 1 and layer.checkpoint_shard_sizes() == list(output_sizes)
            _check_block_shape(layer.prefix, output_sizes, input_size, block_n, block_k, whole)
            scale = nn.Parameter(torch.empty(-(-out_features // block_n), input_size // block_k, dtype=torch.float32),
                                 requires_grad=False)
            if out_features % block_n:
                set_weight_attrs(scale, input_dim=1)  # one whole weight: its scales load as they are
            else:
                set_weight_attrs(scale, output_dim=0, input_dim=1, packed_dim=0, pack_factor=block_n)
            layer.register_parameter(self.scale_name, scale)
        if self.static_input:
            per_shard_scale(layer, "input_scale", len(output_sizes))
        layer.logical_widths = list(output_sizes)

    def _scales(self, layer: nn.Module) -> tuple[torch.Tensor, int]:
        """(scales [N, blocks of K], block_k)."""
        scale = getattr(layer, self.scale_name).data
        in_features = layer.weight.shape[1]
        if self.strategy == "tensor":
            return channelwise(scale, layer.logical_widths)[:, None], in_features
        if self.strategy == "channel":
            return scale.float(), in_features
        return wk.expand_block_scales(scale.float(), sum(layer.logical_widths), self.block[0]), self.block[1]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        wk.check_fp8_finite(layer.weight.data, f"{layer.prefix}.weight")
        scales, block_k = self._scales(layer)
        layer.fp8_linear = wk.choose_fp8_linear(layer.weight.data, scales, block_k)
        if layer.fp8_linear.weight is None:
            _free(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = self.loaded_kernel(layer)
        if kernel is None:
            scales, block_k = self._scales(layer)
            return wk.fp8_linear_reference(x, layer.weight, scales, block_k, bias)
        return kernel(x, bias)

    def loaded_kernel(self, layer: nn.Module) -> wk.Fp8Linear | None:
        return getattr(layer, "fp8_linear", None)


def _check_block_shape(prefix: str, output_sizes: list[int], input_size: int, block_n: int, block_k: int,
                       whole: bool) -> None:
    """Block-wise scales load shard by shard and rank by rank only where every piece is whole blocks; a layer
    holding one whole checkpoint weight (`whole`) may end in a partial block of outputs, as the checkpoint's
    scales do (DeepSeek-V3's kv_a_proj_with_mqa: 576 outputs in blocks of 128)."""
    if (any(size % block_n for size in output_sizes) and not whole) or input_size % block_k:
        raise ValueError(f"{prefix}: fp8 block-wise scales of [{block_n}, {block_k}] need each output shard "
                         f"(q/k/v, gate/up, per tensor-parallel rank) and the input features to be whole blocks; "
                         f"this layer has outputs {output_sizes} and {input_size} inputs. pagellm does not load "
                         "block-wise fp8 for it (a different tensor_parallel_size may split it evenly)")


# ---- online quantization ------------------------------------------------------------------------------------


class OnlineQuantizedLinearMethod(_OneKernel, LinearMethod):
    """A float checkpoint quantized layer by layer while it loads: `weight` starts empty and is allocated in
    the model's dtype when its first checkpoint tensor arrives; once every shard has loaded, `quantize` turns it
    into the layer's kernel and the float weight is freed."""

    kind = "?"

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, input_dim=1, output_dim=0)
        weight.weight_loader = functools.partial(self._load, layer)
        layer.register_parameter("weight", weight)
        layer.online_shape = (sum(output_sizes), input_size)
        layer.online_pending = set(layer.shard_ids)
        layer.online_kernel = None

    def _load(self, layer: nn.Module, param: nn.Parameter, tensor: torch.Tensor, shard=None) -> None:
        if layer.online_kernel is not None:
            raise ValueError(f"checkpoint tensor for {layer.prefix}.weight (shard {shard}) arrived after every "
                             "shard of it had loaded and it was quantized")
        if param.numel() == 0:
            param.data = torch.empty(layer.online_shape, dtype=param.dtype, device=param.device)
        type(layer).weight_loader(layer, param, tensor, shard)
        layer.online_pending -= set(layer.shard_ids) if shard is None else {shard}
        if not layer.online_pending:
            self._finish(layer)

    def _finish(self, layer: nn.Module) -> None:
        layer.online_kernel = self.quantize(layer.weight.data)
        _free(layer.weight)

    @abstractmethod
    def quantize(self, weight: torch.Tensor):
        """The kernel of one loaded float weight [N, K] (pagellm/ops/w8a8_kernels.py)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.online_kernel is not None:
            return
        if layer.weight.numel() == 0:
            # No checkpoint tensor reached it (load_format="dummy"): drawn as the dummy loader draws weights.
            generator = torch.Generator(device=layer.weight.device).manual_seed(0)
            layer.weight.data = torch.empty(layer.online_shape, dtype=layer.weight.dtype, device=layer.weight.device)
            layer.weight.data.uniform_(-1e-3, 1e-3, generator=generator)
        self._finish(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.online_kernel is None:
            raise RuntimeError(f"{layer.prefix} is used before its weights were loaded and quantized")
        return layer.online_kernel(x, bias)

    def loaded_kernel(self, layer: nn.Module):
        return layer.online_kernel


class OnlineInt8LinearMethod(OnlineQuantizedLinearMethod):
    """Per-channel symmetric int8 weights, activations int8 per row, both rotated by a block Hadamard transform
    and the weights' scales fitted (w8a8_kernels.quantize_int8_rotated)."""

    def quantize(self, weight: torch.Tensor) -> wk.Int8Linear:
        q, scale, rotation = wk.quantize_int8_rotated(weight)
        return wk.choose_int8_linear(q, scale, None, rotation)


class OnlineFp8LinearMethod(OnlineQuantizedLinearMethod):
    """One fp8 e4m3 scale per weight (max|w| / 448), as vLLM's --quantization fp8 quantizes a float checkpoint."""

    def quantize(self, weight: torch.Tensor) -> wk.Fp8Linear:
        q, scale = wk.quantize_fp8_per_tensor(weight)
        return wk.choose_fp8_linear(q, scale.reshape(1, 1).expand(weight.shape[0], 1), weight.shape[1])


def is_embedding_or_head(prefix: str) -> bool:
    """The token embedding and the LM head: kept dense by online quantization (as vLLM keeps them)."""
    return prefix.endswith("embed_tokens") or is_lm_head(prefix)


class OnlineQuantization(QuantizationConfig):
    """quantization="int8" (or "fp8", fp8.py) on a float checkpoint: every linear layer but the embedding and
    the LM head quantized as it loads."""

    def __init__(self, name: str, method: OnlineQuantizedLinearMethod, description: str) -> None:
        self.name = name
        self.method = method
        self.description = description
        self.dense = UnquantizedLinearMethod()

    def linear_method(self, prefix: str) -> LinearMethod:
        return self.dense if is_embedding_or_head(prefix) else self.method

    def describe(self) -> str:
        return f"{self.name} ({self.description}; embedding and LM head kept dense)"


def online_int8_config(checkpoint_config: dict | None, requested: str | None) -> QuantizationConfig:
    """The registry's factory for quantization="int8" (a float checkpoint only: see the registry)."""
    return OnlineQuantization("int8", OnlineInt8LinearMethod(),
                              "online W8A8: per-channel int8 weights quantized at load, dynamic per-token int8 "
                              f"activations, both rotated by Hadamard blocks of up to {wk.ONLINE_INT8_ROTATION} "
                              "inputs")
