"""A heal's deadline is sized from the state it sends, not the collective timeout."""

from types import SimpleNamespace

import pytest
import torch

from rlfw.ft.cell_sync import heal_deadline_s, heal_state_bytes


def test_a_heal_deadline_grows_with_the_state_it_sends():
    """A 1.5B-parameter bf16 model with Adam is ~21 GB: at the default 50 MB/s floor it gets minutes, not the 30 s
    collective timeout that would fail every heal of it."""
    ft = SimpleNamespace(collective_timeout_s=30.0, heal_min_bandwidth_mb_s=50.0)
    fp32 = torch.nn.Linear(1000, 1000, bias=False)
    assert heal_state_bytes(fp32) == 1_000_000 * (4 + 8)
    assert heal_state_bytes(fp32.to(torch.bfloat16)) == 1_000_000 * (2 + 8 + 4)
    assert heal_deadline_s(0, ft) == 30.0
    assert heal_deadline_s(1_500_000_000 * 14, ft) == pytest.approx(30.0 + 420.0)
