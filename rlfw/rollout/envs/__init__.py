"""Environments: multi-turn episodes in which the policy talks to tools (or a simulated user) until a reward.

A task is a one-turn environment (``OneTurn``). The episode is token ids from start to end, held by the rollout
manager (``Episode``), driven turn by turn through the engine pool (``runner``); tools run in worker processes
(``tool_pool``). Nothing here imports torch: tool workers import this package.
"""
