"""A task whose reward function raises: how a user's bug inside a Ray actor must surface."""

from rlfw.rollout.tasks.copy import CopyTask


class CrashingTask(CopyTask):
    def reward(self, prompt, response_ids):
        raise ValueError("reward function exploded")
