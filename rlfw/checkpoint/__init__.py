"""Checkpoints of the trained state: written by the writer replica, committed atomically by the driver.

``state`` is the trainer side (Megatron distributed checkpointing), ``layout`` the directory format and its
integrity checks, ``checkpointer`` when to save, and ``resume`` how a run picks a checkpoint up again.
"""

from rlfw.checkpoint.checkpointer import Checkpointer
from rlfw.checkpoint.layout import CheckpointError, commit, find_latest, read_meta, verify

__all__ = ["CheckpointError", "Checkpointer", "commit", "find_latest", "read_meta", "verify"]
