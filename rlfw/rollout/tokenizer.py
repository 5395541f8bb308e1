"""A word-level tokenizer for the built-in synthetic tasks, built locally so nothing is downloaded.

Each whitespace-separated word is one token, which keeps prompts, rewards and debugging output readable. The
result is a regular ``PreTrainedTokenizerFast``, so ``save_pretrained`` writes a directory that any
``AutoTokenizer`` user (vLLM included) can load next to the exported HF checkpoint.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SEPARATOR = "="


def build_tokenizer(symbols: list[str]) -> PreTrainedTokenizerFast:
    """Vocabulary: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``=``=3, then ``symbols`` in order.

    There is no unknown token: encoding a word outside the vocabulary raises, since for a closed synthetic task
    it can only be a bug. Nothing is added around encoded text; prompts spell out their own ``<bos>``.
    """
    vocab_words = [PAD, BOS, EOS, SEPARATOR, *symbols]
    if len(set(vocab_words)) != len(vocab_words):
        raise ValueError(f"symbols must be distinct and must not reuse {vocab_words[:4]}: {symbols}")
    if any(not word or any(c.isspace() for c in word) for word in symbols):
        raise ValueError(f"symbols must be non-empty and free of whitespace: {symbols}")

    backend = Tokenizer(WordLevel({word: i for i, word in enumerate(vocab_words)}))
    backend.pre_tokenizer = WhitespaceSplit()
    # Registered as special so that decode(..., skip_special_tokens=True) drops them.
    backend.add_special_tokens([PAD, BOS, EOS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS)
