"""The loss options inside the real Megatron trainer, in worlds of their own (spawned Gloo processes on loopback):

- the chunked output head under TP=2 (vocabulary-sharded weight) equals the whole vocabulary's unfused math:
  log-probs, entropy, and the gradients of the hidden state and of each weight shard;
- a TP=2 trainer step with every loss term on computes the loss, its terms and the gradient norm of TP=1;
- a non-finite ratio skips the optimizer step (gradients NaN, weights untouched), a finite one does not;
- the frozen reference model exists exactly when a KL term (loss or reward) needs it.
"""

import os
import random
from datetime import timedelta

import pytest
import torch

import forked
from rlfw.config.schema import AlgoConfig
from rlfw.data.batch import RolloutBatch
from rlfw.model.shape import ModelShape

SHAPE = ModelShape(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=16,
    max_seq_len=32,
)
EVERY_TERM = AlgoConfig(name="grpo", lr=1e-3, clip_eps_high=0.28, dual_clip_c=3.0, kl_loss_coef=0.1, tis_cap=2.0,
                        entropy_coef=0.5, loss_agg="seq_mean_token_mean", max_tokens_per_microbatch=64)


def init_world(rank: int, world_size: int, tp: int, store_port: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from rlfw.cluster.store import connect_store
    from rlfw.megatron.cpu_compat import apply_cpu_compat

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    apply_cpu_compat()
    dist.init_process_group("gloo", store=connect_store("127.0.0.1", store_port), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    parallel_state.initialize_model_parallel(tp, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)


def spawn(entry, world_size: int, out_dir) -> list:
    """Run ``entry(rank, world_size, store_port, out_path)`` on ``world_size`` ranks; returns what each saved."""
    from rlfw.cluster.store import serve_store

    store = serve_store("127.0.0.1")
    outs = [str(out_dir / f"rank{rank}.pt") for rank in range(world_size)]
    forked.start_processes(entry, (world_size, store.port, outs), world_size)
    return [torch.load(out, weights_only=False) for out in outs]


def rollout(trainer, seed: int = 0) -> RolloutBatch:
    """Six samples; old (and reference) log-probs perturbed from the trainer's, so ratios spread across the clip
    range and the policy differs from the reference."""
    rng = random.Random(seed)
    cols = {k: [] for k in ("sample_id", "tokens", "prompt_len", "advantage")}
    for i in range(6):
        p, r = rng.randint(1, 5), rng.randint(1, 9)
        cols["sample_id"].append(i)
        cols["tokens"].append([rng.randrange(SHAPE.vocab_size) for _ in range(p + r)])
        cols["prompt_len"].append(p)
        cols["advantage"].append(rng.gauss(0.0, 1.0))
    batch = RolloutBatch(cols, {"step": 0})
    batch.samples.update(trainer.logprobs(batch))
    for key in ("old_logprobs", "ref_logprobs"):
        if key in batch.samples:
            batch.samples[key] = [[v + rng.gauss(0.0, 0.3) for v in lp] for lp in batch.samples[key]]
    batch.samples["rollout_logprobs"] = [[v + rng.gauss(0.0, 0.3) for v in lp] for lp in batch.samples["old_logprobs"]]
    (minibatch,) = batch.minibatches(0)
    return minibatch


def trainer_for(algo: AlgoConfig, tp: int):
    from rlfw.megatron.policy import PolicyTrainer

    return PolicyTrainer(SHAPE, algo, tp=tp, temperature=0.8, device=torch.device("cpu"), init_seed=0)


def head_inputs(rows: int = 7):
    """Hidden states, the whole output weight and labels for the head under TP (hidden 6, the 16-token vocab)."""
    g = torch.Generator().manual_seed(5)
    return (torch.randn(rows, 6, generator=g), torch.randn(SHAPE.vocab_size, 6, generator=g),
            torch.randint(0, SHAPE.vocab_size, (rows,), generator=g))


# ----------------------------------------------------------------------------------------------- rank entries
def _tp2_rank(rank: int, world_size: int, store_port: int, outs: list) -> None:
    from megatron.core import parallel_state

    from rlfw.megatron.head import head_logprobs

    init_world(rank, world_size, world_size, store_port)
    hidden, weight, labels = head_inputs()
    rows = SHAPE.vocab_size // world_size
    hidden = hidden.requires_grad_(True)
    shard = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    lp, entropy = head_logprobs(hidden, shard, labels, 0.8, chunk_tokens=3,
                                group=parallel_state.get_tensor_model_parallel_group(), entropy=True)
    ((lp * torch.arange(1.0, 8.0)).sum() + (entropy * torch.arange(7.0, 0.0, -1)).sum()).backward()
    trainer = trainer_for(EVERY_TERM, tp=world_size)
    trainer.zero_grad()
    sums = trainer.forward_backward(rollout(trainer))
    torch.save({"logprobs": lp.detach(), "entropy": entropy.detach(), "hidden_grad": hidden.grad,
                "shard_grad": shard.grad, "sums": sums, "grad_norm": trainer.optimizer_step()}, outs[rank])


def _one_rank(rank: int, world_size: int, store_port: int, outs: list) -> None:
    init_world(rank, world_size, 1, store_port)
    trainer = trainer_for(EVERY_TERM, tp=1)
    trainer.zero_grad()
    sums = trainer.forward_backward(rollout(trainer))
    result = {"sums": sums, "grad_norm": trainer.optimizer_step()}

    plain = trainer_for(AlgoConfig(name="grpo", max_tokens_per_microbatch=64), tp=1)
    result["reference"] = {
        "plain": plain.reference is not None,
        "kl_loss": trainer.reference is not None,
        "kl_reward": trainer_for(AlgoConfig(name="grpo", kl_reward_coef=0.1), tp=1).reference is not None,
    }
    minibatch = rollout(plain)
    assert "ref_logprobs" not in minibatch.samples
    poisoned = minibatch.select(range(len(minibatch)))
    poisoned.samples["old_logprobs"] = [list(lp) for lp in minibatch.samples["old_logprobs"]]
    poisoned.samples["old_logprobs"][2][0] = float("-inf")  # ratio exp(lp + inf) = inf on one response token
    before = {k: v.clone() for k, v in plain.named_weights().items()}
    plain.zero_grad()
    result["poisoned_sums"] = plain.forward_backward(poisoned)
    result["grads_all_nan"] = all(torch.isnan(g).all().item() for g in plain.grad_buffers())
    result["poisoned_grad_norm"] = plain.optimizer_step()
    result["unchanged"] = all(torch.equal(before[k], v) for k, v in plain.named_weights().items())
    plain.zero_grad()
    result["finite_sums"] = plain.forward_backward(minibatch)
    result["finite_grad_norm"] = plain.optimizer_step()
    result["changed"] = any(not torch.equal(before[k], v) for k, v in plain.named_weights().items())
    torch.save(result, outs[rank])


# ------------------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    (result,) = spawn(_one_rank, 1, tmp_path_factory.mktemp("tp1"))
    return result


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return spawn(_tp2_rank, 2, tmp_path_factory.mktemp("tp2"))


def test_chunked_head_under_tp2_equals_the_whole_vocabulary(tp2):
    hidden, weight, labels = head_inputs()
    hidden, weight = hidden.requires_grad_(True), weight.requires_grad_(True)
    logp = torch.log_softmax(hidden @ weight.t() / 0.8, dim=-1)
    lp, entropy = logp.gather(-1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    ((lp * torch.arange(1.0, 8.0)).sum() + (entropy * torch.arange(7.0, 0.0, -1)).sum()).backward()
    for rank in tp2:  # every rank holds the whole (replicated) log-probs, entropy and hidden-state gradient
        torch.testing.assert_close(rank["logprobs"], lp.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank["entropy"], entropy.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank["hidden_grad"], hidden.grad, rtol=1e-5, atol=1e-5)
    # and the gradient of each vocabulary shard of the weight
    torch.testing.assert_close(torch.cat([rank["shard_grad"] for rank in tp2]), weight.grad, rtol=1e-5, atol=1e-5)


def test_trainer_step_with_every_term_is_the_same_under_tp2(tp2, one_rank):
    sums = one_rank["sums"]
    for key in ("loss", "pg_loss", "kl", "entropy", "tis_weight", "dual_clip_frac", "clip_frac", "ratio"):
        assert key in sums
        for rank in tp2:
            assert rank["sums"][key] == pytest.approx(sums[key], rel=1e-4, abs=1e-6), key
    assert sums["entropy"] > 0 and sums["kl"] > 0 and 0 < sums["clip_frac"] < 1
    for rank in tp2:
        assert rank["grad_norm"] == pytest.approx(one_rank["grad_norm"], rel=1e-4)


def test_non_finite_ratio_skips_the_optimizer_step(one_rank):
    assert one_rank["poisoned_sums"]["nonfinite_ratio"] == 1
    assert one_rank["grads_all_nan"]
    assert one_rank["poisoned_grad_norm"] is None and one_rank["unchanged"]
    # the same batch without the inf steps normally
    assert one_rank["finite_sums"]["nonfinite_ratio"] == 0 == one_rank["finite_sums"]["nonfinite_loss"]
    assert one_rank["finite_grad_norm"] > 0 and one_rank["changed"]


def test_reference_model_exists_when_a_kl_term_needs_it(one_rank):
    assert one_rank["reference"] == {"plain": False, "kl_loss": True, "kl_reward": True}
