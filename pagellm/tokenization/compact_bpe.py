"""BPE tokenizers of the two common pipelines (SentencePiece-style byte fallback, Gemma's; GPT-2-style byte
level, SmolLM2's) held in flat arrays instead of `tokenizers`' maps.

HuggingFace's Rust tokenizer keeps a vocabulary in hash maps of owned strings both ways and its merges in a
third map, which for Gemma 3's 262k tokens weighs as much as a good part of the quantized model (README, "Memory",
has the figures). Here the vocabulary is one byte string with offsets and an open-addressing index, the merges a
table sorted by left token (C binary search, csrc/bpe.c). The class is a transformers tokenizer (PythonBackend), so encode, decode, the chat
template, added and special tokens behave as the fast tokenizer's; the tests hold it equal to that one, token for
token, on the real Gemma 3 vocabulary.

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
import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import regex
from transformers import AddedToken
from transformers.tokenization_python import PythonBackend, Trie

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


class CompactBPETokenizer(PythonBackend):
    """transformers' tokenizer interface over BpeTables (see the module's docstring)."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, tables: BpeTables, spec: dict[str, Any], config: dict[str, Any], chat_template: str | None,
                 source_directory: pathlib.Path) -> None:
        self._tables = tables
        self.pipeline = spec["pipeline"]
        self._ignore_merges = spec["ignore_merges"]
        self._words = regex.compile(spec["words"]) if spec.get("words") else None
        self.source_directory = source_directory
        self._added_tokens_decoder = {
            token["id"]: AddedToken(token["content"], single_word=token["single_word"], lstrip=token["lstrip"],
                                    rstrip=token["rstrip"], normalized=False, special=token["special"])
            for token in spec["added_tokens"]}
        self._non_special_trie: Trie | None = None
        special = {name: config[name] for name in ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")
                   if config.get(name) is not None}
        super().__init__(**special, chat_template=chat_template,
                         model_max_length=config.get("model_max_length", int(1e30)),
                         clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces", False),
                         special_tokens_pattern="bos" if spec["bos_token"] is not None else "none")
        self._mark_special_ids()

    def _mark_special_ids(self) -> None:
        self._special_ids = np.zeros(len(self), dtype=bool)
        for token_id, token in self._added_tokens_decoder.items():
            self._special_ids[token_id] = token.special
        self._special_ids_address = self._special_ids.ctypes.data
        self._special_flags = self._special_ids.tobytes()

    # ---- the vocabulary ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tables.vocab_size

    def tables_nbytes(self) -> int:
        """Bytes of the vocabulary and merge tables (shared by copies of this tokenizer)."""
        return self._tables.nbytes()

    def _update_total_vocab_size(self) -> None:
        beyond = [token_id for token_id in self._added_tokens_decoder if token_id >= self.vocab_size]
        self.total_vocab_size = max([self.vocab_size - 1, *beyond]) + 1

    def get_vocab(self) -> dict[str, int]:
        vocab = {self._tables.token(i): i for i in range(self.vocab_size)}
        vocab.update(self._added_tokens_encoder)
        return vocab

    def _add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        if not new_tokens:
            # The base class would build get_vocab's 262k-entry dict just to add nothing.
            self._update_trie()
            self._update_total_vocab_size()
            return 0
        added = super()._add_tokens(new_tokens, special_tokens)
        self._non_special_trie = None
        self._mark_special_ids()
        return added

    def _convert_token_to_id(self, token: str) -> int | None:
        token_id = self._tables.lookup(token)
        if token_id >= 0:
            return token_id
        # The configured unknown token's id, as the fast tokenizer gives; None where that token is not one either.
        return None if token == self.unk_token else self.unk_token_id

    def _convert_id_to_token(self, index: int) -> str:
        return self._tables.token(index)

    # ---- encoding ---------------------------------------------------------------------------------------

    def _text_ids(self, text: str, split_special_tokens: bool) -> list[int]:
        """The ids of `text` (no BOS): added tokens where they occur, the pipeline's BPE between them. With
        split_special_tokens, special tokens are encoded as text and only the others are matched, as the fast
        tokenizer does."""
        ids: list[int] = []
        trie = self._trie_without_special() if split_special_tokens else self.tokens_trie
        for piece in trie.split(text):
            token_id = self._added_tokens_encoder.get(piece)
            if token_id is not None and not (split_special_tokens and self._added_tokens_decoder[token_id].special):
                ids.append(token_id)
            elif piece:
                ids.extend(self._encode_between_added_tokens(piece))
        return ids

    def _encode_between_added_tokens(self, text: str) -> list[int]:
        if self.pipeline == _BYTE_LEVEL:
            words = [word.encode().decode("latin-1").translate(_TO_BYTE_CHARS) for word in self._split_words(text)]
            return self._tables.encode(words, self._ignore_merges)
        return self._tables.encode([text.replace(" ", _SPACE_MARK)])

    def _split_words(self, text: str) -> list[str]:
        """The text cut as an isolating Split cuts it: each match a word, and each stretch between matches."""
        words, end = [], 0
        for match in self._words.finditer(text):
            if match.start() > end:
                words.append(text[end:match.start()])
            if match.end() > match.start():
                words.append(match.group())
            end = match.end()
        if end < len(text):
            words.append(text[end:])
        return words

    def _trie_without_special(self) -> Trie:
        if self._non_special_trie is None:
            self._non_special_trie = Trie()
            for token in self._added_tokens_decoder.values():
                if not token.special:
                    self._non_special_trie.add(token.content)
        return self._non_special_trie

    def tokenize(self, text: str, **kwargs) -> list[str]:
        split_special_tokens = kwargs.pop("split_special_tokens", self.split_special_tokens)
        return self.convert_ids_to_tokens(self._text_ids(text, split_special_tokens))

    def _encode_plus(self, text, text_pair=None, **kwargs):
        # A text becomes ids here, in C, rather than through tokenize()'s token strings; the base class then adds
        # the special tokens, truncates and pads them as it would any list of ids. Batches come back here one
        # text at a time, lists of strings are tokens (or words), and an empty text stays a string because the
        # base class reads an empty list as an empty batch.
        if not kwargs.get("is_split_into_words") and not kwargs.get("sanitize_control_tokens"):
            split = kwargs.pop("split_special_tokens", self.split_special_tokens)
            if isinstance(text, str) and text:
                text = self._text_ids(text, split)
            if isinstance(text_pair, str) and text_pair:
                text_pair = self._text_ids(text_pair, split)
            kwargs["split_special_tokens"] = split
        return super()._encode_plus(text, text_pair, **kwargs)

    # ---- decoding ---------------------------------------------------------------------------------------

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
                **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = self.decode_ids(ids, skip_special_tokens)
        clean = clean_up_tokenization_spaces if clean_up_tokenization_spaces is not None \
            else self.clean_up_tokenization_spaces
        return self.clean_up_tokenization(text) if clean else text

    def decode_ids(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """decode() without its argument handling or clean-up of spaces: the engine's detokenizer calls this
        twice per token per sequence."""
        if self.pipeline == _BYTE_LEVEL:
            return self._decode_byte_level(ids, skip_special_tokens)
        skip = self._special_ids_address if skip_special_tokens else None
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return self._tables.decode(ids, skip)
        # Tokens added beyond the vocabulary are not in the tables: each is its text (none is a <0xXX> byte token,
        # which the vocabulary has all of), and the tables decode the runs between them.
        pieces, run = [], []
        for token_id in ids:
            if 0 <= token_id < self.vocab_size:
                run.append(token_id)
                continue
            token = self._added_tokens_decoder.get(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is not one of this tokenizer's {len(self)} tokens")
            if skip_special_tokens and token.special:
                continue
            pieces.append(self._tables.decode(run, skip))
            pieces.append(token.content.replace(_SPACE_MARK, " "))
            run = []
        pieces.append(self._tables.decode(run, skip))
        return "".join(pieces)

    def _decode_byte_level(self, ids: list[int], skip_special_tokens: bool) -> str:
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return self._tables.decode_byte_level(ids, self._special_flags if skip_special_tokens else None)
        # Tokens added beyond the vocabulary go through the byte-level decoder as their text, as tokenizers does.
        pieces = []
        for token_id in ids:
            if 0 <= token_id < self.vocab_size:
                if not (skip_special_tokens and self._special_flags[token_id]):
                    pieces.append(self._tables.raw_token(token_id))
                continue
            token = self._added_tokens_decoder.get(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is not one of this tokenizer's {len(self)} tokens")
            if not (skip_special_tokens and token.special):
                pieces.append(_byte_level_bytes(token.content))
        return b"".join(pieces).decode("utf-8", "replace")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.decode_ids([self._convert_token_to_id_with_added_voc(token) for token in tokens])

    # ---- copies -----------------------------------------------------------------------------------------

    def __deepcopy__(self, memo: dict) -> CompactBPETokenizer:
        """A copy whose settings (truncation, added tokens) are its own and whose tables are shared: they are
        never written, and the C encoder keeps no state between calls."""
        memo[id(self._tables)] = self._tables
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            clone.__dict__[name] = copy.deepcopy(value, memo)
        clone._special_ids_address = clone._special_ids.ctypes.data
        return clone

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._special_ids_address = self._special_ids.ctypes.data

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Saves the fast tokenizer this one was converted from, with this one's chat template and added tokens:
        the same tokens, in files any transformers tokenizer loader reads."""
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(str(self.source_directory))
        present = fast.added_tokens_decoder  # built afresh on each access: read once
        extra = [token for token_id, token in sorted(self._added_tokens_decoder.items()) if token_id not in present]
        if extra:
            fast.add_tokens(extra)
        fast.chat_template = self.chat_template
        return fast.save_pretrained(save_directory, *args, **kwargs)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        """The vocabulary and merges as the fast tokenizer's tokenizer.json they were converted from."""
        target = pathlib.Path(save_directory) / f"{filename_prefix + '-' if filename_prefix else ''}tokenizer.json"
        shutil.copyfile(self.source_directory / "tokenizer.json", target)
        return (str(target),)
