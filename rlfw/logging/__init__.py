"""Metrics loggers for training runs; see ``loggers`` for the backends and ``wandb_files`` for reading W&B run files."""

from rlfw.logging.loggers import (
    LOGGER_NAMES,
    ConsoleLogger,
    JsonlLogger,
    Logger,
    MultiLogger,
    WandbLogger,
    build_loggers,
)
from rlfw.logging.wandb_files import iter_wandb_records, read_wandb_offline_history

__all__ = [
    "LOGGER_NAMES",
    "ConsoleLogger",
    "JsonlLogger",
    "Logger",
    "MultiLogger",
    "WandbLogger",
    "build_loggers",
    "iter_wandb_records",
    "read_wandb_offline_history",
]
