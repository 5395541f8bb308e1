"""The calc environment on scripted turns: the tool's answer as the observation, what each turn earns, the tool
disabled, malformed calls; and the episode's token bookkeeping (what is trained, what is context, which turn)."""

import numpy as np
import pytest

from rlfw.rollout.envs.base import Done, Observation
from rlfw.rollout.envs.calc import CalcEnv
from rlfw.rollout.envs.episode import Episode
from rlfw.rollout.types import Generation


@pytest.fixture(scope="module")
def env():
    env = CalcEnv({"workers": 1, "timeout_s": 10.0}, digits=2)
    yield env
    env.close()


def turn(env, episode, words, finish="stop", version=0):
    ids = env.tokenizer.convert_tokens_to_ids(words)
    episode.add_turn(Generation(ids, [-0.5] * len(ids), finish, version))
    return env.step(episode)


def words_of(env, ids):
    return env.tokenizer.convert_ids_to_tokens(ids)


def test_a_good_episode_calls_the_tool_and_copies_its_answer(env):
    prompt = env.sample_prompts(1, 0, np.random.default_rng(3))[0]
    expression = words_of(env, prompt.token_ids)[1:-1]  # <bos> a1 a2 b1 b2 =
    a, b = int("".join(expression[:2])), int("".join(expression[2:]))
    episode = Episode(prompt, env.start(prompt))
    answer = turn(env, episode, ["calc", *expression, "<eos>"])
    assert isinstance(answer, Observation) and answer.reward == pytest.approx(0.5)  # the call's: every operand
    assert words_of(env, answer.token_ids) == ["->", *f"{a + b:03d}", "="]
    episode.credit(answer.reward)
    episode.add_observation(answer.token_ids)
    done = turn(env, episode, [*f"{a + b:03d}", "<eos>"], version=1)
    assert done == Done(pytest.approx(0.5))  # the answer's: the tool's answer copied, and the stop
    episode.finish(done.reward, "done")
    assert episode.turn_rewards == [pytest.approx(0.5)] * 2 and episode.reward == pytest.approx(1.0)
    # One sequence: the prompt, the call, the observation, the answer; only the policy's tokens are trained.
    assert episode.tokens[:len(prompt.token_ids)] == prompt.token_ids
    assert episode.loss_mask == [1.0] * 6 + [0.0] * 5 + [1.0] * 4
    assert episode.token_turns == [0] * 6 + [0] * 5 + [1] * 4  # the observation goes with the turn it answers
    assert episode.logprobs == [-0.5] * 6 + [0.0] * 5 + [-0.5] * 4
    assert episode.versions == [0] * 6 + [1] * 4 and not episode.partial  # a push between turns: not partial
    assert [(r.name, r.error) for r in episode.tools] == [("calc", None)]


def test_partial_credit_and_what_a_wrong_call_earns(env):
    prompt = env.sample_prompts(1, 0, np.random.default_rng(4))[0]
    expression = words_of(env, prompt.token_ids)[1:-1]
    target = words_of(env, prompt.target)
    # An answer without calling earns only as the whole sum and the stop: all digits but the last earn nothing.
    episode = Episode(prompt, env.start(prompt))
    assert turn(env, episode, [*target[:-1], "9" if target[-1] != "9" else "8", "<eos>"]) == Done(0.0)
    episode = Episode(prompt, env.start(prompt))
    assert turn(env, episode, [*target, "<eos>"]) == Done(pytest.approx(0.5))
    episode = Episode(prompt, env.start(prompt))
    assert turn(env, episode, target, finish="length") == Done(0.0)
    # A call with one operand digit wrong reaches the tool and earns 3/4 of the operands' share; its answer is
    # credited for copying what the tool said (another sum), here without the stop (it ran out of tokens).
    episode = Episode(prompt, env.start(prompt))
    wrong = [*expression[:3], "0" if expression[3] != "0" else "1"]
    observation = turn(env, episode, ["calc", *wrong, "<eos>"])
    assert words_of(env, observation.token_ids)[0] == "->" and observation.reward == pytest.approx(0.5 * 3 / 4)
    told = words_of(env, observation.token_ids)[1:-1]
    assert told != target
    episode.add_observation(observation.token_ids)
    assert turn(env, episode, told, finish="length") == Done(pytest.approx(0.4))
    # A malformed call is an error observation, recorded; its operands are credited all the same (none here); an
    # answer after the failed call is a guess, and earns nothing, even when it is the sum.
    episode = Episode(prompt, env.start(prompt))
    observation = turn(env, episode, ["calc", "calc", "<eos>"])
    assert words_of(env, observation.token_ids) == ["->", "error", "="] and observation.reward == 0.0
    assert episode.tools[0].error == "a call is calc and the 4 digits of the two operands"
    episode.add_observation(observation.token_ids)
    assert turn(env, episode, [*target, "<eos>"]) == Done(0.0)
    # Only the first call's operands earn.
    assert turn(env, episode, ["calc", *expression, "<eos>"]).reward == 0.0


def test_without_the_tool_a_call_is_an_error_and_earns_nothing():
    env = CalcEnv({"workers": 1}, digits=2, tools=[])
    prompt = env.sample_prompts(1, 0, np.random.default_rng(5))[0]
    episode = Episode(prompt, env.start(prompt))
    observation = turn(env, episode, ["calc", *words_of(env, prompt.token_ids)[1:-1], "<eos>"])
    assert words_of(env, observation.token_ids) == ["->", "error", "="]
    assert [(r.name, r.error) for r in episode.tools] == [("unknown", "the calculator is disabled")]
    assert observation.reward == 0.0


def test_bad_configs_name_the_key():
    with pytest.raises(ValueError, match="task.max_turns=0"):
        CalcEnv({}, max_turns=0)
    with pytest.raises(ValueError, match="task.digits=9"):
        CalcEnv({}, digits=9)
    with pytest.raises(ValueError, match="knows only the tool named 'calc'"):
        CalcEnv({}, tools=["rlfw.rollout.envs.builtin_tools.python"])


def test_limits_end_an_episode_flagged_and_a_bad_answer_names_the_environment(env):
    from rlfw.rollout.envs.runner import apply_answer, episode_stats
    from rlfw.rollout.manager import reward_value

    def check(value):
        return reward_value(value, {"_target_": "rlfw.rollout.envs.calc.CalcEnv"})

    prompt = env.sample_prompts(1, 0, np.random.default_rng(6))[0]
    expression = words_of(env, prompt.token_ids)[1:-1]
    episodes = []
    for max_seq_len, turns in ((64, env.max_turns), (17, 1)):  # the turn limit; then no room for the next turn
        episode = Episode(prompt, env.start(prompt))
        for _ in range(turns):
            answer = turn(env, episode, ["calc", *expression, "<eos>"])
            apply_answer(env, episode, answer, max_seq_len, check)
        assert episode.end == ("turn_limit" if turns > 1 else "token_limit") and episode.truncated
        assert episode.reward == pytest.approx(0.5) and episode.turns == turns  # the first call's operands
        assert episode.turn_rewards == [pytest.approx(0.5)] + [0.0] * (turns - 1)
        episodes.append(episode)
    stats = episode_stats(episodes, env_seconds=1.0, generate_seconds=4.0)
    assert stats["env/turn_limit_episodes"] == stats["env/token_limit_episodes"] == 1
    assert stats["env/truncated_episodes"] == 2 and stats["env/share"] == 0.25
    assert stats["env/tool_calls/calc"] == env.max_turns + 1 and stats["env/tool_errors/calc"] == 0
    assert stats["env/turn_reward/0"] == pytest.approx(0.5) and stats["env/turn_reward/1"] == 0.0
    episode = Episode(prompt, env.start(prompt))
    episode.add_turn(Generation([5], [0.0], "stop", 0))
    with pytest.raises(TypeError, match="CalcEnv returned '1' \\(str\\); a reward must be a real number"):
        apply_answer(env, episode, Done("1"), 64, check)
    with pytest.raises(TypeError, match="CalcEnv.step returned str; it must return an Observation or Done"):
        apply_answer(env, episode, "1", 64, check)


def test_a_push_inside_a_turn_is_a_partial_rollout_and_one_between_turns_is_not(env):
    from rlfw.rollout.queue import StalenessError, staleness

    prompt = env.sample_prompts(1, 0, np.random.default_rng(7))[0]
    between, inside = Episode(prompt, env.start(prompt)), Episode(prompt, env.start(prompt))
    for episode, second in ((between, [2, 2]), (inside, [2, 3])):
        episode.add_turn(Generation([5, 6], [0.0, 0.0], "stop", 2, token_versions=[2, 2]))
        episode.add_observation([7])
        episode.add_turn(Generation([5, 6], [0.0, 0.0], "stop", second[0], token_versions=second))
    between.add_turn(Generation([5], [0.0], "stop", 3))  # a third turn, under the pushed weights
    assert (between.partial, inside.partial) == (False, True)
    versions = [between.versions, inside.versions]
    stats = staleness(versions, 4, 2, [between.partial, inside.partial])
    assert stats["loop/partial_rollout_frac"] == 0.5 and stats["loop/staleness_max"] == 2  # the oldest token: v2
    with pytest.raises(StalenessError, match="sample 0 has tokens of policy versions \\[2, 3\\]"):
        staleness(versions, 5, 2, [between.partial, inside.partial])
