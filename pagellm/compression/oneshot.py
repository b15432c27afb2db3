"""`pagellm quantize`: an HF checkpoint's linear layers rounded by GPTQ (or to nearest) into a compressed-tensors
checkpoint, the format llm-compressor's `oneshot` writes and pagellm and vLLM both load.

Calibration needs text the model would read. Without a file of it, the model writes its own: samples from its
start token at temperature 1 (data-free calibration, as LLM-QAT does), drawn by pagellm's engine. The decoder
layers are quantized in order (llm-compressor's sequential pipeline): each layer's input Hessians are gathered
from the calibration batch's hidden states as the earlier layers, already rounded, left them, so the errors GPTQ
compensates include those the earlier layers made, and only one layer's Hessians are held at a time.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pagellm.compression.arguments import SCHEMES, QuantizeArgs, Scheme
from pagellm.compression.gptq import RoundedWeight, WeightGrid, gptq, round_to_nearest
from pagellm.layers.quantization.compressed_tensors import target_matches
from pagellm.layers.quantization.nvfp4 import E2M1_MAGNITUDES
from pagellm.models.loader import checkpoint_files
from pagellm.ops.wna16 import pack_rows

logger = logging.getLogger(__name__)

COMPRESSED_TENSORS_VERSION = "0.20.0"


def quantize(args: QuantizeArgs) -> Path:
    """Writes the quantized checkpoint to args.output and returns its path."""
    args.check()
    source, output = Path(args.model), Path(args.output)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} is not an HF checkpoint directory (no config.json); pagellm quantize "
                                "takes a safetensors checkpoint, not a GGUF file")
    if not checkpoint_files(source):
        raise FileNotFoundError(f"{source} holds no .safetensors weights; pagellm quantize reads safetensors "
                                "checkpoints")
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} exists and is not empty; name a new directory")
    scheme = SCHEMES[args.scheme]
    started = time.perf_counter()
    grid = WeightGrid(scheme.kind, scheme.bits, args.group_size or scheme.group_size, _scale_dtype(source),
                      scheme.symmetric)
    _check_shapes(source, grid, args.ignore)
    calibration = calibration_batch(args) if args.method == "gptq" else None
    model = _float32_model(source)
    rounded = quantize_model(model, grid, args, calibration)
    dense = sorted(name for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and name not in rounded)
    _write(source, output, scheme, grid, rounded, dense)
    logger.info("quantize: %d linear layers of %s to %s by %s in %.1f s into %s", len(rounded), source,
                scheme.name, args.method, time.perf_counter() - started, output)
    return output


# ---- calibration ------------------------------------------------------------------------------------------------


def calibration_batch(args: QuantizeArgs) -> torch.Tensor:
    """[num_samples, sample_length] token ids: windows of the calibration files' text, or the model's samples."""
    if args.calibration_files:
        return _text_windows(args)
    return _model_samples(args)


def _text_windows(args: QuantizeArgs) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = "\n\n".join(Path(path).read_text() for path in args.calibration_files)
    ids = tokenizer(text).input_ids
    windows = len(ids) // args.sample_length
    if windows == 0:
        raise ValueError(f"the calibration files hold {len(ids)} tokens, fewer than sample_length="
                         f"{args.sample_length}; give more text or a smaller sample_length")
    count = min(windows, args.num_samples)
    if count < args.num_samples:
        logger.warning("quantize: the calibration files give %d windows of %d tokens, not num_samples=%d",
                       count, args.sample_length, args.num_samples)
    return torch.tensor(ids[:count * args.sample_length]).view(count, args.sample_length)


def _model_samples(args: QuantizeArgs) -> torch.Tensor:
    from pagellm import LLM, SamplingParams

    llm = LLM(args.model, seed=args.seed, max_model_len=args.sample_length,
              max_num_seqs=min(args.num_samples, 64))
    try:
        start = _start_token(llm)
        # One request per sample, each seeded: no limit on n, and a sample does not depend on the batch it ran in.
        params = [SamplingParams(temperature=1.0, top_p=1.0, seed=args.seed * 1_000_003 + i,
                                 max_tokens=args.sample_length - 1, ignore_eos=True) for i in range(args.num_samples)]
        outputs = llm.generate([{"prompt_token_ids": [start]}] * args.num_samples, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return torch.tensor([[start, *output.outputs[0].token_ids] for output in outputs])


def _start_token(llm) -> int:
    """The token a document starts with: the tokenizer's BOS, else its EOS (which separates documents in
    training text where there is no BOS)."""
    tokenizer = llm.get_tokenizer()
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    raise ValueError("the tokenizer has neither a BOS nor an EOS token to start calibration samples from; pass "
                     "--calibration-file")


# ---- the layers, in order -----------------------------------------------------------------------------------------


class _StopForward(Exception):
    """Raised after the last decoder layer: the final norm and the LM head need not run."""


def _float32_model(source: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()


def _check_shapes(source: Path, grid: WeightGrid, ignore: list[str]) -> None:
    """Refusals read from the model's skeleton on the meta device, before minutes of calibration: weights the
    decoder layers hold outside linear layers (a mixture of experts' stacked experts, which this tool does not
    round, while the written config would say every linear layer is quantized), and a group size that does not
    divide a layer's inputs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(source)))
    names = {module: name for name, module in skeleton.named_modules()}
    for module in decoder_layers(skeleton).modules():
        if isinstance(module, torch.nn.Linear):
            if not _ignored(names[module], ignore):
                try:
                    grid.check(module.in_features)
                except ValueError as exc:
                    raise ValueError(f"{names[module]}: {exc}") from None
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.dim() >= 2:
                raise ValueError(f"{names[module]}.{name} {list(parameter.shape)} is a weight outside any linear "
                                 f"layer ({type(module).__name__}); pagellm quantize writes dense models only "
                                 "(mixtures of experts: llm-compressor)")


def _scale_dtype(source: Path) -> torch.dtype:
    """Scales are stored in the checkpoint's own float dtype, as llm-compressor stores them (the config's: the
    loaded float32 model's config says float32)."""
    config = json.loads((source / "config.json").read_text())
    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"), None)
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: its largest ModuleList holding linear layers."""
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)
              and any(isinstance(sub, torch.nn.Linear) for sub in m.modules())]
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no list of layers holding linear layers to quantize")
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()))


def _ignored(name: str, ignore: list[str]) -> bool:
    """An --ignore entry as compressed-tensors matches one (target_matches: "re:" + a regular expression, a whole
    name, or the class name "Linear"), or a name's last part."""
    return any(target_matches(entry, name) or name.endswith("." + entry) for entry in ignore)


def quantize_model(model: torch.nn.Module, grid: WeightGrid, args: QuantizeArgs,
                   calibration: torch.Tensor | None) -> dict[str, RoundedWeight]:
    """Every linear layer of the decoder stack not ignored, rounded in place (the model then computes with the
    rounded weights); returns module name -> its codes, scales and zero points."""
    names = {module: name for name, module in model.named_modules()}
    layers = decoder_layers(model)
    calls = _layer_calls(model, layers, calibration, args.batch_size) if calibration is not None else None
    rounded: dict[str, RoundedWeight] = {}
    for index, layer in enumerate(layers):
        linears = {names[m]: m for m in layer.modules()
                   if isinstance(m, torch.nn.Linear) and not _ignored(names[m], args.ignore)}
        hessians = _layer_hessians(layer, index, linears, calls) if calls is not None and linears else {}
        grids = _nvfp4_grids(grid, linears) if grid.kind == "nvfp4" else dict.fromkeys(linears, grid)
        for name, module in linears.items():
            weight = module.weight.data
            if name in hessians:
                result = gptq(weight, hessians.pop(name), grids[name], args.dampening_frac, args.block_size)
            else:
                result = round_to_nearest(weight, grids[name])
            module.weight.data = result.dequantize().to(weight.dtype)
            rounded[name] = result
        if calls is not None:
            calls.advance(layer, index)
        logger.info("quantize: layer %d: %d linear layers rounded", index, len(linears))
    if not rounded:
        raise ValueError("no linear layer is left to quantize (all ignored?)")
    return rounded


# Layers a fused kernel reads as one (vLLM's qkv_proj and gate_up_proj): llm-compressor gives their NVFP4 weights
# one global scale, the smallest of theirs, so that checkpoints load where a fused layer takes one.
FUSED_SHARDS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _nvfp4_grids(grid: WeightGrid, linears: dict[str, torch.nn.Linear]) -> dict[str, WeightGrid]:
    """Each layer's NVFP4 grid, its global scale shared with the shards it is fused with."""
    groups: dict[str, list[str]] = {}
    for name in linears:
        parent, _, last = name.rpartition(".")
        fused = next((shards for shards in FUSED_SHARDS if last in shards), None)
        groups.setdefault(f"{parent}.{fused}" if fused else name, []).append(name)
    grids = {}
    for members in groups.values():
        shared = grid.with_global_scale([linears[name].weight.data for name in members])
        grids.update(dict.fromkeys(members, shared))
    return grids


@dataclass
class _LayerCalls:
    """The calibration batches' hidden states at the current layer's input, and the other arguments the model
    passed each layer in each batch's run (masks, position embeddings), so that each layer runs twice in all (to
    gather its Hessians, then rounded, to make the next layer's inputs) instead of the model running up to it for
    every layer."""

    hidden: list[torch.Tensor]
    arguments: list[list[tuple[tuple, dict]]]  # [batch][layer] -> (args after the hidden states, kwargs)

    def run(self, layer: torch.nn.Module, index: int) -> Iterator[torch.Tensor]:
        for hidden, arguments in zip(self.hidden, self.arguments):
            args, kwargs = arguments[index]
            output = layer(hidden, *args, **kwargs)
            yield output[0] if isinstance(output, tuple) else output

    def advance(self, layer: torch.nn.Module, index: int) -> None:
        with torch.no_grad():
            self.hidden = list(self.run(layer, index))


def _layer_calls(model: torch.nn.Module, layers: torch.nn.ModuleList, calibration: torch.Tensor,
                 batch_size: int) -> _LayerCalls:
    """One run of the model over the calibration batches, stopped after its last decoder layer, recording what
    each layer was called with."""
    hidden: list[torch.Tensor] = []
    arguments: list[list[tuple[tuple, dict]]] = []

    def record(index: int):
        def hook(_module, args, kwargs):
            kwargs = dict(kwargs)
            state = args[0] if args else kwargs.pop("hidden_states")
            if index == 0:
                hidden.append(state)
                arguments.append([])
            arguments[-1].append((tuple(args[1:]), kwargs))
        return hook

    def stop(_module, _inputs, _output):
        raise _StopForward

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(stop))
    try:
        with torch.no_grad():
            for batch in _batches(calibration, batch_size):
                try:
                    model(batch, use_cache=False)
                except _StopForward:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    if any(len(per_layer) != len(layers) for per_layer in arguments):
        raise ValueError(f"{type(model).__name__} did not call each of its {len(layers)} decoder layers once per "
                         "batch; pagellm quantize cannot calibrate it layer by layer")
    return _LayerCalls(hidden, arguments)


def _layer_hessians(layer: torch.nn.Module, index: int, linears: dict[str, torch.nn.Linear],
                    calls: _LayerCalls) -> dict[str, torch.Tensor]:
    """E[x x^T] of each linear layer's inputs over the calibration batches (float64). Layers reading the same
    input (q, k and v) share one product."""
    sums = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in linears.items()}
    counts = dict.fromkeys(linears, 0)
    last: list = [None, None]  # the previous input seen and its x^T x

    def gather(name: str):
        def hook(_module, inputs):
            x = inputs[0]
            if last[0] is not x:
                rows = x.reshape(-1, x.shape[-1]).float()
                last[0], last[1] = x, (rows.T @ rows).double()
            sums[name] += last[1]
            counts[name] += x.numel() // x.shape[-1]
        return hook

    handles = [m.register_forward_pre_hook(gather(name)) for name, m in linears.items()]
    try:
        with torch.no_grad():
            for _ in calls.run(layer, index):
                pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: total / counts[name] for name, total in sums.items() if counts[name]}


def _batches(ids: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, ids.shape[0], size):
        yield ids[start:start + size]


# ---- the checkpoint ---------------------------------------------------------------------------------------------


def compressed_tensors_config(scheme: Scheme, grid: WeightGrid, ignore: list[str]) -> dict:
    """quantization_config as compressed-tensors' QuantizationConfig serializes it."""
    def args(strategy: str, group_size: int | None, dynamic: bool, symmetric: bool = True) -> dict:
        return {"num_bits": scheme.bits, "type": scheme.kind, "symmetric": symmetric, "group_size": group_size,
                "strategy": strategy, "block_structure": None, "dynamic": dynamic, "actorder": None,
                "zp_dtype": None if symmetric else "torch.int8", "observer": None if dynamic else "minmax",
                "observer_kwargs": {}}

    weights = args("group" if grid.group_size else "channel", grid.group_size, False, scheme.symmetric)
    if scheme.kind == "nvfp4":  # compressed-tensors' NVFP4A16 preset
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": grid.group_size,
                   "strategy": "tensor_group", "dynamic": False, "scale_dtype": "torch.float8_e4m3fn",
                   "observer": "minmax", "observer_kwargs": {}}
    activations = args("token", None, True) if scheme.activations else None
    return {"quant_method": "compressed-tensors", "format": scheme.format, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None,
                                          "format": scheme.format}},
            "ignore": list(ignore), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None, "version": COMPRESSED_TENSORS_VERSION}


def module_tensors(rounded: RoundedWeight, scheme: Scheme) -> dict[str, torch.Tensor]:
    """One module's tensors in the scheme's format (suffix -> tensor)."""
    if scheme.kind == "nvfp4":
        return nvfp4_tensors(rounded)
    scales = rounded.scales.to(rounded.grid.scale_dtype)
    if scheme.format == "pack-quantized":
        # compressed-tensors' pack_to_int32: signed codes + 2^(bits - 1), the first value of a word in its low bits;
        # weights packed along the inputs, zero points along the outputs (pack_rows packs down a column).
        offset = 1 << (scheme.bits - 1)
        tensors = {"weight_packed": pack_rows((rounded.codes + offset).t(), scheme.bits).t().contiguous(),
                   "weight_scale": scales,
                   "weight_shape": torch.tensor(list(rounded.codes.shape), dtype=torch.int64)}
        if not scheme.symmetric:
            tensors["weight_zero_point"] = pack_rows(rounded.zeros + offset, scheme.bits)
        return tensors
    dtype = torch.float8_e4m3fn if scheme.kind == "float" else torch.int8
    return {"weight": rounded.codes.to(dtype), "weight_scale": scales}


def nvfp4_tensors(rounded: RoundedWeight) -> dict[str, torch.Tensor]:
    """An NVFP4 weight as compressed-tensors' nvfp4-pack-quantized stores it: e2m1 codes two to a byte (weight 2i
    in the low nibble, the sign in bit 3), each group's fp8 scale (the grid's scale times the global scale, which
    gives back the fp8 value it was divided from: float32 holds the quotient to 2^-24, fp8 steps are 2^-3) and the
    global scale."""
    global_scale = rounded.grid.global_scale
    # the codes are e2m1 values: each magnitude's index among them is its 3-bit code
    magnitude = torch.searchsorted(torch.tensor(E2M1_MAGNITUDES), rounded.codes.abs()).to(torch.uint8)
    codes = magnitude | (torch.signbit(rounded.codes).to(torch.uint8) << 3)  # -0 too, as compressed-tensors packs it
    return {"weight_packed": (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(),
            "weight_scale": (rounded.scales * global_scale).to(torch.float8_e4m3fn),
            "weight_global_scale": torch.tensor([global_scale], dtype=torch.float32)}


def _source_tensors(source: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(source):  # the index's files where there is one (not a consolidated copy too)
        tensors.update(load_file(path))
    return tensors


def _write(source: Path, output: Path, scheme: Scheme, grid: WeightGrid, rounded: dict[str, RoundedWeight],
           dense: list[str]) -> None:
    """The checkpoint: the rounded modules' tensors in the scheme's format, every other tensor as the source has
    it, the config's `ignore` naming each linear layer left dense (whole names, which every loader matches)."""
    from safetensors.torch import save_file

    tensors = _source_tensors(source)
    for name, weight in rounded.items():
        if f"{name}.weight" not in tensors:
            raise ValueError(f"the checkpoint names no tensor {name}.weight for transformers' module {name}; "
                             "pagellm quantize needs checkpoints whose tensor names are the module names")
        del tensors[f"{name}.weight"]
        tensors.update({f"{name}.{suffix}": t for suffix, t in module_tensors(weight, scheme).items()})
    output.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix not in (".safetensors", ".bin", ".pt", ".pth") \
                and path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(path, output / path.name)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(output / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = compressed_tensors_config(scheme, grid, dense)
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
