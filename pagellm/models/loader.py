"""Find a model (local HF directory, .gguf file, or the embedded default) and load it onto a device."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.attention.native import CpuOps, cpu_ops
from pagellm.config import DEFAULT_MODEL
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.layers.weights import process_weights_after_loading
from pagellm.models import registry
from pagellm.models.llama import LlamaForCausalLM

SUPPORTED_ARCHITECTURES = registry.SUPPORTED_ARCHITECTURES
_DEFAULT_ALIASES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")


@dataclass(frozen=True)
class ModelSource:
    path: Path
    is_gguf: bool

    @property
    def name(self) -> str:
        return str(self.path)


def resolve_model(model: str | None) -> ModelSource:
    """Where the weights are. Fails at once, saying what to pass, for anything not on this machine."""
    if model is None or model in _DEFAULT_ALIASES:
        from pagellm.models.gguf_loader import default_model_path

        return ModelSource(default_model_path(), is_gguf=True)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, is_gguf=True)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, is_gguf=False)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], is_gguf=True)
        raise ValueError(
            f"model={model!r} is a directory with neither config.json nor exactly one .gguf file "
            f"(found {len(ggufs)}); point model at a HuggingFace model directory or at one .gguf file."
        )
    raise ValueError(
        f"model={model!r} is not a local path, and pagellm reaches no model hub. Pass a local HuggingFace "
        "model directory (config.json, *.safetensors, tokenizer files), a .gguf file, or leave model unset "
        f"(or model={DEFAULT_MODEL!r}) for the embedded default model."
    )


def load_hf_config(source: ModelSource):
    if source.is_gguf:
        from pagellm.models.gguf_loader import load_gguf

        return load_gguf(source.path)
    from transformers import AutoConfig

    # Refused from config.json itself: transformers may not know the model type, or may want a quantization
    # library installed, and either would fail first with an error that does not say what pagellm runs.
    config_path = source.path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON ({error}); it should be the model's HF config") from None
    registry.family_of(raw)
    return registry.language_model_config(AutoConfig.from_pretrained(source.path)), None


def check_architecture(config) -> None:
    """Refuses an unsupported architecture or a quantized checkpoint, naming what pagellm runs."""
    registry.family_of(config)


def load_model(
    source: ModelSource,
    config,
    gguf_state_dict: dict[str, torch.Tensor] | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    quant_config: QuantizationConfig | None = None,
) -> LlamaForCausalLM:
    """The model in `dtype` on `device`, its weights from the checkpoint, or random with load_format="dummy".

    Built on the device with `dtype` as the default, so parameters are first allocated there already in
    `dtype` (an 8B model never exists in float32 on the GPU), and quantized formats keep their own
    parameter dtypes; checkpoint tensors are then copied in one at a time (cast where the parameter's dtype
    differs), so at most one tensor is in flight beside the model. Then each layer's method prepares its
    weights for this device (packed layouts, kernels).
    """
    model_class = registry.model_class_for(config)
    # The layers make their parameters with torch.empty: no time goes into initialising weights we overwrite.
    with torch.device(device), default_dtype(dtype):
        model = model_class(config, max_positions, quant_config)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache(device)
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    else:
        weights = gguf_state_dict.items() if gguf_state_dict is not None else _iter_hf_weights(source.path)
        model.load_weights(weights)
    process_weights_after_loading(model)
    ops = cpu_ops() if device.type == "cpu" else None
    if ops is not None and CpuOps.supports(config.hidden_size, config.intermediate_size, dtype):
        model.use_cpu_ops(ops)
    return model.eval()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Floating-point tensors made without a dtype are `dtype` inside the block."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int, low: float = -1e-3, high: float = 1e-3) -> None:
    """Every parameter uniform in [low, high], drawn on its device in its dtype (vLLM's dummy format):
    small enough that activations stay finite through any depth, random enough not to be all ties."""
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if not param.is_floating_point():
            param.zero_()  # packed integer weights of a quantized format: zeros are valid blocks
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(low, high, generator=generators[param.device])


def checkpoint_files(directory: Path) -> list[str]:
    """The safetensors files of a HF directory: those model.safetensors.index.json names, where it exists
    (a directory may hold other .safetensors files, e.g. a consolidated copy), else every *.safetensors."""
    index = Path(directory) / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map; it should map each tensor name to its file")
        files = [str(Path(directory) / name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not there: {missing[:3]}")
        return files
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def _iter_hf_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    safetensors_files = checkpoint_files(directory)
    if safetensors_files:
        from safetensors import safe_open

        for file in safetensors_files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bin_files = sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))
    if not bin_files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {directory}")
    for file in bin_files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_tokenizer(source: ModelSource, tokenizer: str | None = None):
    if tokenizer is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    if source.is_gguf:
        from pagellm.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path)


def eos_token_ids(source: ModelSource, config, tokenizer) -> set[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = getattr(config, "eos_token_id", None)
    if not source.is_gguf and (source.path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(source.path).eos_token_id
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(i) for i in extra)
    return ids
