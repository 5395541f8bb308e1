"""GSM8K with the Python tool through the chat template: a call is answered with a tool message rendered by the
template, the whole episode is the template's conversation with the policy's tokens as sampled, and the final
answer is scored by the dataset's reward."""

import numpy as np
import pytest
from chat_tokenizer import build_chat_tokenizer
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlfw.rollout.envs.base import Done, Observation
from rlfw.rollout.envs.episode import Episode
from rlfw.rollout.types import Generation

CONF = OmegaConf.load("conf/task/gsm8k_tools.yaml")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tokenizer_dir = build_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))
    cfg = OmegaConf.merge(CONF, {"dataset": {"tokenizer_path": str(tokenizer_dir), "seed": 0},
                                 "tool_pool": {"workers": 1, "timeout_s": 10.0}})
    env = instantiate(cfg)
    yield env
    env.close()


def turn(env, episode, text, finish="stop"):
    ids = env.tokenizer(text, add_special_tokens=False)["input_ids"]
    if finish == "stop":
        ids.append(env.tokenizer.eos_token_id)
    episode.add_turn(Generation(ids, [-1.0] * len(ids), finish, 0))
    return env.step(episode)


def test_a_python_call_then_the_answer(env):
    prompt = env.sample_prompts(1, 0, np.random.default_rng(0))[0]
    episode = Episode(prompt, env.start(prompt))
    call = f'Let me compute.<tool_call>{{"name": "python", "arguments": {{"code": "print({prompt.target} * 1)"}}}}' \
           '</tool_call>'
    observation = turn(env, episode, call)
    assert isinstance(observation, Observation)
    tok = env.tokenizer
    reply = f"\n<|im_start|>tool\n{prompt.target}\n<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(observation.token_ids) == reply
    episode.add_observation(observation.token_ids)
    done = turn(env, episode, f"The answer is \\boxed{{{prompt.target}}}.")
    assert done == Done(1.0)
    # The episode is the template's whole conversation; only the policy's two turns are trained.
    conversation = tok.decode(episode.tokens)
    assert conversation.endswith(f"{call}<|im_end|>\n<|im_start|>tool\n{prompt.target}\n<|im_end|>\n"
                                 f"<|im_start|>assistant\nThe answer is \\boxed{{{prompt.target}}}.<|im_end|>")
    trained = [t for t, m in zip(episode.tokens[episode.prompt_len:], episode.loss_mask) if m]
    assert tok.decode(trained) == f"{call}<|im_end|>The answer is \\boxed{{{prompt.target}}}.<|im_end|>"
    assert [(r.name, r.error) for r in episode.tools] == [("python", None)]


def test_bad_calls_are_error_observations(env):
    prompt = env.sample_prompts(1, 0, np.random.default_rng(1))[0]
    episode = Episode(prompt, env.start(prompt))
    text = ('<tool_call>{"name": "python", "arguments": {"code": "1/0"}}</tool_call><tool_call>{broken</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    observation = turn(env, episode, text, finish="length")  # cut off: the observation ends the turn for it
    rendered = env.tokenizer.decode(observation.token_ids)
    assert rendered.startswith("<|im_end|>\n<|im_start|>tool\nerror: python failed: ")
    assert "ZeroDivisionError: division by zero<|im_end|>" in rendered
    assert "error: the call is not valid JSON" in rendered and "error: there is no tool 'search'" in rendered
    assert [r.name for r in episode.tools] == ["python", "unknown", "unknown"]
    assert all(r.error for r in episode.tools)
