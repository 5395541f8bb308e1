import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # the e2e harness runs the real stack


@pytest.fixture(scope="session")
def cuda_world():
    """A one-rank NCCL world with Megatron's parallel state on GPU 0, set up once per test process."""
    import torch.distributed as dist

    from bench.gpu import setup

    device = torch.device("cuda", 0)
    if not dist.is_initialized():
        setup.init_world(device)
    return device
