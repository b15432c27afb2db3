"""Find a model (local HF directory, .gguf file, a hub id in the local Hugging Face cache, or the embedded
default), load it onto a device, and read its generation_config.json defaults."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.config import DEFAULT_MODEL, GENERATION_CONFIG_SAMPLING_KEYS
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.layers.weights import process_weights_after_loading
from pagellm.models import registry
from pagellm.models.llama import LlamaForCausalLM
from pagellm.ops.cpu_ops import CpuOps, cpu_ops
from pagellm.worker.huge_pages import advise_huge_pages, weight_arena

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = registry.SUPPORTED_ARCHITECTURES
_DEFAULT_ALIASES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")


@dataclass(frozen=True)
class ModelSource:
    path: Path
    is_gguf: bool

    @property
    def name(self) -> str:
        return str(self.path)


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """Where the weights are, as vLLM finds them offline: a local directory or .gguf file, a hub id in the
    local Hugging Face cache (at `revision`), or the embedded default for None. Fails at once, saying where
    it looked, for anything not on this machine."""
    if model is None or model in _DEFAULT_ALIASES:
        from pagellm.models.gguf_loader import default_model_path

        return ModelSource(default_model_path(), is_gguf=True)
    path = Path(model).expanduser()
    if not path.exists() and is_hub_id(model):
        path = hub_snapshot(model, revision, download_dir, "model")
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, is_gguf=True)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, is_gguf=False)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], is_gguf=True)
        raise ValueError(
            f"model={model!r} is a directory ({path}) with neither config.json nor exactly one .gguf file "
            f"(found {len(ggufs)}); point model at a HuggingFace model directory or at one .gguf file."
        )
    raise ValueError(
        f"model={model!r} is not a local path ({path.absolute()} does not exist), and pagellm reaches no model "
        "hub. Pass a local HuggingFace model directory (config.json, *.safetensors, tokenizer files), a .gguf file, "
        "a hub id (org/name) already in the local Hugging Face cache, or leave model unset "
        f"(or model={DEFAULT_MODEL!r}) for the embedded default model."
    )


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled as a hub repository id: `name` or `org/name`."""
    return bool(_HUB_ID.match(name)) and ".." not in name and not name.endswith((".gguf", ".json"))


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """The Hugging Face cache pagellm looks in, read from the environment at each call as huggingface_hub
    reads it at import: download_dir, else $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if download_dir:
        return Path(download_dir).expanduser()
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str, revision: str | None, download_dir: str | None, argument: str) -> Path:
    """The cached snapshot directory of `repo_id` at `revision` (default main), without any network access;
    a ValueError naming the places looked in when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir(download_dir)
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        pass
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    refs = sorted(p.name for p in (repo_dir / "refs").glob("*")) if (repo_dir / "refs").is_dir() else []
    cached = f"; the cache has revisions {refs} of it" if refs else ""
    option = "revision" if argument == "model" else "tokenizer_revision"
    raise ValueError(
        f"{argument}={repo_id!r} (revision {revision or 'main'}) is not a local path ({Path(repo_id).absolute()} "
        f"does not exist) and not in the local Hugging Face cache: looked for {repo_dir}/refs/"
        f"{revision or 'main'} and its snapshot{cached}. pagellm downloads nothing: download it first (e.g. `hf "
        f"download {repo_id}`), point HF_HOME, HF_HUB_CACHE or download_dir at the cache that holds it, pass a "
        f"{option} that is cached, or pass a local directory"
        + (f" (or leave model unset for the embedded {DEFAULT_MODEL})." if argument == "model" else ".")
    )


def resolve_tokenizer(tokenizer: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A --tokenizer as a local directory: itself, or its snapshot in the Hugging Face cache."""
    path = Path(tokenizer).expanduser()
    if not path.exists() and is_hub_id(tokenizer):
        path = hub_snapshot(tokenizer, revision, download_dir, "tokenizer")
    if not path.exists():
        raise ValueError(f"tokenizer={tokenizer!r} is not a local path ({path.absolute()} does not exist) nor a hub "
                         "id; pass a directory holding the tokenizer files, or a hub id in the local cache.")
    return str(path)


def load_hf_config(source: ModelSource, trust_remote_code: bool = False):
    if source.is_gguf:
        from pagellm.models.gguf_loader import open_gguf

        return open_gguf(source.path)
    from transformers import AutoConfig

    # Refused from config.json itself: transformers may not know the model type, or may want a quantization
    # library installed, and either would fail first with an error that does not say what pagellm runs.
    config_path = source.path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON ({error}); it should be the model's HF config") from None
    separate = _hf_quant_config(source.path) if "quantization_config" not in raw else None
    if separate is not None:
        raw["quantization_config"] = separate
    registry.family_of(raw)
    config = registry.language_model_config(AutoConfig.from_pretrained(source.path,
                                                                       trust_remote_code=trust_remote_code))
    if separate is not None:
        config.quantization_config = separate
    return config, None


def _hf_quant_config(directory: Path) -> dict | None:
    """NVIDIA ModelOpt's hf_quant_config.json, which older exports write beside a config.json that holds no
    quantization_config (vLLM reads it too), as a quantization_config of quant_method "modelopt"."""
    path = directory / "hf_quant_config.json"
    if not path.is_file():
        return None
    try:
        contents = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); it should be ModelOpt's quantization config") \
            from None
    if not isinstance(contents, dict) or not isinstance(contents.get("quantization"), dict):
        raise ValueError(f"{path} holds no 'quantization' section; ModelOpt writes "
                         '{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": ...}}')
    return {"quant_method": "modelopt", **contents}


def check_architecture(config) -> None:
    """Refuses an unsupported architecture or a quantized checkpoint, naming what pagellm runs."""
    registry.family_of(config)


def load_model(
    source: ModelSource,
    config,
    gguf_state_dict,  # gguf_loader.GGUFTensors, or None for an HF directory
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    online_config: dict | None = None,
) -> LlamaForCausalLM:
    """The model in `dtype` on `device`, its weights from the checkpoint, or random with load_format="dummy".

    Built on the device with `dtype` as the default, so parameters are first allocated there already in
    `dtype` (an 8B model never exists in float32 on the GPU), and quantized formats (the checkpoint's, or
    `quantization`'s online one, with `online_config`'s settings) keep their own
    parameter dtypes; checkpoint tensors are then copied in one at a time (cast where the parameter's dtype
    differs), so at most one tensor is in flight beside the model. Then each layer's method prepares its
    weights for this device (packed layouts, kernels).
    """
    from pagellm.layers.quantization import quantization_config_for

    if gguf_state_dict is not None:
        from pagellm.layers.quantization.gguf import GGUFConfig

        quant_config = GGUFConfig(gguf_state_dict.type_counts())
    else:
        quant_config = quantization_config_for(config, quantization, online_config)
    model_class = registry.model_class_for(config)
    # The layers make their parameters with torch.empty: no time goes into initialising weights we overwrite.
    with torch.device(device), default_dtype(dtype):
        model = model_class(config, max_positions, quant_config)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache(device)
    if device.type == "cpu":
        advise_huge_pages([*model.parameters(), *model.buffers()])
    # The layers' repacked weights share huge-page chunks (worker/huge_pages.py), those online quantization packs
    # as the checkpoint loads included.
    with weight_arena():
        if load_format == "dummy":
            initialize_dummy_weights(model, seed)
        else:
            weights = gguf_state_dict.items() if gguf_state_dict is not None else _iter_hf_weights(source.path)
            if quant_config is not None:
                weights = ((name, tensor) for name, tensor in weights if not quant_config.skipped_tensor(name))
                weights = quant_config.checkpoint_tensors(weights)
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
        if not param.is_floating_point() or param.element_size() == 1:
            param.zero_()  # packed integer or fp8 weights of a quantized format: zeros are valid blocks
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


def load_tokenizer(source: ModelSource, tokenizer: str | None = None, revision: str | None = None,
                   download_dir: str | None = None, trust_remote_code: bool = False):
    """The model's tokenizer, or the one `tokenizer` names (a directory, or a hub id in the local cache)."""
    if tokenizer is None and source.is_gguf:
        from pagellm.models.gguf_loader import load_gguf_tokenizer

        loaded = load_gguf_tokenizer(source.path)  # imports transformers only where it must rebuild the tokenizer
    else:
        from transformers import AutoTokenizer

        path = source.path if tokenizer is None else resolve_tokenizer(tokenizer, revision, download_dir)
        loaded = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    release_construction_tables(loaded)
    return loaded


# transformers tokenizer classes that keep the vocabulary and merges they built their Rust tokenizer from as Python
# objects (`_vocab`, `_merges`) and read them in __init__ only: encoding, decoding, get_vocab and save_pretrained
# go through the Rust tokenizer. For Gemma 3's 262k-token vocabulary and 515k merges these take ~130 MiB.
_TOKENIZERS_WITH_CONSTRUCTION_TABLES = frozenset(
    {"GemmaTokenizer", "LlamaTokenizer", "Qwen2Tokenizer", "GPT2Tokenizer", "CohereTokenizer"})


def release_construction_tables(tokenizer) -> None:
    """Drop the Python copies of the vocabulary and merges that the classes above keep after construction."""
    if type(tokenizer).__name__ not in _TOKENIZERS_WITH_CONSTRUCTION_TABLES:
        return
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(tokenizer, name, None), (dict, list)):
            setattr(tokenizer, name, None)


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


def generation_defaults(source: ModelSource, hf_config, generation_config: str = "auto",
                        overrides: dict | None = None) -> dict:
    """vLLM's get_diff_sampling_param: the sampling parameters a request that leaves them unset gets, from the
    model's generation_config.json ("auto"), none ("vllm"), or a directory's generation_config.json, with
    `overrides` (override_generation_config) on top; max_new_tokens is returned as max_tokens."""
    config = {} if generation_config == "vllm" else _generation_config_values(source, hf_config, generation_config)
    config.update(overrides or {})
    defaults = {key: config[key] for key in GENERATION_CONFIG_SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def _generation_config_values(source: ModelSource, hf_config, generation_config: str) -> dict:
    """The values a generation config sets (transformers' to_diff_dict, as vLLM reads it)."""
    if generation_config == "auto" and source.is_gguf:
        return {}  # its config holds no sampling fields (the loader reads no general.sampling.* key)
    from transformers import GenerationConfig, PretrainedConfig

    if generation_config != "auto":
        directory = Path(generation_config).expanduser()
        if not (directory / "generation_config.json").is_file():
            raise ValueError(f"generation_config={generation_config!r} is not a directory holding a "
                             "generation_config.json; pass one, 'auto' (the model's) or 'vllm' (none).")
        return GenerationConfig.from_pretrained(directory).to_diff_dict()
    if (source.path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(source.path).to_diff_dict()
    if isinstance(hf_config, PretrainedConfig):
        return GenerationConfig.from_model_config(hf_config).to_diff_dict()
    return {}


@dataclass(frozen=True)
class ServerSamplingDefaults:
    """What the server fills in for sampling fields a request leaves unset (vLLM's default_sampling_params),
    and the server-wide cap on max_tokens (vLLM's override_max_tokens): a --generation-config directory's
    max_new_tokens, or --override-generation-config's."""

    params: dict
    max_tokens_cap: int | None

    @classmethod
    def of(cls, source: ModelSource, hf_config, generation_config: str, overrides: dict) -> ServerSamplingDefaults:
        params = generation_defaults(source, hf_config, generation_config, overrides)
        cap = params.get("max_tokens") if generation_config not in ("auto", "vllm") else overrides.get("max_new_tokens")
        return cls(params, cap)

    def value(self, request, name: str, fallback: object) -> object:
        """The request's own value where it set one, else the model's default, else `fallback` (OpenAI's)."""
        value = getattr(request, name)
        if value is not None and name in request.model_fields_set:
            return value
        return self.params.get(name, fallback)

    def max_tokens(self, requested: int | None) -> int | None:
        max_tokens = self.params.get("max_tokens") if requested is None else requested
        if self.max_tokens_cap is not None:
            max_tokens = self.max_tokens_cap if max_tokens is None else min(max_tokens, self.max_tokens_cap)
        return max_tokens
