"""transformers' tokenizer interface (a PythonBackend) over compact_bpe's tables: what a CompactBPETokenizer becomes
when it is asked for more than encoding and decoding (padding, tensors, apply_chat_template, added tokens,
save_pretrained). Imports transformers, which compact_bpe.py does not."""

from __future__ import annotations

import copy
import pathlib
import shutil
from typing import Any

from transformers import AddedToken
from transformers.tokenization_python import PythonBackend

from pagellm.tokenization.compact_bpe import _SPECIAL_TOKEN_NAMES, AddedTokenIndex, BpeCodec, _token_text


class TransformersCompactBPETokenizer(PythonBackend):
    """A PythonBackend whose text <-> ids steps are the compact tables' (BpeCodec); transformers keeps the added
    and special tokens, truncation, padding and the chat template."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, codec: BpeCodec, spec: dict[str, Any], config: dict[str, Any], chat_template: str | None,
                 source_directory: pathlib.Path) -> None:
        self._codec = codec
        self.source_directory = source_directory
        self._added_tokens_decoder = {
            token["id"]: AddedToken(token["content"], single_word=token["single_word"], lstrip=token["lstrip"],
                                    rstrip=token["rstrip"], normalized=False, special=token["special"])
            for token in spec["added_tokens"]}
        self._index_added_tokens()
        special = {name: _token_text(config[name]) for name in _SPECIAL_TOKEN_NAMES if config.get(name) is not None}
        super().__init__(**special, chat_template=chat_template,
                         model_max_length=config.get("model_max_length", int(1e30)),
                         clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces", False),
                         special_tokens_pattern="bos" if spec["bos_token"] is not None else "none")

    def _index_added_tokens(self) -> None:
        self._added = AddedTokenIndex(self.vocab_size, [(token_id, token.content, token.special)
                                                        for token_id, token in self._added_tokens_decoder.items()])

    # ---- the vocabulary ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._codec.tables.vocab_size

    def _update_total_vocab_size(self) -> None:
        self.total_vocab_size = self._added.size

    def get_vocab(self) -> dict[str, int]:
        return self._codec.vocab(self._added)  # its added tokens are _added_tokens_decoder's

    def _add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        if not new_tokens:
            # The base class would build get_vocab's 262k-entry dict just to add nothing.
            self._update_trie()
            self._update_total_vocab_size()
            return 0
        added = super()._add_tokens(new_tokens, special_tokens)
        self._index_added_tokens()
        self._update_total_vocab_size()
        return added

    def _convert_token_to_id(self, token: str) -> int | None:
        token_id = self._codec.tables.lookup(token)
        if token_id >= 0:
            return token_id
        # The configured unknown token's id, as the fast tokenizer gives; None where that token is not one either.
        return None if token == self.unk_token else self.unk_token_id

    def _convert_id_to_token(self, index: int) -> str:
        return self._codec.tables.token(index)

    # ---- encoding ---------------------------------------------------------------------------------------

    def tokenize(self, text: str, **kwargs) -> list[str]:
        split_special_tokens = kwargs.pop("split_special_tokens", self.split_special_tokens)
        return self.convert_ids_to_tokens(self._codec.text_ids(text, self._added, split_special_tokens))

    def _encode_plus(self, text, text_pair=None, **kwargs):
        # A text becomes ids here, in C, rather than through tokenize()'s token strings; the base class then adds
        # the special tokens, truncates and pads them as it would any list of ids. Batches come back here one
        # text at a time, lists of strings are tokens (or words), and an empty text stays a string because the
        # base class reads an empty list as an empty batch.
        if not kwargs.get("is_split_into_words") and not kwargs.get("sanitize_control_tokens"):
            split = kwargs.pop("split_special_tokens", self.split_special_tokens)
            if isinstance(text, str) and text:
                text = self._codec.text_ids(text, self._added, split)
            if isinstance(text_pair, str) and text_pair:
                text_pair = self._codec.text_ids(text_pair, self._added, split)
            kwargs["split_special_tokens"] = split
        return super()._encode_plus(text, text_pair, **kwargs)

    # ---- decoding ---------------------------------------------------------------------------------------

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
                **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = self._codec.decode(ids, self._added, skip_special_tokens)
        clean = clean_up_tokenization_spaces if clean_up_tokenization_spaces is not None \
            else self.clean_up_tokenization_spaces
        return self.clean_up_tokenization(text) if clean else text

    def decode_ids(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._codec.decode(ids, self._added, skip_special_tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.decode_ids([self._convert_token_to_id_with_added_voc(token) for token in tokens])

    # ---- copies -----------------------------------------------------------------------------------------

    def __deepcopy__(self, memo: dict) -> TransformersCompactBPETokenizer:
        """A copy whose settings (truncation, added tokens) are its own and whose tables are shared: they are
        never written, and the C encoder keeps no state between calls."""
        memo[id(self._codec)] = self._codec
        memo[id(self._added)] = self._added  # replaced, never changed, when tokens are added
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            clone.__dict__[name] = copy.deepcopy(value, memo)
        return clone

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
