"""A word-level tokenizer for the built-in synthetic tasks, built locally so nothing is downloaded.

Each whitespace-separated word is one token, which keeps prompts, rewards and debugging output readable. It is the
``tokenizers`` library's ``WordLevel`` model (the Rust tokenizer under transformers' fast tokenizers) behind the part
of transformers' tokenizer interface that rlfw's tasks, manager and engines call. It is not a
``PreTrainedTokenizerFast``: importing transformers costs a process about two CPU-seconds, and for the built-in
tasks the driver and the rollout manager would import it for this class alone (both are on the path to a run's
first step). ``save_pretrained`` writes the files ``PreTrainedTokenizerFast.from_pretrained`` reads, so the
directory of an exported checkpoint loads in any ``AutoTokenizer`` user (vLLM included) as the same tokenizer
(``tests/rollout/test_tokenizer.py`` holds the two against each other).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SEPARATOR = "="


class WordTokenizer:
    """Vocabulary: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``=``=3, then the symbols in order.

    There is no unknown token: encoding a word outside the vocabulary raises, since for a closed synthetic task
    it can only be a bug. Nothing is added around encoded text; prompts spell out their own ``<bos>``.
    """

    pad_token, bos_token, eos_token = PAD, BOS, EOS
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, symbols: list[str]) -> None:
        words = [PAD, BOS, EOS, SEPARATOR, *symbols]
        if len(set(words)) != len(words):
            raise ValueError(f"symbols must be distinct and must not reuse {words[:4]}: {symbols}")
        if any(not word or any(c.isspace() for c in word) for word in symbols):
            raise ValueError(f"symbols must be non-empty and free of whitespace: {symbols}")
        self._backend = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}))
        self._backend.pre_tokenizer = WhitespaceSplit()
        # Registered as special so that decode(..., skip_special_tokens=True) drops them.
        self._backend.add_special_tokens([PAD, BOS, EOS])

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A word's id (None outside the vocabulary), or a list of them."""
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        """An id's word (None outside the vocabulary), or a list of them."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(i) for i in ids]

    def save_pretrained(self, directory: str | Path) -> None:
        """``tokenizer.json`` (the whole pipeline) and ``tokenizer_config.json`` (the class and the special tokens),
        as transformers writes them for a ``PreTrainedTokenizerFast``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                  "clean_up_tokenization_spaces": False}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_tokenizer(symbols: list[str]) -> WordTokenizer:
    """The word-level tokenizer of ``symbols`` (see ``WordTokenizer``)."""
    return WordTokenizer(symbols)
