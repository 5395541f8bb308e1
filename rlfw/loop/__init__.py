"""The RL loop (``run``) and its parts beside it: the roles it trains (``roles``), a step before it trains
(``prepare``), the exactly-once ledger (``ledger``), a role's figures (``metrics``) and what a lost step does
(``recovery``)."""

from rlfw.loop.prepare import NothingToTrainError
from rlfw.loop.roles import build_roles
from rlfw.loop.run import run_loop

__all__ = ["NothingToTrainError", "build_roles", "run_loop"]
