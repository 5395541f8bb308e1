"""Copy-task variants whose reward variance is known in advance, for the dynamic-sampling tests."""

from rlfw.rollout.tasks.copy import CopyTask


class HalfSignalTask(CopyTask):
    """Prompts whose first symbol has an even id score a constant (a zero-variance group); the others score by
    their response, which differs between samples."""

    def reward(self, prompt, response_ids):
        if prompt.token_ids[1] % 2 == 0:
            return 0.5
        return float(hash(tuple(response_ids)) % 1000) / 1000


class NoSignalTask(CopyTask):
    """Every group has equal rewards."""

    def reward(self, prompt, response_ids):
        return 1.0
