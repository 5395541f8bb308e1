"""A trainer's checkpoint (Megatron's distributed checkpointing, as rlfw/checkpoint/state.py calls it): saved and
loaded back bitwise, and a save leaves no process of its own running."""

import psutil
import torch
from test_offload import batch_for, make_trainer, step

from rlfw.checkpoint.state import load_state, read_model_weights, save_state


def running_children() -> set:
    return {c.pid for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE}


def test_a_save_loads_back_bitwise_and_leaves_no_process_behind(megatron_world, tmp_path):
    trainer = make_trainer()
    step(trainer, batch_for(trainer, 0))
    before = running_children()
    save_state(str(tmp_path / "ckpt"), trainer, {"step": 1})
    # Megatron's writer builds a multiprocessing Manager (a spawned server) for async saves: a synchronous save has
    # no use for it, and it outlived a trainer SIGKILLed after its first save.
    assert running_children() - before == set()

    saved = read_model_weights(str(tmp_path / "ckpt"))
    restored = make_trainer()  # its own init weights, then the checkpoint's
    step(restored, batch_for(restored, 1))
    assert load_state(str(tmp_path / "ckpt"), restored) == {"step": 1}
    for name, value in restored.model.module.state_dict().items():
        if name in saved:
            assert torch.equal(value, saved[name]), name
    # the optimizer came back too: the next step is the same step on both
    step(trainer, batch_for(trainer, 2))
    step(restored, batch_for(restored, 2))
    for a, b in zip(trainer.model.parameters(), restored.model.parameters()):
        assert torch.equal(a, b)
