"""BPE tokenizers of the two common pipelines (SentencePiece-style byte fallback, Gemma's; GPT-2-style byte
level, SmolLM2's) held in flat arrays instead of `tokenizers`' maps.

HuggingFace's Rust tokenizer keeps a vocabulary in hash maps of owned strings both ways and its merges in a
third map, which for Gemma 3's 262k tokens weighs as much as a good part of the quantized model (README, "Memory",
has the figures). Here the vocabulary is one byte string with offsets and an open-addressing index, the merges a
table sorted by left token (C binary search, csrc/bpe.c). `CompactBPETokenizer` encodes and decodes with them
without importing transformers, and becomes a transformers tokenizer (compact_bpe_hf.py, a PythonBackend over the
same tables) for the rest of that interface; the tests hold both equal to the fast tokenizer, token for token, on
the real Gemma 3 vocabulary.

Only tokenizer.json files of exactly these pipelines are taken (`compact_spec`), else the caller keeps the fast
tokenizer. Byte fallback: normalizer Replace(" ", "\u2581"); no pre-tokenizer, or a Split on " " (which, after
that replacement, never splits); a BPE model with fuse_unk and byte_fallback; decoder Replace("\u2581", " "),
ByteFallback, Fuse. Byte level: no normalizer; pre-tokenizer ByteLevel with its regex and no prefix space (each
word's UTF-8 bytes as GPT-2's printable characters), or an isolating regex Split before a ByteLevel that does not
split (Llama 3's, Qwen's); a BPE model without byte fallback, with or without ignore_merges; decoder ByteLevel. Both: a BPE model with no dropout, prefixes or suffixes, and a
post-processor that prepends BOS or nothing.
"""

from __future__ import annotations

import array
import copy
import ctypes
import functools
import json
import logging
import os
import pathlib
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import regex

from pagellm.tokenization.chat_render import render_chat

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).with_name("csrc")
_SPACE_MARK = "\u2581"
_TABLES_FILE = "compact_bpe.tables"
_META_FILE = "compact_bpe.json"
# Written into the metadata; tables of another format are rebuilt (and pipelines judged unsupported judged again).
_FORMAT = 4
# Where each array starts in the tables file: a multiple of this.
_ARRAY_ALIGNMENT = 64
_BYTE_FALLBACK, _BYTE_LEVEL = "byte_fallback", "byte_level"
# The pipeline pieces compact_spec accepts, as tokenizer.json writes them.
_NORMALIZER = {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE_MARK}
_NO_OP_SPLIT = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
_DECODER = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": _SPACE_MARK}, "content": " "},
                                             {"type": "ByteFallback"}, {"type": "Fuse"}]}
# tokenizers' ByteLevel pre-tokenizer regex (pre_tokenizers/byte_level.rs).
_GPT2_WORDS = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _byte_level_chars() -> list[str]:
    """GPT-2's character for each byte: printable Latin-1 bytes stand for themselves, the others for 256 + i."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    chars, extra = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


_BYTE_CHARS = _byte_level_chars()
# str.translate from a text's UTF-8 bytes read as Latin-1 (one character a byte) to their byte-level characters.
_TO_BYTE_CHARS = {byte: char for byte, char in enumerate(_BYTE_CHARS)}
_FROM_BYTE_CHARS = {char: byte for byte, char in enumerate(_BYTE_CHARS)}


class _Model(ctypes.Structure):
    _fields_ = [("token_bytes", ctypes.c_void_p), ("token_offsets", ctypes.c_void_p), ("n_tokens", ctypes.c_int32),
                ("slots", ctypes.c_void_p), ("n_slots", ctypes.c_int64), ("merge_offsets", ctypes.c_void_p),
                ("merge_right", ctypes.c_void_p), ("merge_rank", ctypes.c_void_p), ("merge_result", ctypes.c_void_p),
                ("byte_tokens", ctypes.c_void_p), ("unk_id", ctypes.c_int32)]


def _library() -> ctypes.CDLL:
    from pagellm.ops.cpu_build import build_library

    library = ctypes.CDLL(str(build_library("pagellm_bpe", [_CSRC / "bpe.c"], [], ["-O2", "-fPIC"])))
    library.bpe_build_index.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                                        ctypes.c_int64]
    library.bpe_build_index.restype = None
    library.bpe_encode_pieces.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int32, ctypes.c_void_p]
    library.bpe_encode_pieces.restype = ctypes.c_int64
    library.bpe_lookup.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]
    library.bpe_lookup.restype = ctypes.c_int32
    library.bpe_decode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p]
    library.bpe_decode.restype = ctypes.c_int64
    return library


@dataclass
class BpeTables:
    """The vocabulary and merges as arrays; read-only once built, so copies of a tokenizer share them. Loaded from
    a converted directory they are views of the mapped tables file: a page is read as a lookup first needs it
    (decoding reads only the generated tokens' bytes, encoding the merges of the text's tokens)."""

    token_bytes: np.ndarray  # uint8: every token's UTF-8, back to back
    token_offsets: np.ndarray  # int32 [V + 1]
    merge_offsets: np.ndarray  # int32 [V + 1]: merges by left token
    merge_right: np.ndarray  # int32 [M], ascending within each left token's row
    merge_rank: np.ndarray  # int32 [M]
    merge_result: np.ndarray  # int32 [M]
    byte_tokens: np.ndarray  # int32 [256]: the <0xXX> token of each byte (byte level: all -1)
    byte_values: np.ndarray  # int16 [V]: the byte a <0xXX> token stands for, or -1
    # Byte level: each token's bytes as its decoder gives them, back to back (empty for byte fallback).
    raw_bytes: np.ndarray  # uint8
    raw_offsets: np.ndarray  # int64 [V + 1], or [1]
    unk_id: int
    # The tokens' open-addressing index (csrc/bpe.c), built from the vocabulary where not given.
    slots: np.ndarray | None = None  # int32, a power of two at least twice V
    max_token_bytes: int = 0  # the longest token's bytes (at least 3); computed where 0

    ARRAYS = ("token_bytes", "token_offsets", "merge_offsets", "merge_right", "merge_rank", "merge_result",
              "byte_tokens", "byte_values", "raw_bytes", "raw_offsets")

    def __post_init__(self) -> None:
        self.library = _library()
        n_tokens = len(self.token_offsets) - 1
        if self.slots is None:
            self.slots = np.full(1 << max(4, (2 * n_tokens - 1).bit_length()), -1, dtype=np.int32)
            self.library.bpe_build_index(self.token_bytes.ctypes.data, self.token_offsets.ctypes.data, n_tokens,
                                         self.slots.ctypes.data, len(self.slots))
        self.model = _Model(self.token_bytes.ctypes.data, self.token_offsets.ctypes.data, n_tokens,
                            self.slots.ctypes.data, len(self.slots), self.merge_offsets.ctypes.data,
                            self.merge_right.ctypes.data, self.merge_rank.ctypes.data, self.merge_result.ctypes.data,
                            self.byte_tokens.ctypes.data, self.unk_id)
        if not self.max_token_bytes:
            self.max_token_bytes = max(3, int(np.diff(self.token_offsets).max(initial=0)))
        # Addresses looked up once: numpy's .ctypes and ctypes.byref are slow next to a short decode.
        self.model_address = ctypes.addressof(self.model)
        self.byte_values_address = self.byte_values.ctypes.data
        # Byte level decoding slices Python bytes: fast next to numpy's per-element indexing. The arrays become
        # views of them, one copy of each.
        self._raw = self.raw_bytes.tobytes()
        self.raw_bytes = np.frombuffer(self._raw, dtype=np.uint8)
        self._raw_offsets = array.array("q", self.raw_offsets.tobytes())
        self.raw_offsets = np.frombuffer(self._raw_offsets, dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        # The ctypes handles are rebuilt on unpickling, from the arrays.
        return {name: getattr(self, name) for name in (*self.ARRAYS, "slots", "unk_id", "max_token_bytes")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def vocab_size(self) -> int:
        return len(self.token_offsets) - 1

    def token(self, token_id: int) -> str:
        return self.token_bytes[self.token_offsets[token_id]:self.token_offsets[token_id + 1]].tobytes().decode()

    def lookup(self, token: str) -> int:
        """The id of `token`, or -1."""
        data = token.encode()
        return self.library.bpe_lookup(self.model_address, data, len(data))

    def encode(self, pieces: list[str], ignore_merges: bool = False) -> list[int]:
        """The ids of normalized, pre-tokenized text, each piece merged on its own (a byte-level word is already
        its bytes' characters; byte fallback's normalized text is one piece)."""
        encoded = [piece.encode() for piece in pieces]
        data = b"".join(encoded)
        ends = np.cumsum([len(word) for word in encoded], dtype=np.int64)
        out = np.empty(len(data), dtype=np.int32)
        count = self.library.bpe_encode_pieces(self.model_address, data, ends.ctypes.data, len(encoded),
                                               int(ignore_merges), out.ctypes.data)
        if count < 0:
            raise MemoryError(f"out of memory encoding a {len(data)}-byte text")
        return out[:count].tolist()

    def raw_token(self, token_id: int) -> bytes:
        """A byte-level token's bytes as the decoder gives them."""
        return self._raw[self._raw_offsets[token_id]:self._raw_offsets[token_id + 1]]

    def decode_byte_level(self, ids: list[int], skip: bytes | None) -> str:
        """The text of byte-level ids below vocab_size, leaving out those whose flag in `skip` is set."""
        raw, offsets = self._raw, self._raw_offsets
        return b"".join([raw[offsets[i]:offsets[i + 1]] for i in ids if skip is None or not skip[i]]).decode(
            "utf-8", "replace")

    def decode(self, ids: list[int], skip_address: int | None) -> str:
        """The text of ids below vocab_size, leaving out those marked in the bool array per id at `skip_address`
        (its .ctypes.data, kept by the caller: numpy's lookup of it is slow next to a short decode); see
        csrc/bpe.c."""
        n = len(ids)
        id_array = array.array("i", ids)
        out = ctypes.create_string_buffer(n * self.max_token_bytes)
        length = self.library.bpe_decode(self.model_address, self.byte_values_address,
                                         skip_address, id_array.buffer_info()[0], n, out)
        if length < 0:
            raise MemoryError(f"out of memory decoding {n} tokens")
        return out.raw[:length].decode("utf-8")

    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in self.ARRAYS) + self.slots.nbytes

    def save(self, path: pathlib.Path) -> dict[str, Any]:
        """Write the arrays back to back (each aligned) to `path`; returns what `load` needs beside the file."""
        index, offset = {}, 0
        with open(path, "wb") as handle:
            for name in (*self.ARRAYS, "slots"):
                values = np.ascontiguousarray(getattr(self, name))
                padding = -offset % _ARRAY_ALIGNMENT
                handle.write(bytes(padding))
                offset += padding
                index[name] = {"dtype": values.dtype.str, "shape": list(values.shape), "offset": offset}
                handle.write(values.tobytes())
                offset += values.nbytes
        return {"arrays": index, "unk_id": self.unk_id, "max_token_bytes": self.max_token_bytes}

    @classmethod
    def load(cls, path: pathlib.Path, saved: dict[str, Any]) -> BpeTables:
        """The tables `save` wrote, as read-only views of the mapped file."""
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        arrays = {}
        for name, spec in saved["arrays"].items():
            dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
            end = spec["offset"] + dtype.itemsize * int(np.prod(shape))
            if end > len(mapped):
                raise ValueError(f"{path} ends at byte {len(mapped)}, before its array {name!r} (to byte {end})")
            arrays[name] = mapped[spec["offset"]:end].view(dtype).reshape(shape)
        return cls(**arrays, unk_id=saved["unk_id"], max_token_bytes=saved["max_token_bytes"])

    @classmethod
    def from_model(cls, model: dict[str, Any], pipeline: str = _BYTE_FALLBACK) -> BpeTables:
        """From tokenizer.json's "model" (a BPE): the vocabulary must number its tokens 0..V-1."""
        vocab: dict[str, int] = model["vocab"]
        strings: list[str | None] = [None] * len(vocab)
        for token, token_id in vocab.items():
            if not 0 <= token_id < len(strings) or strings[token_id] is not None:
                raise ValueError(f"the vocabulary's ids are not 0..{len(vocab) - 1} (token {token!r}: {token_id})")
            strings[token_id] = token
        encoded = [token.encode() for token in strings]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(token) for token in encoded], out=offsets[1:])
        if offsets[-1] >= 2**31 or len(model["merges"]) >= 2**31:
            raise ValueError("a vocabulary of 2 GiB or more, or 2**31 merges: beyond the tables' int32 offsets")
        left, right, result = _merge_ids(model["merges"], vocab)
        # Sorted by (left, right, rank); of a pair listed twice the later rank wins, as in tokenizers' merge map.
        order = np.lexsort((np.arange(len(left)), right, left))
        left, right, rank, result = left[order], right[order], order.astype(np.int32), result[order]
        last = np.ones(len(left), dtype=bool)
        last[:-1] = (left[1:] != left[:-1]) | (right[1:] != right[:-1])
        left, right, rank, result = left[last], right[last], rank[last], result[last]
        byte_values = np.full(len(encoded), -1, dtype=np.int16)
        raw_offsets = np.zeros(1, dtype=np.int64)
        raw_bytes = np.zeros(0, dtype=np.uint8)
        if pipeline == _BYTE_LEVEL:
            # No byte fallback: a character the vocabulary lacks (bytes valid UTF-8 never holds, in some) is the
            # unknown token, or dropped where there is none, as tokenizers' BPE does.
            byte_tokens = np.full(256, -1, dtype=np.int32)
            raw = [_byte_level_bytes(token) for token in strings]
            raw_offsets = np.zeros(len(raw) + 1, dtype=np.int64)
            np.cumsum([len(token) for token in raw], out=raw_offsets[1:])
            raw_bytes = np.frombuffer(b"".join(raw), dtype=np.uint8).copy()
        else:
            byte_tokens = np.array([vocab.get(f"<0x{b:02X}>", -1) for b in range(256)], dtype=np.int32)
            if (byte_tokens < 0).any():
                raise ValueError("the vocabulary lacks some of the 256 <0xXX> byte tokens byte fallback needs")
            for token_id, token in enumerate(encoded):
                byte = _fallback_byte(token)
                if byte is not None:
                    byte_values[token_id] = byte
        unk = model.get("unk_token")
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), offsets.astype(np.int32),
                   np.searchsorted(left, np.arange(len(encoded) + 1)).astype(np.int32), right, rank, result,
                   byte_tokens, byte_values, raw_bytes, raw_offsets, vocab.get(unk, -1) if unk is not None else -1)


def _merge_ids(merges: list, vocab: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    left, right, result = (np.empty(len(merges), dtype=np.int32) for _ in range(3))
    for i, merge in enumerate(merges):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise ValueError(f"merge {i} ({a!r}, {b!r}) names a token the vocabulary lacks")
        left[i], right[i], result[i] = vocab[a], vocab[b], vocab[a + b]
    return left, right, result


def _byte_level_bytes(token: str) -> bytes:
    """A token's bytes as tokenizers' ByteLevel decoder gives them: each character's byte, or, where some
    character is not one of the 256, the token's own UTF-8."""
    try:
        return bytes(_FROM_BYTE_CHARS[char] for char in token)
    except KeyError:
        return token.encode()


def _fallback_byte(token: bytes) -> int | None:
    """The byte a <0xXX> token stands for, as tokenizers' ByteFallback decoder reads it."""
    if len(token) != 6 or not token.startswith(b"<0x") or not token.endswith(b">"):
        return None
    try:
        return int(token[3:5], 16)
    except ValueError:
        return None


def compact_spec(tokenizer: dict[str, Any]) -> dict[str, Any] | None:
    """What the compact tokenizer needs from a tokenizer.json beside its model, or None where its pipeline is
    not one of those this module implements."""
    model = tokenizer.get("model") or {}
    if (model.get("type") != "BPE" or model.get("dropout") not in (None, 0.0)
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")):
        return None
    pipeline = _pipeline_of(tokenizer, model)
    if pipeline is None:
        return None
    bos = _bos_of(tokenizer.get("post_processor"))
    if bos is False:
        return None
    added = tokenizer.get("added_tokens", [])
    if any(token.get(flag) for token in added for flag in ("normalized", "lstrip", "rstrip", "single_word")):
        return None  # matched after normalization, or eating the whitespace around them: not built
    words = _byte_level_split(tokenizer.get("pre_tokenizer")) if pipeline == _BYTE_LEVEL else None
    if words is not None:
        try:
            regex.compile(words)
        except regex.error:
            return None  # a pattern the regex module does not read as tokenizers' Oniguruma does
    return {"pipeline": pipeline, "ignore_merges": bool(model.get("ignore_merges")), "words": words,
            "bos_token": bos, "added_tokens": added}


def _pipeline_of(tokenizer: dict[str, Any], model: dict[str, Any]) -> str | None:
    normalizer, pre_tokenizer, decoder = (tokenizer.get(key) for key in ("normalizer", "pre_tokenizer", "decoder"))
    if (normalizer == _NORMALIZER and pre_tokenizer in (None, _NO_OP_SPLIT) and decoder == _DECODER
            and model.get("byte_fallback") and model.get("fuse_unk") and not model.get("ignore_merges")):
        return _BYTE_FALLBACK
    # trim_offsets moves offsets only, never ids; the decoder's flags do nothing when decoding.
    if (normalizer is None and _byte_level_split(pre_tokenizer) is not None
            and isinstance(decoder, dict) and decoder.get("type") == "ByteLevel" and not model.get("byte_fallback")
            and (model.get("unk_token") is None or model.get("fuse_unk"))):  # the C encoder fuses unknowns
        return _BYTE_LEVEL
    return None


def _byte_level_split(pre_tokenizer: Any) -> str | None:
    """The regex that cuts a byte-level pipeline's text into words: ByteLevel's own (GPT-2's), or that of a Split
    (isolated matches) before a ByteLevel that does not split again, as Llama 3's and Qwen's pipelines (and
    transformers' conversion of their GGUF files) have it; None for anything else."""
    def byte_level(step: Any, use_regex: bool) -> bool:
        return (isinstance(step, dict) and step.get("type") == "ByteLevel" and not step.get("add_prefix_space")
                and step.get("use_regex", True) == use_regex)

    if byte_level(pre_tokenizer, True):
        return _GPT2_WORDS
    steps = pre_tokenizer.get("pretokenizers") if isinstance(pre_tokenizer, dict) else None
    if not isinstance(steps, list) or pre_tokenizer.get("type") != "Sequence" or len(steps) != 2:
        return None
    split, last = steps
    if (not byte_level(last, False) or not isinstance(split, dict) or split.get("type") != "Split"
            or split.get("behavior") != "Isolated"
            or split.get("invert") or not isinstance(split.get("pattern"), dict) or "Regex" not in split["pattern"]):
        return None
    return split["pattern"]["Regex"]


def _bos_of(post_processor: dict[str, Any] | None) -> str | None | bool:
    """The special token a TemplateProcessing prepends to a single sequence (None: nothing); False for any other
    post-processor."""
    if post_processor is None:
        return None
    if post_processor.get("type") != "TemplateProcessing":
        return False
    single = post_processor.get("single", [])
    if single == [{"Sequence": {"id": "A", "type_id": 0}}]:
        return None
    if len(single) == 2 and "SpecialToken" in single[0] and single[1] == {"Sequence": {"id": "A", "type_id": 0}}:
        bos = single[0]["SpecialToken"]["id"]
        pair = post_processor.get("pair", [])
        expected_pair = [single[0], single[1], {"SpecialToken": {"id": bos, "type_id": 1}},
                         {"Sequence": {"id": "B", "type_id": 1}}]
        return bos if pair == expected_pair else False
    return False


def load_or_convert(directory: pathlib.Path) -> CompactBPETokenizer | None:
    """The compact tokenizer of a directory holding a fast tokenizer's files, converting them on first use; None
    where its pipeline is not the one this module implements (remembered, so the JSON is read once)."""
    meta = _read_meta(directory)
    if meta is None:
        try:
            convert(directory)
        except OSError:
            return None  # no tokenizer.json, or a read-only cache: the caller keeps the fast tokenizer
        meta = _read_meta(directory)
    if meta is None or not meta["supported"]:
        return None
    return _load(directory, meta)


def convert(directory: pathlib.Path) -> bool:
    """Write the compact tables beside a directory's tokenizer.json, or a note that its pipeline is not
    supported (the return value). Reading the JSON takes a few hundred MiB for a large vocabulary: done once, as
    the fast tokenizer is saved. The note goes last, so a reader that finds it finds the tables."""
    tokenizer = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    spec = compact_spec(tokenizer)
    tables = None
    if spec is not None:
        try:
            tables = BpeTables.from_model(tokenizer["model"], spec["pipeline"])
        except ValueError:
            spec = None
    del tokenizer
    saved = {}
    if tables is not None:
        descriptor, partial = tempfile.mkstemp(dir=directory, suffix=".tables")
        os.close(descriptor)
        saved = {"tables": tables.save(pathlib.Path(partial))}
        os.replace(partial, directory / _TABLES_FILE)
    (directory / "compact_bpe.npz").unlink(missing_ok=True)  # format 3's tables, which nothing reads now
    meta = {"format": _FORMAT, "supported": spec is not None, **(spec or {}), **saved}
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".json", delete=False, encoding="utf-8") as handle:
        json.dump(meta, handle)
    os.replace(handle.name, directory / _META_FILE)
    return spec is not None


def _read_meta(directory: pathlib.Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((directory / _META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if meta.get("format") == _FORMAT else None


def _load(directory: pathlib.Path, spec: dict[str, Any]) -> CompactBPETokenizer:
    tables = BpeTables.load(directory / _TABLES_FILE, spec["tables"])
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = directory / "chat_template.jinja"
    chat_template = template.read_text(encoding="utf-8") if template.is_file() else config.get("chat_template")
    return CompactBPETokenizer(tables, spec, config, chat_template, source_directory=directory)


class AddedTokenIndex:
    """A tokenizer's added tokens: their text, which of them are special, and where a text splits at them: at the
    leftmost match, the longest token there, as tokenizers' matcher splits. Never changed once built (a tokenizer
    that adds tokens builds another), so copies of a tokenizer share it."""

    def __init__(self, vocab_size: int, tokens: Iterable[tuple[int, str, bool]]) -> None:
        self.content: dict[int, str] = {}
        self.special: dict[int, bool] = {}
        self.ids: dict[str, int] = {}
        for token_id, content, special in tokens:
            self.content[token_id], self.special[token_id] = content, special
            self.ids[content] = token_id
        # The total number of ids: the vocabulary's, and any added beyond it.
        self.size = max([vocab_size - 1, *self.content]) + 1
        # Per vocabulary id, whether it is special: an array for the C decoder, the same flags as bytes for
        # byte-level decoding.
        self.special_mask = np.zeros(vocab_size, dtype=bool)
        self.special_mask[[i for i, special in self.special.items() if special and i < vocab_size]] = True
        self._prepare()

    def _prepare(self) -> None:
        # Addresses looked up once: numpy's .ctypes is slow next to a short decode.
        self.special_mask_address = self.special_mask.ctypes.data
        self.special_flags = self.special_mask.tobytes()
        self._matchers: dict[bool, tuple[dict, Any] | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {key: self.__dict__[key] for key in ("content", "special", "ids", "size", "special_mask")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._prepare()

    def split(self, text: str, split_special_tokens: bool) -> list[str | int]:
        """`text` cut at its added tokens: each match as its id, the text between as strings (no empty ones).
        With split_special_tokens, special tokens are text and only the others are matched."""
        matcher = self._matcher(split_special_tokens)
        if matcher is None:
            return [text] if text else []
        trie, starts = matcher
        pieces: list[str | int] = []
        end = position = 0
        while (found := starts.search(text, position)) is not None:
            start = found.start()
            node, longest = trie, None
            for index in range(start, len(text)):
                node = node.get(text[index])
                if node is None:
                    break
                if None in node:
                    longest = index + 1
            if longest is None:
                position = start + 1
                continue
            if start > end:
                pieces.append(text[end:start])
            pieces.append(self.ids[text[start:longest]])
            end = position = longest
        if end < len(text):
            pieces.append(text[end:])
        return pieces

    def _matcher(self, plain_only: bool) -> tuple[dict, Any] | None:
        """A character trie of the tokens matched (None marks where one ends), and a regex finding where one may
        start; None where there are none."""
        if plain_only not in self._matchers:
            trie: dict = {}
            for token_id, content in self.content.items():
                if not content or (plain_only and self.special[token_id]):
                    continue
                node = trie
                for char in content:
                    node = node.setdefault(char, {})
                node[None] = True
            # Each first character by its code point: no character can close or negate the set.
            self._matchers[plain_only] = (trie, regex.compile(
                "[" + "".join(f"\\U{ord(char):08x}" for char in sorted(trie)) + "]")) if trie else None
        return self._matchers[plain_only]


class BpeCodec:
    """Text to ids and back through a BpeTables, around a tokenizer's added tokens (an AddedTokenIndex)."""

    def __init__(self, tables: BpeTables, spec: dict[str, Any]) -> None:
        self.tables = tables
        self.pipeline: str = spec["pipeline"]
        self.ignore_merges: bool = spec["ignore_merges"]
        self.words = regex.compile(spec["words"]) if spec.get("words") else None

    def text_ids(self, text: str, added: AddedTokenIndex, split_special_tokens: bool) -> list[int]:
        """The ids of `text` (no BOS): added tokens where they occur, the pipeline's BPE between them. With
        split_special_tokens, special tokens are encoded as text, as the fast tokenizer does."""
        ids: list[int] = []
        for piece in added.split(text, split_special_tokens):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(self._encode_between_added_tokens(piece))
        return ids

    def _encode_between_added_tokens(self, text: str) -> list[int]:
        if self.pipeline == _BYTE_LEVEL:
            words = [word.encode().decode("latin-1").translate(_TO_BYTE_CHARS) for word in self._split_words(text)]
            return self.tables.encode(words, self.ignore_merges)
        return self.tables.encode([text.replace(" ", _SPACE_MARK)])

    def _split_words(self, text: str) -> list[str]:
        """The text cut as an isolating Split cuts it: each match a word, and each stretch between matches."""
        words, end = [], 0
        for match in self.words.finditer(text):
            if match.start() > end:
                words.append(text[end:match.start()])
            if match.end() > match.start():
                words.append(match.group())
            end = match.end()
        if end < len(text):
            words.append(text[end:])
        return words

    def decode(self, ids: list[int], added: AddedTokenIndex, skip_special_tokens: bool = False) -> str:
        """The text of `ids`, special tokens left out with skip_special_tokens (no clean-up of spaces)."""
        if self.pipeline == _BYTE_LEVEL:
            return self._decode_byte_level(ids, added, skip_special_tokens)
        tables = self.tables
        skip = added.special_mask_address if skip_special_tokens else None
        if not ids or (min(ids) >= 0 and max(ids) < tables.vocab_size):
            return tables.decode(ids, skip)
        # Tokens added beyond the vocabulary are not in the tables: each is its text (none is a <0xXX> byte token,
        # which the vocabulary has all of), and the tables decode the runs between them.
        pieces, run = [], []
        for token_id in ids:
            if 0 <= token_id < tables.vocab_size:
                run.append(token_id)
                continue
            content = _added_content(added, token_id)
            if skip_special_tokens and added.special[token_id]:
                continue
            pieces.append(tables.decode(run, skip))
            pieces.append(content.replace(_SPACE_MARK, " "))
            run = []
        pieces.append(tables.decode(run, skip))
        return "".join(pieces)

    def _decode_byte_level(self, ids: list[int], added: AddedTokenIndex, skip_special_tokens: bool) -> str:
        tables, flags = self.tables, added.special_flags
        if not ids or (min(ids) >= 0 and max(ids) < tables.vocab_size):
            return tables.decode_byte_level(ids, flags if skip_special_tokens else None)
        # Tokens added beyond the vocabulary go through the byte-level decoder as their text, as tokenizers does.
        pieces = []
        for token_id in ids:
            if 0 <= token_id < tables.vocab_size:
                if not (skip_special_tokens and flags[token_id]):
                    pieces.append(tables.raw_token(token_id))
                continue
            content = _added_content(added, token_id)
            if not (skip_special_tokens and added.special[token_id]):
                pieces.append(_byte_level_bytes(content))
        return b"".join(pieces).decode("utf-8", "replace")

    def token(self, token_id: int, added: AddedTokenIndex) -> str:
        content = added.content.get(token_id)
        return content if content is not None else self.tables.token(token_id)

    def token_id(self, token: str, added: AddedTokenIndex) -> int:
        """The id of `token` (an added token's, else the vocabulary's), or -1."""
        token_id = added.ids.get(token)
        return token_id if token_id is not None else self.tables.lookup(token)

    def vocab(self, added: AddedTokenIndex) -> dict[str, int]:
        vocab = {self.tables.token(i): i for i in range(self.tables.vocab_size)}
        vocab.update(added.ids)
        return vocab


def _added_content(added: AddedTokenIndex, token_id: int) -> str:
    content = added.content.get(token_id)
    if content is None:
        raise ValueError(f"token id {token_id} is not one of this tokenizer's {added.size} tokens")
    return content


_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template's arguments that change what it returns or marks in the rendered text: transformers' to take.
_RENDERED_BY_TRANSFORMERS = frozenset({"sanitize_control_tokens", "return_assistant_tokens_mask", "return_dict",
                                       "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"})


def _forwarded(method: Callable) -> Callable:
    """A method answered from the tables until the tokenizer has become a transformers tokenizer, by it after."""
    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        full = self._full
        return getattr(full, name)(*args, **kwargs) if full is not None else method(self, *args, **kwargs)

    return call


def _forwarded_property(name: str, native: Callable[[Any], Any]) -> property:
    """A property read from this tokenizer until it has become a transformers tokenizer, from it after; setting it
    makes it one (transformers' setters keep the derived state: ids, special tokens, added tokens)."""
    def get(self):
        full = self._full
        return getattr(full, name) if full is not None else native(self)

    def set_(self, value):
        setattr(self.transformers_tokenizer(), name, value)

    return property(get, set_, doc=f"transformers' {name}")


class CompactBPETokenizer:
    """The tokenizer of a model whose tokenizer.json is one of the pipelines above, over BpeTables: encoding,
    decoding, the vocabulary and the special tokens, without transformers, whose import alone keeps ~20 MiB in the
    process (README, "Memory"). Anything else transformers' tokenizers offer (`__call__` with padding and tensors,
    apply_chat_template, adding tokens, save_pretrained, ...) is answered by the transformers tokenizer over the
    same tables (compact_bpe_hf.py) that this one becomes at its first such use; from then on every call goes to
    it, so the two never hold different added tokens or settings. Both encode and decode as the fast tokenizer
    does, token for token (tests/test_compact_tokenizer.py)."""

    def __init__(self, tables: BpeTables, spec: dict[str, Any], config: dict[str, Any], chat_template: str | None,
                 source_directory: pathlib.Path) -> None:
        self._codec = BpeCodec(tables, spec)
        self._spec, self._config = spec, config
        self._added = AddedTokenIndex(tables.vocab_size, [(token["id"], token["content"], token["special"])
                                                          for token in spec["added_tokens"]])
        # The named special tokens that are set: transformers' special_tokens_map, which chat templates read.
        self._special = {name: _token_text(config[name]) for name in _SPECIAL_TOKEN_NAMES
                         if config.get(name) is not None}
        self._chat_template = chat_template
        self._full = None
        self._lock = threading.Lock()
        self.pipeline = self._codec.pipeline
        self.source_directory = source_directory

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in ("pipeline", "source_directory") or \
                isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)
        else:
            setattr(self.transformers_tokenizer(), name, value)

    def __getattr__(self, name: str) -> Any:
        # Reached for what this class does not define: transformers' tokenizer answers it.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)

    def __call__(self, *args, **kwargs):
        return self.transformers_tokenizer()(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name_or_path={str(self.source_directory)!r}, pipeline={self.pipeline!r}, "
                f"vocab_size={self.vocab_size}, tokens={len(self)}, transformers={self._full is not None})")

    def transformers_tokenizer(self):
        """The transformers tokenizer this one becomes (built once, from the same tables and settings), to which
        every call goes from then on."""
        with self._lock:
            if self._full is None:
                from pagellm.tokenization.compact_bpe_hf import TransformersCompactBPETokenizer

                logger.info("tokenizer: taking transformers' tokenizer interface over the compact tables (chat "
                            "templates, padding, added tokens); importing transformers")
                self._full = TransformersCompactBPETokenizer(self._codec, self._spec, self._config,
                                                             self._chat_template, self.source_directory)
            return self._full

    # ---- copies -----------------------------------------------------------------------------------------

    def __deepcopy__(self, memo: dict) -> CompactBPETokenizer:
        """A copy sharing the tables and added tokens, which are never written; a transformers tokenizer this one
        has become is copied (its settings are its own, its tables shared)."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(self.__dict__)
        clone.__dict__["_lock"] = threading.Lock()
        clone.__dict__["_full"] = copy.deepcopy(self._full, memo)
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    # ---- the vocabulary ---------------------------------------------------------------------------------

    vocab_size = _forwarded_property("vocab_size", lambda self: self._codec.tables.vocab_size)
    chat_template = property(lambda self: self._full.chat_template if self._full is not None else self._chat_template)

    @chat_template.setter
    def chat_template(self, value: str | None) -> None:
        if self._full is not None:
            self._full.chat_template = value
        self._chat_template = value

    clean_up_tokenization_spaces = _forwarded_property(
        "clean_up_tokenization_spaces", lambda self: self._config.get("clean_up_tokenization_spaces", False))
    split_special_tokens = _forwarded_property(
        "split_special_tokens", lambda self: self._config.get("split_special_tokens", False))
    model_max_length = _forwarded_property("model_max_length",
                                           lambda self: self._config.get("model_max_length", int(1e30)))
    name_or_path = _forwarded_property("name_or_path", lambda self: str(self.source_directory))

    def tables_nbytes(self) -> int:
        """Bytes of the vocabulary and merge tables (shared by copies of this tokenizer)."""
        return self._codec.tables.nbytes()

    @_forwarded
    def __len__(self) -> int:
        return self._added.size

    @_forwarded
    def get_vocab(self) -> dict[str, int]:
        return self._codec.vocab(self._added)

    @_forwarded
    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._codec.token_id(token, self._added)
        if token_id >= 0:
            return token_id
        # The configured unknown token's id, as transformers gives; None where that token is not one either.
        unk = self._special.get("unk_token")
        return None if unk is None or token == unk else self._token_id(unk)

    @_forwarded
    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        if skip_special_tokens:
            return self.transformers_tokenizer().convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self._codec.token(ids, self._added)
        return [self._codec.token(int(token_id), self._added) for token_id in ids]

    # ---- encoding ---------------------------------------------------------------------------------------

    @_forwarded
    def encode(self, text, text_pair=None, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if not isinstance(text, str) or text_pair is not None or set(kwargs) - {"split_special_tokens"}:
            full = self.transformers_tokenizer()
            return full.encode(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        ids = self._codec.text_ids(text, self._added, kwargs.get("split_special_tokens", self.split_special_tokens))
        bos = self.bos_token_id if add_special_tokens and self._spec["bos_token"] is not None else None
        return ids if bos is None else [bos, *ids]

    @_forwarded
    def tokenize(self, text: str, **kwargs) -> list[str]:
        if set(kwargs) - {"split_special_tokens"}:
            return self.transformers_tokenizer().tokenize(text, **kwargs)
        split = kwargs.get("split_special_tokens", self.split_special_tokens)
        return self.convert_ids_to_tokens(self._codec.text_ids(text, self._added, split))

    # ---- chat templates ---------------------------------------------------------------------------------

    @_forwarded
    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs):
        """transformers' apply_chat_template; the text of one conversation of plain data is rendered here
        (chat_render.py), the rest (tokenize=True, batches, message objects, ...) by the transformers tokenizer."""
        template = chat_template if chat_template is not None else self.chat_template
        if not tokenize and isinstance(template, str) and not set(kwargs) & _RENDERED_BY_TRANSFORMERS:
            text = render_chat(template, conversation, self._special, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, **kwargs)
            if text is not None:
                return text
        return self.transformers_tokenizer().apply_chat_template(
            conversation, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=tokenize, **kwargs)

    # ---- decoding ---------------------------------------------------------------------------------------

    @_forwarded
    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **kwargs) -> str:
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()  # a tensor or an array, as transformers takes
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif token_ids and isinstance(token_ids[0], (list, tuple)):
            return self.transformers_tokenizer().decode(
                token_ids, skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        text = self._codec.decode([int(i) for i in token_ids], self._added, skip_special_tokens)
        clean = clean_up_tokenization_spaces if clean_up_tokenization_spaces is not None \
            else self.clean_up_tokenization_spaces
        return self.transformers_tokenizer().clean_up_tokenization(text) if clean else text

    @_forwarded
    def batch_decode(self, sequences, **kwargs) -> list[str]:
        return [self.decode(ids, **kwargs) for ids in sequences]

    def decode_ids(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """decode() without its argument handling or clean-up of spaces: the engine's detokenizer calls this
        twice per token per sequence, so it forwards inline (the generic wrapper took a third of its time)."""
        full = self._full
        if full is not None:
            return full.decode_ids(ids, skip_special_tokens)
        return self._codec.decode(ids, self._added, skip_special_tokens)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json gives it: its text, or a serialized AddedToken holding it."""
    return value["content"] if isinstance(value, dict) else str(value)


def _special_token_property(name: str) -> property:
    return _forwarded_property(name, lambda self: self._special.get(name))


def _special_id_property(name: str) -> property:
    return _forwarded_property(f"{name}_id", lambda self: self._token_id(self._special.get(name)))


for _name in _SPECIAL_TOKEN_NAMES:
    setattr(CompactBPETokenizer, _name, _special_token_property(_name))
    setattr(CompactBPETokenizer, f"{_name}_id", _special_id_property(_name))
