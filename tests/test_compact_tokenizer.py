"""The compact BPE tokenizer (pagellm/tokenization/compact_bpe.py) against the fast tokenizer it is converted from:
small trained vocabularies of each pipeline it implements here (Gemma's byte fallback; GPT-2's byte level, with and
without ignore_merges), the real Gemma 3 and SmolLM2 vocabularies in tests/test_gguf_gemma3.py and
tests/test_gguf_loader.py."""

from __future__ import annotations

import copy
import json
import pathlib
import pickle

import pytest
import xgrammar as xgr
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagellm.structured_output.grammar import _tokenizer_info
from pagellm.tokenization import compact_bpe
from pagellm.tokenization.compact_bpe import CompactBPETokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "paged attention serves the model from blocks",
          "hello world, hello there", "ünïcödé and naïve café text", "def f(x):\n    return x * 2"]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
ADDED_SPECIAL = ["<start_of_turn>", "<end_of_turn>"]
ADDED_PLAIN = ["\n\n", "<b>"]  # Gemma's newline runs and HTML tags are added tokens that are not special


def _gemma_like_tokenizer() -> Tokenizer:
    """A BPE trained on CORPUS, renumbered as Gemma's: specials, the 256 <0xXX> byte tokens, then the rest."""
    trainer_model = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_model.normalizer = normalizers.Replace(" ", "\u2581")
    trainer_model.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    trained = json.loads(trainer_model.to_str())["model"]
    names = SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    names += [token for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]) if token not in names]
    merges = [tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={name: i for i, name in enumerate(names)}, merges=merges,
                                     unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos>:1 $B:1",
                                                             special_tokens=[("<bos>", 2)])
    tokenizer.add_special_tokens([AddedToken(token, normalized=False) for token in SPECIALS + ADDED_SPECIAL])
    tokenizer.add_tokens([AddedToken(token, normalized=False) for token in ADDED_PLAIN])
    return tokenizer


# Llama 3's pre-tokenizer regex, as transformers sets it on a llama-bpe GGUF's tokenizer.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's (gpt-oss, GPT-4o; llama.cpp's pre-tokenizer "gpt-4o"): cased words with their contractions, "/" kept on
# punctuation runs.
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level_tokenizer(split: str | None = None) -> Tokenizer:
    """A BPE trained on CORPUS with GPT-2's byte-level pipeline (SmolLM2's), or with a regex Split before a
    ByteLevel that does not split again (Llama 3's), every byte's character in it, the same special and added
    tokens, BOS prepended."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos>:1 $B:1",
                                                             special_tokens=[("<bos>", 2)])
    tokenizer.add_special_tokens([AddedToken(token, normalized=False) for token in SPECIALS + ADDED_SPECIAL])
    tokenizer.add_tokens([AddedToken(token, normalized=False) for token in ADDED_PLAIN])
    return tokenizer


PIPELINES = ["byte_fallback", "byte_level", "byte_level_ignore_merges", "llama3_split", "gpt4o_split"]
SPLITS = {"llama3_split": LLAMA3_SPLIT, "gpt4o_split": GPT4O_SPLIT}


@pytest.fixture(scope="module", params=PIPELINES)
def directory(request, module_tmp_path_factory) -> pathlib.Path:
    path = module_tmp_path_factory.mktemp(request.param)
    tokenizer = _gemma_like_tokenizer() if request.param == "byte_fallback" else \
        _byte_level_tokenizer(SPLITS.get(request.param))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
                          "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    fast.save_pretrained(path)
    if request.param == "byte_level_ignore_merges":
        document = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        document["model"]["ignore_merges"] = True
        (path / "tokenizer.json").write_text(json.dumps(document), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def fast(directory) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module", params=["tables", "transformers"])
def compact(request, directory) -> CompactBPETokenizer:
    """The compact tokenizer answering from its tables, and one that has become a transformers tokenizer (as a
    call beyond encoding and decoding makes it). Tests that make the first one become one work on a copy."""
    tokenizer = compact_bpe.load_or_convert(directory)
    assert isinstance(tokenizer, CompactBPETokenizer)
    if request.param == "transformers":
        tokenizer.transformers_tokenizer()
    return tokenizer


TEXTS = ["", " ", "hello world", "  the  lazy dog ", "<start_of_turn>user\nhello<end_of_turn>\n", "a\n\n\nb<b>x</b>",
         "emoji 😀 and 漢字 fall back to bytes", "<bos><eos><unk><pad>", "\x00\ttab\r\n", "<0x41> is text",
         "it's 2024, they'll've 12345 x\u00a0y\u3000z \u2028 end  ", "IT'S A\r\n\r\n  B!!\n\nC's 1234567", *CORPUS]
TEXT_ALPHABET = st.sampled_from(list("thequickbrownfoxaé漢😀 \n\t\r<>/'1\u00a0!") + ["'s", "'LL", "  ", "1234"] + ADDED_SPECIAL
                                + ADDED_PLAIN + SPECIALS)


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_encode_equals_the_fast_tokenizer(fast, compact, split_special_tokens):
    for text in TEXTS:
        assert compact.encode(text, split_special_tokens=split_special_tokens) == \
            fast.encode(text, split_special_tokens=split_special_tokens), text
        assert compact.tokenize(text) == fast.tokenize(text), text


@given(pieces=st.lists(TEXT_ALPHABET, max_size=40))
def test_random_text_encodes_and_decodes_as_the_fast_tokenizer(fast, compact, pieces):
    text = "".join(pieces)
    ids = fast.encode(text)
    assert compact.encode(text) == ids
    assert compact.encode(text, add_special_tokens=False, split_special_tokens=True) == \
        fast.encode(text, add_special_tokens=False, split_special_tokens=True)
    for skip in (False, True):
        assert compact.decode(ids, skip_special_tokens=skip) == fast.decode(ids, skip_special_tokens=skip)


@given(ids=st.lists(st.integers(0, 400 + len(ADDED_SPECIAL) + len(ADDED_PLAIN)), max_size=30))
def test_any_ids_decode_as_the_fast_tokenizer(fast, compact, ids):
    """Arbitrary ids: invalid UTF-8 (lone <0xXX> byte tokens, or byte-level characters cut from their sequence)
    becomes U+FFFD as the fast tokenizer's decoders make it."""
    ids = [i for i in ids if i < len(fast)]
    for skip in (False, True):
        assert compact.decode(ids, skip_special_tokens=skip) == fast.decode(ids, skip_special_tokens=skip)
    assert compact.convert_ids_to_tokens(ids) == fast.convert_ids_to_tokens(ids)


def test_vocabulary_special_tokens_batches_and_chat_template(fast, compact):
    assert len(compact) == len(fast) and compact.vocab_size == fast.vocab_size
    assert compact.get_vocab() == fast.get_vocab()
    for name in ("bos", "eos", "pad", "unk", "sep", "cls", "mask"):
        assert getattr(compact, f"{name}_token") == getattr(fast, f"{name}_token"), name
        assert getattr(compact, f"{name}_token_id") == getattr(fast, f"{name}_token_id"), name
    tokens = ["\u2581the", "\u0120the", "<bos>", "not-a-token", "<0x41>", "A"]
    assert compact.convert_tokens_to_ids(tokens) == fast.convert_tokens_to_ids(tokens)
    assert compact.convert_tokens_to_ids("<eos>") == fast.convert_tokens_to_ids("<eos>")
    assert compact.batch_decode([[5, 6], [7]]) == fast.batch_decode([[5, 6], [7]])
    compact = copy.deepcopy(compact)  # what follows makes it a transformers tokenizer
    assert sorted(compact.all_special_ids) == sorted(fast.all_special_ids)
    batch = ["hello world", "the", ""]
    assert compact(batch, padding=True)["input_ids"] == fast(batch, padding=True)["input_ids"]
    assert compact("hello", "world")["input_ids"] == fast("hello", "world")["input_ids"]
    assert compact("the lazy dog", truncation=True, max_length=3)["input_ids"] == \
        fast("the lazy dog", truncation=True, max_length=3)["input_ids"]
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    assert compact.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == \
        fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def test_added_tokens_and_copies(directory, fast, compact):
    """A copy shares the tables but not its added tokens; save_pretrained writes the fast tokenizer's files."""
    clone = copy.deepcopy(compact)
    assert clone._codec.tables is compact._codec.tables
    assert clone.add_tokens(["quickbrown"]) == 1 and len(clone) == len(compact) + 1
    fast_clone = copy.deepcopy(fast)
    fast_clone.add_tokens(["quickbrown"])
    assert len(compact) in clone.encode("a quickbrown fox")
    assert clone.encode("a quickbrown fox") == fast_clone.encode("a quickbrown fox")
    assert "quickbrown" not in compact.get_vocab() and len(compact) not in compact.encode("a quickbrown fox")
    assert clone.decode(clone.encode("a quickbrown fox")) == "<bos>a quickbrown fox"
    for tokenizer in (clone, fast_clone):
        tokenizer.add_tokens([AddedToken("<call>", special=True, normalized=False)])
    text = "<call>a quickbrown\n\nfox 😀<call>"
    assert clone.encode(text) == fast_clone.encode(text)
    for skip in (False, True):
        assert clone.decode(clone.encode(text), skip_special_tokens=skip) == \
            fast_clone.decode(fast_clone.encode(text), skip_special_tokens=skip)


def test_a_pickled_tokenizer_decodes_and_encodes_alone(compact):
    clone = pickle.loads(pickle.dumps(compact))
    assert clone._codec.tables is not compact._codec.tables and (clone._full is None) == (compact._full is None)
    for text in TEXTS:
        assert clone.encode(text) == compact.encode(text)
        assert clone.decode(compact.encode(text), skip_special_tokens=True) == \
            compact.decode(compact.encode(text), skip_special_tokens=True)


def test_save_pretrained_writes_a_fast_tokenizer_with_the_same_tokens(compact, fast, tmp_path):
    clone = copy.deepcopy(compact)
    clone.add_tokens(["quickbrown"])
    clone.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(reloaded, PreTrainedTokenizerFast)
    for text in [*TEXTS, "a quickbrown fox"]:
        assert reloaded.encode(text) == clone.encode(text)
    assert reloaded.chat_template == compact.chat_template == fast.chat_template


def test_save_vocabulary_writes_the_tokenizer_json_it_was_converted_from(directory, compact, tmp_path):
    (path,) = copy.deepcopy(compact).save_vocabulary(str(tmp_path), "gemma")
    assert path == str(tmp_path / "gemma-tokenizer.json")
    assert (tmp_path / "gemma-tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()


def test_encoding_and_decoding_need_no_transformers_tokenizer(directory):
    """What an engine asks of its tokenizer is answered from the tables; the rest makes it a transformers one,
    whose settings it then reads and writes."""
    tokenizer = compact_bpe.load_or_convert(directory)
    ids = tokenizer.encode("<start_of_turn>hello world\n\n<b>x")
    tokenizer.decode(ids, skip_special_tokens=True)
    tokenizer.decode_ids(ids)
    tokenizer.tokenize("hello")
    tokenizer.convert_ids_to_tokens(ids)
    tokenizer.convert_tokens_to_ids(["hello", "<eos>"])
    tokenizer.get_vocab()
    tokenizer.chat_template = "{{ messages[0].content }}"
    clone = pickle.loads(pickle.dumps(copy.deepcopy(tokenizer)))
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.clean_up_tokenization_spaces) == \
        (len(clone), clone.eos_token_id, clone.clean_up_tokenization_spaces)
    assert tokenizer._full is None and clone._full is None
    tokenizer.pad_token = "<eos>"
    assert tokenizer._full is not None and tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    assert clone._full is None and clone.pad_token == "<pad>"


def test_xgrammar_sees_the_vocabulary_as_from_the_fast_tokenizer(fast, compact):
    vocab_size = len(fast) + 6  # a model's logits can be wider than its vocabulary
    expected = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=[1])
    info = _tokenizer_info(compact, vocab_size, [1])
    assert (info.vocab_type, info.add_prefix_space) == (expected.vocab_type, expected.add_prefix_space)
    assert info.decoded_vocab == expected.decoded_vocab
    assert info.special_token_ids == expected.special_token_ids


def test_other_pipelines_are_left_to_the_fast_tokenizer_and_read_once(tmp_path):
    prefixed = Tokenizer(models.BPE())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # a space before the text: not built
    prefixed.decoder = decoders.ByteLevel()
    prefixed.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=prefixed, eos_token="<eos>").save_pretrained(tmp_path)
    assert compact_bpe.load_or_convert(tmp_path) is None
    (tmp_path / "tokenizer.json").unlink()  # the verdict is remembered: the JSON is not read again
    assert compact_bpe.load_or_convert(tmp_path) is None


def test_each_spec_difference_is_refused(directory):
    document = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    spec = compact_bpe.compact_spec(document)
    assert spec is not None
    changes = [
        lambda d: d["model"].update(dropout=0.1),
        lambda d: d["model"].update(continuing_subword_prefix="##"),
        lambda d: d.update(normalizer={"type": "NFKC"}),
        lambda d: d["post_processor"]["single"].append({"SpecialToken": {"id": "<eos>", "type_id": 0}}),
        lambda d: d["added_tokens"][-1].update(lstrip=True),
        lambda d: d["added_tokens"][-1].update(normalized=True),
    ]
    if spec["pipeline"] == "byte_fallback":
        changes += [
            lambda d: d["model"].update(byte_fallback=False),
            lambda d: d["model"].update(ignore_merges=True),
            lambda d: d.update(pre_tokenizer={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                                              "split": False}),
            lambda d: d["decoder"]["decoders"].append({"type": "Strip", "content": " ", "start": 1, "stop": 0}),
        ]
    else:
        changes += [
            lambda d: d["model"].update(byte_fallback=True),
            lambda d: d["model"].update(unk_token="<unk>", fuse_unk=False),
            lambda d: d.update(decoder={"type": "Fuse"}),
            lambda d: d.update(pre_tokenizer=None),
            lambda d: d.update(pre_tokenizer={"type": "Sequence", "pretokenizers": ["Split", "ByteLevel"]}),
        ]
        if document["pre_tokenizer"]["type"] == "ByteLevel":
            changes += [lambda d: d["pre_tokenizer"].update(add_prefix_space=True),
                        lambda d: d["pre_tokenizer"].update(use_regex=False)]
        else:
            changes += [lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(behavior="MergedWithPrevious"),
                        lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(invert=True),
                        lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(pattern={"Regex": "(unclosed"}),
                        lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(use_regex=True),
                        lambda d: d["pre_tokenizer"]["pretokenizers"].reverse()]
    for change in changes:
        changed = json.loads(json.dumps(document))
        change(changed)
        assert compact_bpe.compact_spec(changed) is None, change


def test_stale_or_damaged_tables_fall_back_or_rebuild(directory, tmp_path):
    from pagellm.models.gguf_loader import _compact_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    assert isinstance(_compact_tokenizer(tmp_path), CompactBPETokenizer)
    meta = json.loads((tmp_path / "compact_bpe.json").read_text())
    (tmp_path / "compact_bpe.json").write_text(json.dumps({**meta, "format": -1}))
    assert isinstance(_compact_tokenizer(tmp_path), CompactBPETokenizer)  # another format: converted again
    assert json.loads((tmp_path / "compact_bpe.json").read_text())["format"] == meta["format"]
    (tmp_path / "compact_bpe.tables").write_bytes(b"too short")
    assert _compact_tokenizer(tmp_path) is None  # the caller loads the fast tokenizer


def test_added_tokens_split_leftmost_longest_whatever_their_characters():
    """tokenizers' added-token matcher: the leftmost match, the longest token there; the characters that mean
    something in a regex character class are plain text."""
    index = compact_bpe.AddedTokenIndex(10, [(20, "]x", True), (21, "-", False), (22, "^", False), (23, "\\", True),
                                             (24, "ab", False), (25, "abc", False), (26, "\n\n", False)])
    text = "q]x-^\\abcab\n\n\nz"
    assert index.split(text, split_special_tokens=False) == ["q", 20, 21, 22, 23, 25, 24, 26, "\nz"]
    assert index.split(text, split_special_tokens=True) == ["q]x", 21, 22, "\\", 25, 24, 26, "\nz"]
    assert index.split("", False) == [] and compact_bpe.AddedTokenIndex(10, []).split("ab", False) == ["ab"]
    assert compact_bpe.AddedTokenIndex(10, [(3, "<s>", True)]).split("a<s>b", split_special_tokens=True) == ["a<s>b"]
    assert compact_bpe.AddedTokenIndex(10, [(3, "", False), (4, "<s>", True)]).split("a<s>", False) == ["a", 4]
