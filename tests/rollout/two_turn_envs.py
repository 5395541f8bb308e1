"""Calc environments whose episodes always take a second turn, for the rollout manager's episode tests."""

import os
import signal
from pathlib import Path

from rlfw.rollout.envs.base import Observation
from rlfw.rollout.envs.calc import CalcEnv


class TwoTurnCalcEnv(CalcEnv):
    """The first turn is answered with an error observation whatever it says; the second is the final answer."""

    def step(self, episode):
        if episode.turns == 1:
            return Observation(self._encode(["->", "error", "="]))
        return super().step(episode)


class EngineKillingCalcEnv(TwoTurnCalcEnv):
    """SIGKILLs the process named in ``kill_file`` when it answers the first turn of an episode (once: the file is
    taken), so the second turns go out to a dead engine: the engine dies in the middle of every episode."""

    def __init__(self, kill_file: str, **kwargs):
        super().__init__(**kwargs)
        self.kill_file = Path(kill_file)

    def step(self, episode):
        taken = self.kill_file.with_suffix(".taken")
        if episode.turns == 1:
            try:
                self.kill_file.rename(taken)  # atomic: one of the episode threads wins
            except FileNotFoundError:
                pass
            else:
                os.kill(int(taken.read_text()), signal.SIGKILL)
        return super().step(episode)
