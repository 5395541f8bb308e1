"""ChatToolEnv: a dataset task (GSM8K) in which the policy may call tools through its chat template.

Prompts, reference answers and the reward are the ``DatasetTask``'s (``task.dataset``). A turn that holds tool
calls (Qwen2.5-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) is answered with one message
of role ``tool_role`` per call (the tool's output, or ``error: ...``), rendered by the tokenizer's own chat template
and tokenized once; a turn without one is the final answer, scored by the task's reward. The observation is the
template's text between the policy's end of turn and the next assistant turn's start (what the template writes
after the assistant message, the tool messages and the generation prompt), so the episode's tokens are what the
template would give for the whole conversation, with the policy's tokens exactly as sampled. A turn cut off by its
token limit is closed by the observation (it starts with the end-of-turn token the policy did not write).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlfw.rollout.envs.base import Done, Observation, TaskPrompts
from rlfw.rollout.envs.episode import Episode
from rlfw.rollout.envs.tool_env import ToolEnvironment
from rlfw.rollout.envs.tools import ToolCall, parse_tool_calls
from rlfw.rollout.tasks.dataset import DatasetTask

# Stands for the conversation before the observation: only the template's text after it is kept.
_BEFORE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "?"}]


class ChatToolEnv(TaskPrompts, ToolEnvironment):
    """``dataset``: the ``DatasetTask`` arguments (its ``system_prompt`` should tell the model its tools and the
    call format); ``tools``, ``tool_pool``, ``max_turns``: as ``ToolEnvironment``; ``max_calls_per_turn``: calls
    past it are answered with an error."""

    def __init__(self, dataset: Mapping[str, Any], tool_pool: Mapping[str, Any],
                 tools: Sequence[str] = ("rlfw.rollout.envs.builtin_tools.python",), max_turns: int = 4,
                 tool_role: str = "tool", max_calls_per_turn: int = 4) -> None:
        super().__init__(tools, tool_pool, max_turns)
        self.task = DatasetTask(**dataset)
        tokenizer = self.task.tokenizer
        if tokenizer.chat_template is None:
            raise ValueError(f"task.dataset.tokenizer_path={dataset['tokenizer_path']}: a tool environment needs a "
                             "tokenizer with a chat template")
        self.tool_role, self.max_calls_per_turn = tool_role, max_calls_per_turn
        self._eos_text = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)
        before = tokenizer.apply_chat_template(_BEFORE, tokenize=False)
        if self._eos_text not in before:
            raise ValueError(f"the chat template does not end an assistant turn with the eos token {self._eos_text!r}")
        self._before = before[:before.rindex(self._eos_text) + len(self._eos_text)]

    def step(self, episode: Episode) -> Observation | Done:
        vocab = len(self.tokenizer)
        text = self.tokenizer.decode([t for t in episode.last_turn if t < vocab], skip_special_tokens=True)
        calls = parse_tool_calls(text)
        if not calls:
            return Done(self.task.reward(episode.prompt, episode.last_turn))
        messages = []
        for index, call in enumerate(calls):
            if index >= self.max_calls_per_turn:
                call = ToolCall(call.name, error=f"at most {self.max_calls_per_turn} calls per turn")
            result = self.call_tool(episode, call)
            content = result.output if result.error is None else f"error: {result.error}"
            messages.append({"role": self.tool_role, "content": content})
        return Observation(self.observation_ids(messages, closed=episode.last_finish == "stop"))

    def observation_ids(self, messages: list[dict[str, str]], closed: bool = True) -> list[int]:
        """The template's tokens for ``messages`` after an assistant turn, up to the next assistant turn's start;
        ``closed``: the turn ended with the eos token (else the observation writes it first)."""
        full = self.tokenizer.apply_chat_template(_BEFORE + messages, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self._before):
            raise ValueError("the chat template renders the conversation before a tool message differently with it")
        text = full[len(self._before):]
        return self.tokenizer(("" if closed else self._eos_text) + text, add_special_tokens=False)["input_ids"]
