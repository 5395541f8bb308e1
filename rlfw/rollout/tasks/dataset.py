"""A task whose prompts and reference answers come from a dataset file, scored by a configurable reward function.

Records are read with Hugging Face ``datasets`` from a ``.jsonl`` or ``.parquet`` file; the prompt is rendered
with the tokenizer's chat template (when it has one) and tokenized once, at start-up, so that over-long prompts
are dropped and counted before training rather than discovered at some later step.

Which prompts a step gets is a pure function of (seed, step): the prompt stream is the concatenation of
epochs, each a fresh seeded permutation of the records, and step ``s`` of ``n`` prompts reads the stream from
position ``s*n``. Every prompt is used once per epoch, and a run restarted at step ``s`` sees exactly the prompts
it would have seen, with no data cursor to save. Dynamic sampling asks for more prompts within a step; those
continue reading past the step's window (so the next step reads them again: each prompt then comes at least once
per epoch). A prompt's ``prompt_id`` is its position in the stream: unique within a step's batch (so GRPO groups
never merge, even when a batch wraps around an epoch), and it leads back to its record.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import logging
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.parquet as pq
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlfw.errors import ConfigError
from rlfw.rollout.rewards import RewardError, load_reward
from rlfw.rollout.types import Prompt

log = logging.getLogger(__name__)

_FORMATS = {".jsonl": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and the record or line at fault."""


def resolve_data_path(data_path: str) -> Path:
    """A filesystem path, or ``pkg://package/relative/path`` for a file shipped inside a Python package."""
    if data_path.startswith("pkg://"):
        package, _, relative = data_path.removeprefix("pkg://").partition("/")
        return Path(str(importlib.resources.files(package).joinpath(relative)))
    return Path(data_path).expanduser()


def load_records(path: Path, prompt_field: str, answer_field: str) -> tuple[list[str], list[str]]:
    """The prompt and answer of every record of ``path``, as strings, in file order."""
    file_format = _FORMATS.get(path.suffix)
    if file_format is None:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use one of {sorted(_FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist (task.data_path)")
    try:
        table = datasets.load_dataset(file_format, data_files=str(path), split="train")
    except Exception as e:
        _explain_failure(path, file_format)
        raise DatasetError(f"{path}: cannot be read as {file_format}: {e}") from e
    if len(table) == 0:
        raise DatasetError(f"{path} holds no records")
    for field in (prompt_field, answer_field):
        if field not in table.column_names:
            raise DatasetError(f"{path}: record 0 has no field {field!r} (its fields: {table.column_names})")
    prompts, answers = table[prompt_field], table[answer_field]
    for index, (prompt, answer) in enumerate(zip(prompts, answers)):
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{path}: record {index} has no text in field {prompt_field!r} (got {prompt!r})")
        if not isinstance(answer, (str, numbers.Real)) or answer == "":
            raise DatasetError(f"{path}: record {index} has no answer in field {answer_field!r} (got {answer!r})")
    return prompts, [str(answer) for answer in answers]


def _explain_failure(path: Path, file_format: str) -> None:
    """Raise a DatasetError saying that ``path`` is empty or naming its first bad line: the reader's errors do not."""
    if file_format == "json":
        _check_jsonl(path)
        return
    try:
        rows = pq.read_metadata(path).num_rows
    except (OSError, ValueError):
        return  # not a parquet file at all: the reader's own error says so
    if rows == 0:
        raise DatasetError(f"{path} holds no records")


def _check_jsonl(path: Path) -> None:
    """Raise DatasetError naming the first line of ``path`` that is not a JSON object, or saying it is empty."""
    empty = True
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            empty = False
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{number}: malformed JSON line: {e}") from None
            if not isinstance(record, dict):
                raise DatasetError(f"{path}:{number}: a JSON line must be an object, got {type(record).__name__}")
    if empty:
        raise DatasetError(f"{path} holds no records")


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, size: int, shuffle: bool) -> np.ndarray:
    """The order in which epoch ``epoch`` visits ``size`` prompts; a stream of its own, apart from the step RNG."""
    if not shuffle:
        return np.arange(size)
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(epoch,))).permutation(size)


class DatasetTask:
    """Prompts from ``data_path``, scored by the reward function named in ``reward`` (a ``_target_`` node).

    ``apply_chat_template``: None uses the tokenizer's chat template when it has one, True requires one, False
    feeds the plain text (``system_prompt``, a blank line, then the prompt). ``on_reward_error``: ``stop`` raises
    a ``RewardError`` naming the sample and the reward function; ``drop`` logs the error, counts it in
    ``num_reward_errors`` and scores the sample NaN, so the RolloutManager drops its whole group (GRPO needs
    whole groups) and counts that in ``rollout/dropped_groups_nonfinite_reward``.
    """

    def __init__(
        self,
        data_path: str,
        tokenizer_path: str,
        reward: Mapping[str, Any],
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        system_prompt: str | None = None,
        apply_chat_template: bool | None = None,
        max_prompt_len: int | None = None,
        max_response_len: int = 256,
        shuffle: bool = True,
        seed: int = 0,
        on_reward_error: str = "stop",
    ) -> None:
        if on_reward_error not in ("stop", "drop"):
            raise ConfigError(f"task.on_reward_error={on_reward_error!r} is not one of ['drop', 'stop']")
        if max_response_len < 1:
            raise ConfigError(f"task.max_response_len={max_response_len} must be > 0")
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ConfigError(f"task.max_prompt_len={max_prompt_len} must be > 0 (or null for no limit)")
        self._reward = load_reward(reward)
        self._tokenizer = _load_tokenizer(tokenizer_path)
        use_template = self._tokenizer.chat_template is not None if apply_chat_template is None else apply_chat_template
        if use_template and self._tokenizer.chat_template is None:
            raise ConfigError(f"task.apply_chat_template=true but the tokenizer at {tokenizer_path} has no chat template")
        self.data_path = resolve_data_path(data_path)
        self.seed, self.shuffle, self.on_reward_error = seed, shuffle, on_reward_error
        self._max_response_len = max_response_len
        self.num_reward_errors = 0
        self._cursor: tuple[np.random.Generator, int] | None = None  # a step's generator, its next stream position

        prompts, answers = load_records(self.data_path, prompt_field, answer_field)
        token_ids = self._tokenize([self._render(p, system_prompt, use_template) for p in prompts], use_template)
        # The records that fit; everything after start-up indexes these, in file order.
        self._records = [i for i, ids in enumerate(token_ids) if max_prompt_len is None or len(ids) <= max_prompt_len]
        self.num_dropped_too_long = len(prompts) - len(self._records)
        if not self._records:
            raise DatasetError(f"every one of the {len(prompts)} prompts of {self.data_path} is longer than "
                               f"task.max_prompt_len={max_prompt_len} tokens")
        if self.num_dropped_too_long:
            log.warning("%s: dropped %d of %d prompts longer than task.max_prompt_len=%d tokens",
                        self.data_path, self.num_dropped_too_long, len(prompts), max_prompt_len)
        self._prompt_texts = [prompts[i] for i in self._records]
        self._answers = [answers[i] for i in self._records]
        self._token_ids = [token_ids[i] for i in self._records]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def max_response_len(self) -> int:
        return self._max_response_len

    @property
    def num_prompts(self) -> int:
        """Prompts in one epoch: the records that passed the length filter."""
        return len(self._records)

    def sample_prompts(self, n: int, step: int, rng: np.random.Generator) -> list[Prompt]:
        """``n`` prompts of step ``step``; ``rng`` is the step's generator (the order is the task's own stream).

        A new generator reads the stream from ``step*n``; further calls with the same generator (dynamic sampling's
        rounds within the step) read on from where the previous call stopped.
        """
        start = self._cursor[1] if self._cursor and self._cursor[0] is rng else step * n
        self._cursor = (rng, start + n)
        prompts = []
        for position in range(start, start + n):
            k = self._kept_index(position)
            prompts.append(Prompt(prompt_id=position, token_ids=list(self._token_ids[k]), target=self._answers[k]))
        return prompts

    def record_index(self, prompt_id: int) -> int:
        """The index, in the dataset file, of the record behind ``prompt_id``."""
        return self._records[self._kept_index(prompt_id)]

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """The reward function on (prompt text, decoded response, reference answer); see ``on_reward_error``."""
        vocab = len(self._tokenizer)  # the policy's embedding is padded: ids past the vocabulary have no text
        response_text = self._tokenizer.decode([t for t in response_ids if t < vocab], skip_special_tokens=True)
        try:
            value = float(self._reward(self._prompt_texts[self._kept_index(prompt.prompt_id)], response_text,
                                       prompt.target))
        except Exception as e:
            message = (f"reward {self._reward.target} failed on prompt_id={prompt.prompt_id} (record "
                       f"{self.record_index(prompt.prompt_id)} of {self.data_path}): {type(e).__name__}: {e}")
            if self.on_reward_error == "stop":
                raise RewardError(message) from e
            self.num_reward_errors += 1
            log.warning("%s; its group is dropped (task.on_reward_error=drop)", message)
            return math.nan
        return value

    def _kept_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self._records))
        return int(_epoch_order(self.seed, epoch, len(self._records), self.shuffle)[offset])

    def _render(self, prompt: str, system_prompt: str | None, use_template: bool) -> str:
        if not use_template:
            return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _tokenize(self, texts: list[str], use_template: bool) -> list[list[int]]:
        # A chat template writes its own special tokens (BOS included); plain text gets the tokenizer's.
        return self._tokenizer(texts, add_special_tokens=not use_template)["input_ids"]


def _load_tokenizer(tokenizer_path: str) -> PreTrainedTokenizerBase:
    """A Hugging Face tokenizer from a local directory; nothing is downloaded."""
    path = Path(tokenizer_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"task.tokenizer_path={tokenizer_path}: no such tokenizer directory")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"task.tokenizer_path={tokenizer_path}: the tokenizer has no eos token to end responses")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # only fills the engine's masked batch padding
    return tokenizer
