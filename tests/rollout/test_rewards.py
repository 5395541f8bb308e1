"""Rewards: math-verify and exact match on hand-written cases, user rewards by _target_, errors, and Ray actors."""

import contextlib
import json
import logging
import math
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import ray
from chat_tokenizer import GSM8K_CONF, build_chat_tokenizer
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlfw.config import ConfigError, register_configs
from rlfw.rollout.rewards import RewardError, exact_match_reward, load_reward, math_reward
from rlfw.rollout.tasks.dataset import DatasetTask

RECORDS = [{"q": "Ann has 2 apples and buys 3 more. How many apples does she have?", "a": "5"},
           {"q": "Half of one is what?", "a": "\\frac{1}{2}"}]


@pytest.mark.parametrize("response, answer, want", [
    ("2 + 3 = 5, so the answer is \\boxed{5}.", "5", 1.0),
    ("She has 2 apples, then 3 more: 5 apples.", "5", 1.0),  # no box: the last number
    ("First 17 apples, then 18.", "18", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # fractions and decimals agree
    ("Half of one is 0.5", "\\frac{1}{2}", 1.0),
    ("It is 1/2.", "0.5", 1.0),
    ("The total is 1,200 dollars.", "1200", 1.0),
    ("\\boxed{18.0}", "18", 1.0),
    ("\\boxed{6}", "5", 0.0),  # wrong
    ("The answer is 0.25", "\\frac{1}{2}", 0.0),
    ("I do not know.", "5", 0.0),  # no answer at all
    ("", "5", 0.0),
])
def test_math_reward(response, answer, want):
    assert math_reward("prompt", response, answer) == want


def test_math_reward_rejects_a_reference_without_math():
    with pytest.raises(ValueError, match="reference answer 'many' holds no math"):
        math_reward("prompt", "\\boxed{5}", "many")


@pytest.mark.parametrize("response, kwargs, want", [
    ("  42\n", {}, 1.0),
    ("42 apples", {}, 0.0),
    ("3 * 14 = 42\n#### 42", {"pattern": r"####\s*(\S+)"}, 1.0),
    ("#### 41 ... no wait\n#### 42", {"pattern": r"####\s*(\S+)"}, 1.0),  # the last match counts
    ("#### 41", {"pattern": r"####\s*(\S+)", "format_score": 0.1}, 0.1),  # formatted, wrong
    ("42", {"pattern": r"####\s*(\S+)", "format_score": 0.1}, 0.0),  # right, unformatted
    ("<answer>42</answer>", {"pattern": r"<answer>.*?</answer>"}, 0.0),  # whole match is the answer
])
def test_exact_match_reward(response, kwargs, want):
    assert exact_match_reward("prompt", response, "42", **kwargs) == want


def test_exact_match_pattern_with_two_groups_is_an_error():
    with pytest.raises(ValueError, match="has 2 groups"):
        exact_match_reward("p", "a=1", "1", pattern=r"(\w)=(\d)")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's reward module, importable the way ``task.reward._target_=my_rewards.fn`` imports it."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def keyword(prompt_text, response_text, answer, *, bonus=0.0):
            return float(answer in response_text) + bonus * ("apples" in prompt_text)

        def explode(prompt_text, response_text, answer):
            raise ZeroDivisionError("the user's bug")

        def two_args(prompt_text, response_text):
            return 0.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


def make_task(tmp_path, chat_dir, reward, **kwargs):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return DatasetTask(data_path=str(data), tokenizer_path=str(chat_dir), reward=reward, prompt_field="q",
                       answer_field="a", shuffle=False, **kwargs)


def step_rng(step):
    """The generator the RolloutManager draws step ``step``'s prompts with (run seed 0)."""
    return np.random.default_rng([0, step])


def encode(task, text):
    return task.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]


def test_custom_reward_by_target(tmp_path, chat_dir, user_module):
    spec = OmegaConf.create({"_target_": f"{user_module}.keyword", "bonus": 0.25})
    task = make_task(tmp_path, chat_dir, spec)
    apples, half = task.sample_prompts(2, 0, step_rng(0))
    assert task.reward(apples, encode(task, "She has 5.")) == 1.25  # answer found, and "apples" in the prompt
    assert task.reward(apples, encode(task, "She has 4.") + [len(task.tokenizer) + 3]) == 0.25  # padded id: no text
    assert task.reward(half, encode(task, "It is \\frac{1}{2}")) == 1.0


def test_reward_override_on_the_command_line(chat_dir, user_module):
    register_configs()
    with initialize_config_dir(config_dir=str(GSM8K_CONF.parents[1]), version_base="1.3"):
        cfg = compose("config", overrides=["task=gsm8k", f"task.tokenizer_path={chat_dir}",
                                           "task.reward._target_=my_rewards.keyword", "+task.reward.bonus=0.5"])
    task = instantiate(cfg.task)
    prompt = task.sample_prompts(1, 0, step_rng(0))[0]
    assert task.reward(prompt, encode(task, f"{prompt.target}0")) == 1.0  # a substring: math_reward would say 0


def test_reward_targets_are_checked_at_start_up(user_module):
    with pytest.raises(ConfigError, match="task.reward._target_='my_rewards.missing' cannot be imported"):
        load_reward({"_target_": "my_rewards.missing"})
    with pytest.raises(ConfigError, match="task.reward._target_='no_such_module.fn' cannot be imported"):
        load_reward({"_target_": "no_such_module.fn"})
    with pytest.raises(ConfigError, match="cannot be called as fn\\(prompt_text, response_text, answer\\)"):
        load_reward({"_target_": "my_rewards.two_args"})
    with pytest.raises(ConfigError, match="answer, scale=...\\)"):
        load_reward({"_target_": "my_rewards.keyword", "scale": 2})
    with pytest.raises(ConfigError, match="task.reward has no _target_"):
        load_reward({"bonus": 1})


def test_raising_reward_stops_naming_the_sample(tmp_path, chat_dir, user_module):
    task = make_task(tmp_path, chat_dir, {"_target_": "my_rewards.explode"})
    prompt = task.sample_prompts(2, 1, step_rng(1))[1]  # position 3: record 1 of the two
    with pytest.raises(RewardError, match=r"reward my_rewards.explode failed on prompt_id=3 \(record 1 of .*d.jsonl\)"
                                          r": ZeroDivisionError: the user's bug"):
        task.reward(prompt, encode(task, "5"))


def test_raising_reward_drops_and_counts(tmp_path, chat_dir, user_module, caplog):
    task = make_task(tmp_path, chat_dir, {"_target_": "my_rewards.explode"}, on_reward_error="drop")
    with caplog.at_level(logging.WARNING):
        rewards = [task.reward(p, encode(task, "5")) for p in task.sample_prompts(2, 0, step_rng(0))]
    assert all(math.isnan(r) for r in rewards)  # the RolloutManager drops a group with a non-finite reward
    assert task.num_reward_errors == 2
    assert "prompt_id=1 (record 1" in caplog.text and "task.on_reward_error=drop" in caplog.text


def test_a_reward_that_returns_no_number_is_an_error(tmp_path, chat_dir):
    task = make_task(tmp_path, chat_dir, {"_target_": "builtins.print"})  # returns None
    with pytest.raises(RewardError, match="reward builtins.print failed on prompt_id=0.*TypeError"):
        task.reward(task.sample_prompts(1, 0, step_rng(0))[0], encode(task, "5"))


# The task as a Ray actor, the way the RolloutManager holds it: built and called inside an actor's process.
RemoteTask = ray.remote(num_cpus=0)(DatasetTask)


def remote_rewards(actor, task, responses):
    prompts = ray.get(actor.sample_prompts.remote(len(responses), 0, step_rng(0)))
    return ray.get([actor.reward.remote(p, encode(task, r)) for p, r in zip(prompts, responses)])


def scorer_kwargs(task, chat_dir, reward):
    """The same task again, to be built inside an actor, with ``reward``."""
    return {"data_path": str(task.data_path), "tokenizer_path": str(chat_dir), "prompt_field": "q",
            "answer_field": "a", "shuffle": False, "reward": reward}


def test_math_reward_in_ray_actors(tmp_path, chat_dir, ray_local):
    task = make_task(tmp_path, chat_dir, {"_target_": "rlfw.rollout.rewards.math_reward"})
    kwargs = scorer_kwargs(task, chat_dir, {"_target_": "rlfw.rollout.rewards.math_reward", "timeout_s": 3})
    responses = ["\\boxed{5}", "0.5", "\\boxed{6}", "1/2"]
    want = [1.0, 1.0, 0.0, 1.0]
    assert [task.reward(p, encode(task, r)) for p, r in zip(task.sample_prompts(4, 0, step_rng(0)), responses)] == want
    # A plain actor runs its methods in the worker's main thread, where math-verify's signal timeouts work.
    assert remote_rewards(RemoteTask.remote(**kwargs), task, responses) == want
    # A threaded actor (the RolloutManager is one) scores in a worker process, with the same results.
    assert remote_rewards(RemoteTask.options(max_concurrency=2).remote(**kwargs), task, responses) == want


@pytest.mark.parametrize("grace_s", [5.0, -2.5])  # math-verify's timeout in the worker; the worker killed first
def test_a_response_that_would_keep_sympy_busy_forever_scores_zero_off_the_main_thread(grace_s, monkeypatch, caplog):
    """``2^(2^(2^(2^5)))`` keeps SymPy busy for good. Off the main thread, where math-verify's signal timeouts
    cannot start, the score is computed in a worker process: its timeouts hold there, and a worker that outlives
    them is killed at the deadline (forced here by a negative grace); either way the response scores 0.0 and the
    next score works."""
    from rlfw.rollout.rewards import math_answer

    def in_a_thread(response, answer):
        out = []
        thread = threading.Thread(target=lambda: out.append(math_reward("", response, answer, timeout_s=1)),
                                  daemon=True)
        thread.start()
        thread.join(timeout=300)
        assert not thread.is_alive(), "scoring waited past its deadline"
        return out[0]

    assert in_a_thread(r"\boxed{1}", "1") == 1.0  # a started worker: its start-up is not part of the deadline
    monkeypatch.setattr(math_answer, "WORKER_GRACE_S", grace_s)
    with caplog.at_level(logging.WARNING, logger=math_answer.__name__):
        assert in_a_thread(r"\boxed{2^{2^{2^{2^{5}}}}}", "1") == 0.0
    assert ("its worker was killed" in caplog.text) == (grace_s < 0)
    monkeypatch.setattr(math_answer, "WORKER_GRACE_S", 5.0)
    assert in_a_thread(r"\boxed{\frac{1}{2}}", "0.5") == 1.0


SCORER = """
import sys, threading
from rlfw.rollout.rewards import math_reward
def score(response, timeout_s):
    thread = threading.Thread(target=math_reward, args=("", response, "1"), kwargs={"timeout_s": timeout_s})
    thread.start()
    return thread
score("1", 5).join()
print("warm", flush=True)
score(sys.argv[1], 600)
"""


def assert_ended(process: psutil.Process, timeout_s: float) -> None:
    """An orphan is reaped by whatever adopted it, if anything does: a zombie counts as ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"the worker {process.pid} outlived its killed parent"
        time.sleep(0.1)


def test_a_killed_scorer_leaves_no_worker_running(tmp_path):
    """A RolloutManager SIGKILLed while its worker is busy in SymPy must not leave that worker computing for
    minutes: the worker dies with the process, although it was started for a request thread that has ended."""
    scorer = subprocess.Popen([sys.executable, "-c", SCORER, r"\boxed{2^{2^{2^{2^{5}}}}}"], stdout=subprocess.PIPE,
                              text=True)
    workers = []
    try:
        assert scorer.stdout.readline() == "warm\n", "the scorer did not score its first response"
        workers = [c for c in psutil.Process(scorer.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 1, workers  # the pool's worker, not the resource tracker
        idle = workers[0].cpu_times().user
        deadline = time.monotonic() + 120
        while workers[0].cpu_times().user < idle + 1.0:  # busy on the endless response
            assert time.monotonic() < deadline, "the worker never started on the second response"
            time.sleep(0.1)
        scorer.send_signal(signal.SIGKILL)
        scorer.wait(timeout=30)
        assert_ended(workers[0], timeout_s=60)
    finally:
        scorer.kill()
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()


def test_reward_error_surfaces_from_a_ray_actor(tmp_path, chat_dir, ray_local):
    task = make_task(tmp_path, chat_dir, {"_target_": "rlfw.rollout.rewards.math_reward"})
    kwargs = scorer_kwargs(task, chat_dir, {"_target_": "rlfw.rollout.rewards.exact_match_reward", "pattern": "(a)(b)"})
    with pytest.raises(RewardError, match="reward rlfw.rollout.rewards.exact_match_reward failed on prompt_id=0"):
        remote_rewards(RemoteTask.remote(**kwargs), task, ["5"])
