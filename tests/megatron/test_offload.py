"""The colocated handover: a trainer's optimizer state and gradient buffers leave the device and come back bitwise,
and the run goes on as if they had never left."""

import torch
from random_rollouts import random_rollout

from rlfw.config.schema import AlgoConfig
from rlfw.data.batch import RolloutBatch
from rlfw.model.shape import ModelShape
from rlfw.megatron.offload import optimizer_tensors, trainer_offload

SHAPE = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                   vocab_size=16, max_seq_len=32)


def make_trainer():
    from rlfw.megatron.policy import PolicyTrainer

    algo = AlgoConfig(name="grpo", lr=1e-2, max_tokens_per_microbatch=64)
    return PolicyTrainer(SHAPE, algo, tp=1, temperature=1.0, device=torch.device("cpu"), init_seed=0)


def batch_for(trainer, seed: int) -> RolloutBatch:
    batch = random_rollout(SHAPE.vocab_size, 8, seed, max_prompt=5, max_response=8)
    batch.samples.update(trainer.logprobs(batch))
    (minibatch,) = batch.minibatches(0)
    return minibatch


def step(trainer, batch) -> dict:
    trainer.zero_grad()
    sums = trainer.forward_backward(batch)
    assert trainer.optimizer_step() is not None
    return sums


def test_released_state_comes_back_bitwise_and_training_goes_on_unchanged(megatron_world):
    moved, control = make_trainer(), make_trainer()
    offload = trainer_offload(moved)
    for trainer in (moved, control):
        step(trainer, batch_for(trainer, 0))  # Adam's moments exist from here on
    before = [t.clone() for t in optimizer_tensors(moved.optimizer)]
    weights = {id(p) for p in moved.model.parameters()}
    state = [t for t in optimizer_tensors(moved.optimizer) if id(t) not in weights]
    assert state  # Adam's moments and step counters (fp32 on CPU: the parameters are the model's own)

    offload.release()
    assert all(t.untyped_storage().nbytes() == 0 for t in state)
    assert all(b.untyped_storage().nbytes() == 0 for b in moved.grad_buffers())
    assert all(p.untyped_storage().nbytes() > 0 for p in moved.model.parameters())  # log-probs still run
    assert moved.logprobs(batch_for(control, 1)) == control.logprobs(batch_for(control, 1))
    offload.release()  # idempotent
    assert offload.last["released_gib"] > 0

    offload.restore()
    for got, want in zip(optimizer_tensors(moved.optimizer), before):
        assert torch.equal(got, want)
    assert all(torch.count_nonzero(b) == 0 for b in moved.grad_buffers())
    with offload.resident():  # a checkpoint save in between: no-op when resident
        pass
    assert not offload.released

    for trainer in (moved, control):
        sums = step(trainer, batch_for(trainer, 2))
        trainer.sums = sums
    assert moved.sums == control.sums
    for (name, a), (_, b) in zip(moved.named_weights().items(), control.named_weights().items()):
        assert torch.equal(a, b), name


def test_resident_gives_the_state_back_for_a_save_then_releases_it(megatron_world):
    trainer = make_trainer()
    step(trainer, batch_for(trainer, 0))
    offload = trainer_offload(trainer)
    offload.release()
    with offload.resident():
        assert all(t.untyped_storage().nbytes() > 0 for t in optimizer_tensors(trainer.optimizer))
    assert offload.released
