"""The one-rank world and the trainer under test, with switches back to the old path for before/after rows."""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist

from rlfw.config.schema import AlgoConfig


def init_world(device: torch.device) -> None:
    from megatron.core import parallel_state

    from rlfw.cluster.store import serve_store

    if device.type == "cpu":
        from rlfw.megatron.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    else:
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=serve_store("127.0.0.1"), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def build_trainer(shape, device: torch.device, bf16: bool, budget: int, attention: str = "sdpa",
                  recompute: str = "none"):
    """``recompute``: ``model.recompute`` (``selective`` recomputes the MLP, as its default modules say)."""
    from rlfw.megatron.policy import PolicyTrainer

    algo = AlgoConfig(name="grpo", lr=1e-6, adam_beta2=0.999, clip_eps_high=0.28, max_tokens_per_microbatch=budget)
    return PolicyTrainer(shape, algo, tp=1, temperature=1.0, device=device, init_seed=0, bf16=bf16,
                         core_attention=attention, recompute=recompute)


def adam_groups(trainer) -> list[dict]:
    parts = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return [g for part in parts for g in part.optimizer.param_groups]


def use_path(trainer, new: bool) -> None:
    """``new``: packed rows as sequence offsets and torch's fused Adam (what the trainer does on CUDA). Old: dense
    T x T masks built on the host (SDPAttention recognises them and runs the same kernels) and the foreach Adam
    that megatron-core picks without Transformer Engine or Apex."""
    trainer.dense_mask = not new
    for group in adam_groups(trainer):
        group["fused"], group["foreach"] = (True, False) if new else (False, True)
    # Adam's state starts afresh, so that its step counters live where each implementation keeps them (the fused
    # kernel on the device, foreach on the host): the timed work is the same, the moments restart from zero.
    for part in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        part.optimizer.state.clear()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def megatron_fallbacks():
    """Megatron's own per-tensor loops for the grad norm and the clipping (without Apex or TE), where
    ``rlfw.megatron.multi_tensor`` put foreach kernels; set back after."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from rlfw.megatron import multi_tensor

    swapped = {name: ours for name, ours in (("l2_norm_impl", multi_tensor.l2_norm),
                                             ("multi_tensor_scale_impl", multi_tensor.scale))
               if getattr(clip_grads, name) is ours}
    local = {"l2_norm_impl": utils.local_multi_tensor_l2_norm,
             "multi_tensor_scale_impl": utils.local_multi_tensor_scale}
    for name in swapped:
        setattr(clip_grads, name, local[name])
    try:
        yield
    finally:
        for name, ours in swapped.items():
            setattr(clip_grads, name, ours)


@contextlib.contextmanager
def layer_kernels_off(trainer):
    """The layers without rlfw's kernels reached through Megatron's hooks: Megatron's unfused RoPE and DDP's
    separate addition of each weight gradient; set back after. Megatron reads the config at every forward; the
    linear layers keep their own accumulation switch."""
    config = trainer.config
    linear = [m for m in trainer.model.modules() if getattr(m, "gradient_accumulation_fusion", False)]
    saved_rope, config.apply_rope_fusion = config.apply_rope_fusion, False
    for m in linear:
        m.gradient_accumulation_fusion = False
    try:
        yield
    finally:
        config.apply_rope_fusion = saved_rope
        for m in linear:
            m.gradient_accumulation_fusion = True


@contextlib.contextmanager
def fusions_off(trainer):
    """``trainer`` on plain PyTorch math: ``layer_kernels_off``, Megatron's unfused SwiGLU, and the chunked head's
    element-wise work eager (``rlfw.megatron.head``'s CPU path); all set back after."""
    from rlfw.megatron import head

    config = trainer.config
    saved = config.bias_activation_fusion, head._chunk_stats, head._chunk_grad
    config.bias_activation_fusion = False
    head._chunk_stats, head._chunk_grad = head._chunk_stats.__wrapped__, head._chunk_grad.__wrapped__
    try:
        with layer_kernels_off(trainer):
            yield
    finally:
        config.bias_activation_fusion, head._chunk_stats, head._chunk_grad = saved


@contextlib.contextmanager
def isfinite_check():
    """The finite check as it was before it took each buffer's largest magnitude: ``torch.isfinite`` on chunks of
    64M elements (a copy and three boolean masks per chunk)."""
    from rlfw.megatron import trainer

    def chunked(tensors, chunk=1 << 26):
        checks = [torch.isfinite(part).all() for t in tensors for part in t.reshape(-1).split(chunk)]
        return bool(torch.stack(checks).all()) if checks else True

    saved, trainer.all_finite = trainer.all_finite, chunked
    try:
        yield
    finally:
        trainer.all_finite = saved


@contextlib.contextmanager
def as_shipped(trainer):
    """``trainer``'s model as megatron-core runs it for a user without Transformer Engine or Apex, for the bare
    Megatron rows: ``layer_kernels_off``, Megatron's per-tensor grad-norm loops and the foreach Adam it builds.
    Megatron's own fused SwiGLU (a config switch of its own) stays on. All set back after."""
    dense_mask = trainer.dense_mask  # use_path sets it too; the bare step does not read it
    use_path(trainer, new=False)
    try:
        with layer_kernels_off(trainer), megatron_fallbacks():
            yield
    finally:
        use_path(trainer, new=True)
        trainer.dense_mask = dense_mask
