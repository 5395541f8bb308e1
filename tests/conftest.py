"""Shared test setup: nothing leaves the machine, and worker processes stay single-threaded."""

import os

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_BASE_URL", "http://127.0.0.1:9")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")
