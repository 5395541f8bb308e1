"""Verifiable tasks: each samples prompts and scores responses with an exact, programmatic reward."""

from rlfw.rollout.tasks.copy import CopyTask

__all__ = ["CopyTask"]
