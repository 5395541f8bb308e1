"""DatasetTask: loading jsonl and parquet, chat templates, the (seed, step) prompt order, and bad input."""

import json
import logging

import datasets
import numpy as np
import pytest
from chat_tokenizer import GSM8K_CONF, GSM8K_SAMPLE, build_chat_tokenizer
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rlfw.errors import ConfigError
from rlfw.rollout.tasks.dataset import DatasetError, DatasetTask

MATH = {"_target_": "rlfw.rollout.rewards.math_reward"}
RECORDS = [
    {"q": "Ann has 2 apples and buys 3 more. How many apples does she have?", "a": "5"},
    {"q": "A box holds 4 pens. How many pens are in 6 boxes?", "a": "24"},
    {"q": "Tom had 10 dollars and spent 7. How many dollars are left?", "a": "3"},
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("plain_tokenizer"), chat_template=False)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_task(data_path, tokenizer_dir, **overrides):
    kwargs = {"prompt_field": "q", "answer_field": "a", "reward": MATH}
    return DatasetTask(data_path=str(data_path), tokenizer_path=str(tokenizer_dir), **{**kwargs, **overrides})


def chat_ids(tokenizer_dir, *messages):
    """The tokenizer's own rendering of a conversation, ready for the assistant's reply."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_dict=False)


def at_step(task, step, n):
    """Step ``step``'s prompts, drawn as the RolloutManager draws them: with a generator seeded by (seed, step)."""
    return task.sample_prompts(n, step, np.random.default_rng([task.seed, step]))


def by_record(task, prompts):
    return {task.record_index(p.prompt_id): p for p in prompts}


def test_jsonl_prompts_are_the_tokenizers_chat_rendering(tmp_path, chat_dir):
    task = make_task(write_jsonl(tmp_path / "d.jsonl", RECORDS), chat_dir, shuffle=False)
    prompts = at_step(task, 0, 3)
    assert [p.prompt_id for p in prompts] == [0, 1, 2]
    for index, prompt in by_record(task, prompts).items():
        assert prompt.target == RECORDS[index]["a"]
        assert prompt.token_ids == chat_ids(chat_dir, {"role": "user", "content": RECORDS[index]["q"]})
    assert task.tokenizer.decode(prompts[0].token_ids).endswith("<|im_start|>assistant\n")


def test_system_prompt_goes_into_the_template(tmp_path, chat_dir):
    task = make_task(write_jsonl(tmp_path / "d.jsonl", RECORDS), chat_dir, system_prompt="Be brief.")
    for index, prompt in by_record(task, at_step(task, 0, 3)).items():
        assert prompt.token_ids == chat_ids(chat_dir, {"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": RECORDS[index]["q"]})


def test_parquet_gives_the_same_prompts_as_jsonl(tmp_path, chat_dir):
    parquet = tmp_path / "d.parquet"
    datasets.Dataset.from_list(RECORDS).to_parquet(str(parquet))
    from_jsonl = at_step(make_task(write_jsonl(tmp_path / "d.jsonl", RECORDS), chat_dir, seed=5), 1, 4)
    assert at_step(make_task(parquet, chat_dir, seed=5), 1, 4) == from_jsonl


def test_plain_text_without_a_template(tmp_path, chat_dir, plain_dir):
    data = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    tokenizer = AutoTokenizer.from_pretrained(str(chat_dir))
    want = {i: tokenizer(f"Be brief.\n\n{r['q']}")["input_ids"] for i, r in enumerate(RECORDS)}
    for task in (make_task(data, chat_dir, system_prompt="Be brief.", apply_chat_template=False),
                 make_task(data, plain_dir, system_prompt="Be brief.")):  # auto: this tokenizer has no template
        assert {i: p.token_ids for i, p in by_record(task, at_step(task, 0, 3)).items()} == want
    with pytest.raises(ConfigError, match="task.apply_chat_template=true.*no chat template"):
        make_task(data, plain_dir, apply_chat_template=True)


def test_order_is_a_pure_function_of_seed_and_step(chat_dir):
    def conf(seed):
        return {"data_path": GSM8K_SAMPLE, "prompt_field": "question", "answer_field": "answer", "seed": seed}

    first, again = make_task(tokenizer_dir=chat_dir, **conf(7)), make_task(tokenizer_dir=chat_dir, **conf(7))
    steps = [at_step(first, s, 5) for s in range(8)]
    assert [at_step(again, s, 5) for s in reversed(range(8))] == steps[::-1]  # no hidden cursor
    assert again.sample_prompts(5, 3, np.random.default_rng([7, 3])) == steps[3]  # the manager's per-step generator
    other = make_task(tokenizer_dir=chat_dir, **conf(8))
    assert [p.target for p in at_step(other, 0, 16)] != [p.target for p in at_step(first, 0, 16)]


def test_more_rounds_of_a_step_read_on(chat_dir):
    """Dynamic sampling calls again with the step's generator: it gets the next prompts, not the same ones."""
    task = make_task(GSM8K_SAMPLE, chat_dir, prompt_field="question", answer_field="answer", seed=2)
    rng = np.random.default_rng([2, 3])
    first, more = task.sample_prompts(4, 3, rng), task.sample_prompts(3, 3, rng)
    assert [p.prompt_id for p in first + more] == list(range(12, 19))
    assert task.sample_prompts(4, 3, np.random.default_rng([2, 3])) == first  # a new draw of step 3 starts over
    assert [p.prompt_id for p in at_step(task, 4, 4)] == [16, 17, 18, 19]


def test_every_prompt_once_per_epoch(chat_dir):
    task = make_task(GSM8K_SAMPLE, chat_dir, prompt_field="question", answer_field="answer", seed=1)
    assert task.num_prompts == 16
    stream = [p for step in range(7) for p in at_step(task, step, 5)]  # 35 prompts: 2 epochs and 3 more
    assert [p.prompt_id for p in stream] == list(range(35))  # unique, so groups never merge across an epoch edge
    records = [task.record_index(p.prompt_id) for p in stream]
    assert sorted(records[:16]) == sorted(records[16:32]) == list(range(16))
    assert records[:16] != records[16:32]  # each epoch is shuffled anew
    answers = [json.loads(line)["answer"] for line in GSM8K_SAMPLE.read_text().splitlines()]
    assert [p.target for p in stream] == [answers[i] for i in records]
    wide = at_step(task, 0, 20)  # more prompts than the dataset: wraps into the next epoch
    assert sorted({task.record_index(p.prompt_id) for p in wide}) == list(range(16))


def test_unshuffled_order_is_the_file_order(tmp_path, chat_dir):
    task = make_task(write_jsonl(tmp_path / "d.jsonl", RECORDS), chat_dir, shuffle=False)
    assert [task.record_index(p.prompt_id) for p in at_step(task, 1, 4)] == [1, 2, 0, 1]


def test_long_prompts_are_dropped_and_counted(tmp_path, chat_dir, caplog):
    data = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    lengths = [len(chat_ids(chat_dir, {"role": "user", "content": r["q"]})) for r in RECORDS]
    limit = min(lengths)
    too_long = sum(n > limit for n in lengths)
    assert 0 < too_long < 3
    with caplog.at_level(logging.WARNING):
        task = make_task(data, chat_dir, max_prompt_len=limit)
    assert task.num_dropped_too_long == too_long and task.num_prompts == 3 - too_long
    assert f"dropped {too_long} of 3 prompts longer than task.max_prompt_len={limit}" in caplog.text
    kept = {task.record_index(p.prompt_id) for p in at_step(task, 0, 4)}
    assert kept == {i for i, n in enumerate(lengths) if n <= limit}
    with pytest.raises(DatasetError, match="every one of the 3 prompts .* longer than task.max_prompt_len=1 "):
        make_task(data, chat_dir, max_prompt_len=1)


def test_missing_files(tmp_path, chat_dir):
    with pytest.raises(FileNotFoundError, match=f"dataset file {tmp_path / 'nope.jsonl'} does not exist"):
        make_task(tmp_path / "nope.jsonl", chat_dir)
    with pytest.raises(FileNotFoundError, match=f"task.tokenizer_path={tmp_path / 'tok'}: no such tokenizer"):
        make_task(write_jsonl(tmp_path / "d.jsonl", RECORDS), tmp_path / "tok")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        make_task(tmp_path / "d.csv", chat_dir)


def test_malformed_jsonl_line_is_named(tmp_path, chat_dir):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n\n" + '{"q": "x" "a": "1"}\n' + json.dumps(RECORDS[1]) + "\n")
    with pytest.raises(DatasetError, match=f"{path}:3: malformed JSON line"):
        make_task(path, chat_dir)
    path.write_text(json.dumps(RECORDS[0]) + "\n[1, 2]\n")
    with pytest.raises(DatasetError, match=f"{path}:2: a JSON line must be an object, got list"):
        make_task(path, chat_dir)


def test_records_without_the_fields(tmp_path, chat_dir):
    records = [RECORDS[0], RECORDS[1], {"q": "How many?"}]
    with pytest.raises(DatasetError, match="record 2 has no answer in field 'a'"):
        make_task(write_jsonl(tmp_path / "d.jsonl", records), chat_dir)
    with pytest.raises(DatasetError, match="record 1 has no text in field 'q'"):
        make_task(write_jsonl(tmp_path / "e.jsonl", [RECORDS[0], {"q": "", "a": "1"}]), chat_dir)
    with pytest.raises(DatasetError, match="record 0 has no field 'question'"):
        make_task(write_jsonl(tmp_path / "f.jsonl", RECORDS), chat_dir, prompt_field="question")


def test_empty_datasets(tmp_path, chat_dir):
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n \n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DatasetError, match=f"{tmp_path / name} holds no records"):
            make_task(tmp_path / name, chat_dir)
    parquet = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"q": [], "a": []}).to_parquet(str(parquet))
    with pytest.raises(DatasetError, match=f"{parquet} holds no records"):
        make_task(parquet, chat_dir)


def test_bad_settings_name_the_key(tmp_path, chat_dir):
    data = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    with pytest.raises(ConfigError, match="task.on_reward_error='skip'"):
        make_task(data, chat_dir, on_reward_error="skip")
    with pytest.raises(ConfigError, match="task.max_prompt_len=0"):
        make_task(data, chat_dir, max_prompt_len=0)


def test_gsm8k_config_builds_the_task(chat_dir):
    cfg = OmegaConf.create({"seed": 4, "task": OmegaConf.load(GSM8K_CONF)})
    cfg.task.tokenizer_path = str(chat_dir)
    task = instantiate(cfg.task)
    assert task.num_prompts == 16 and task.seed == 4 and task.num_dropped_too_long == 0
    prompt = at_step(task, 0, 1)[0]
    system = {"role": "system", "content": cfg.task.system_prompt}
    question = json.loads(GSM8K_SAMPLE.read_text().splitlines()[task.record_index(0)])["question"]
    assert prompt.token_ids == chat_ids(chat_dir, system, {"role": "user", "content": question})
    unset = OmegaConf.create({"seed": 4, "task": OmegaConf.load(GSM8K_CONF)})
    with pytest.raises(Exception, match="Missing mandatory value: task.tokenizer_path"):
        instantiate(unset.task)
