"""A tiny byte-level BPE tokenizer with a ChatML chat template, trained locally so tests download nothing.

It is a real ``PreTrainedTokenizerFast`` saved to a directory, loaded back the way ``DatasetTask`` loads any
Hugging Face tokenizer. Byte-level BPE round-trips any text, so rewards see exactly what a policy wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlfw.rollout.tasks.dataset import resolve_data_path

GSM8K_CONF = Path(__file__).resolve().parents[2] / "conf" / "task" / "gsm8k.yaml"
GSM8K_SAMPLE = resolve_data_path(OmegaConf.load(GSM8K_CONF).data_path)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer(out_dir: Path, chat_template: bool = True, vocab_size: int = 600) -> Path:
    """Train on the GSM8K sample and its system prompt; ``<|im_end|>`` ends a turn and is the eos token."""
    records = [json.loads(line) for line in GSM8K_SAMPLE.read_text().splitlines()]
    corpus = [text for r in records for text in (r["question"], r["answer"])]
    corpus.append(OmegaConf.load(GSM8K_CONF).system_prompt)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML if chat_template else None,
    )
    tokenizer.save_pretrained(out_dir)
    return out_dir
