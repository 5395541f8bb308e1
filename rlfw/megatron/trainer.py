"""What every Megatron trainer of a role does alike: set-up, micro-batch forward/backward, the optimizer step.

A trainer builds its module on a seeded draw (identical weights on every rank and cell, whatever the layout), wraps
it in Megatron DDP (its contiguous grad buffers are what the replicas reduce) and Megatron's Adam, and runs the
micro-batches of this rank's share through Megatron's schedule. It knows nothing of how replicas exchange
gradients: ``forward_backward`` leaves this rank's (globally normalised) gradients in the grad buffers, and the train
group decides how to reduce them (Megatron DDP in classic mode, torchft across cells) before ``optimizer_step``.
A subclass adds its module and its loss (``PolicyTrainer``: the policy and its head; ``ValueTrainer``: the critic).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from rlfw.data.batch import RolloutBatch
from rlfw.megatron import multi_tensor
from rlfw.megatron.model import takes_sequence_offsets, transformer_config
from rlfw.megatron.packing import MicroBatch, build_rows, pack_by_token_budget
from rlfw.model.shape import ModelShape


class MegatronTrainer:
    """Requires torch.distributed and Megatron's parallel_state to be initialised for this rank's world.

    ``algo``: the loss aggregation, micro-batch budget, Adam betas, weight decay and clipping; ``lr`` and ``seed``
    are the role's. bf16 (CUDA only): bf16 weights and activations; DDP keeps fp32 main grads
    (grad_reduce_in_fp32) and the mixed-precision optimizer fp32 master weights and Adam state. On CPU the flag is
    ignored (fp32 throughout).
    """

    NONFINITE: Tuple[str, ...] = ("nonfinite_loss",)  # loss sums whose being non-zero skips the optimizer step

    def __init__(self, shape: ModelShape, algo, tp: int, device: torch.device, seed: int, lr: float,
                 bf16: bool = False, core_attention: str = "auto", recompute: str = "none",
                 recompute_modules=("mlp",)):
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.shape, self.algo, self.device = shape, algo, device
        self.bf16 = bf16 and device.type == "cuda"
        self.config = transformer_config(shape, tp=tp, bf16=self.bf16, recompute=recompute,
                                         recompute_modules=recompute_modules, device=device)
        torch.manual_seed(seed)
        # On CPU there is no CUDA RNG to track: the inference tracker's fork() is a no-op (no dropout is used).
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=device.type == "cpu")
        module = self.build_module(core_attention)
        # Packed rows reach SDPAttention as sequence offsets; only Megatron's own attention needs T x T masks.
        self.dense_mask = not takes_sequence_offsets(module)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.model = DistributedDataParallel(self.config, ddp_config, module)
        self.optimizer = megatron_adam(self.model, device, self.bf16, lr=lr, weight_decay=algo.weight_decay,
                                       adam_beta1=algo.adam_beta1, adam_beta2=algo.adam_beta2,
                                       clip_grad=algo.grad_clip)

    def build_module(self, core_attention: str) -> torch.nn.Module:
        """The role's module on this device, drawn from the seeded generator."""
        raise NotImplementedError

    def loss(self, output: torch.Tensor, mb: MicroBatch) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """The role's loss on one micro-batch's output (already globally normalised) and its terms."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ training
    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def forward_backward(self, part: RolloutBatch, on_microbatch=None) -> Dict[str, float]:
        """Accumulate this rank's share of the step's gradient; returns weighted sums of the loss terms.
        ``on_microbatch(i)`` runs before micro-batch ``i`` (fault injection uses it)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        sums: Dict[str, float] = {}
        if len(part) == 0:  # an empty share still joins the gradient reduction, with zeros
            return sums
        lengths = [len(t) for t in part.samples["tokens"]]
        bins = pack_by_token_budget(lengths, self.algo.max_tokens_per_microbatch)
        # Rows are built and copied as the schedule asks for them: the host packs row i + 1 while the device
        # computes row i, and the (pinned, non-blocking) copies queue behind the device's work.
        rows = (mb.to(self.device, non_blocking=True)
                for mb in build_rows(part, bins, self.algo.loss_agg, self.dense_mask))
        counter = iter(range(len(bins)))

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if on_microbatch is not None:
                on_microbatch(next(counter))

            def loss_func(output):
                loss, stats = self.loss(output, mb)
                stats["loss"] = loss.detach()
                # calculate_per_token_loss=True: Megatron uses this loss as is (it is globally normalised already).
                return loss, torch.tensor(1, dtype=torch.int), stats

            return row_output(model, mb), loss_func

        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=rows, model=[self.model], num_microbatches=len(bins),
            seq_length=max(sum(lengths[i] for i in b) for b in bins), micro_batch_size=1, forward_only=False,
        )
        for stats in results:
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        if any(sums[key] for key in self.NONFINITE):
            # Make the verdict reach every replica: the SUM reduction spreads a NaN to all of them, and each then
            # skips the optimizer step (``optimizer_step``; rlfw.algo.nonfinite), classic or cells alike.
            for grad in self.grad_buffers():
                grad.fill_(float("nan"))
        return sums

    def grad_buffers(self) -> List[torch.Tensor]:
        """Megatron DDP's contiguous gradient buffers: what a cross-replica reduction must sum."""
        return [buffer.grad_data for buffer in self.model.buffers]

    def optimizer_step(self) -> Optional[float]:
        """Clip and step; returns the grad norm, or None when the step was skipped (non-finite gradients)."""
        if not all_finite(self.grad_buffers()):
            return None
        ok, grad_norm, _ = self.optimizer.step()
        return float(grad_norm) if ok and grad_norm is not None else (0.0 if ok else None)

    def named_weights(self) -> Dict[str, torch.Tensor]:
        """This rank's shard of the weights (Megatron names, without DDP's ``module.`` prefix)."""
        return {k: v for k, v in self.model.module.state_dict().items() if not k.endswith("_extra_state")}


def row_output(model, mb: MicroBatch) -> torch.Tensor:
    """The model's output on one packed row (the policy's last hidden states, the critic's values): its sequence
    offsets go to the core attention as a ``PackedRow``, or, for attention that takes no offsets, its dense
    block-diagonal mask."""
    if mb.attention_mask is not None:
        return model(mb.tokens, mb.position_ids, mb.attention_mask)
    from rlfw.megatron.attention import packed_row

    return model(mb.tokens, mb.position_ids, None,
                 packed_seq_params=packed_row(mb.cu_seqlens, mb.max_seqlen, mb.tokens.size(1)))


def all_finite(tensors: List[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite. It takes each tensor's largest magnitude (the inf-norm): one
    read of the gradients with no temporary, where ``torch.isfinite`` builds a copy (``abs``) and three boolean
    masks (11.6 GiB above a 1.8B-parameter model's fp32 grads when it took them whole; in chunks, 6.7 ms more
    of an H100's optimizer phase than this; BENCHMARKS.md). A NaN or inf makes the largest magnitude non-finite;
    a finite one never overflows it."""
    peaks = [torch.linalg.vector_norm(t, ord=float("inf")).float() for t in tensors if t.numel()]
    return bool(torch.isfinite(torch.stack(peaks)).all()) if peaks else True  # one host sync for all the tensors


def megatron_adam(model, device: torch.device, bf16: bool, **config):
    """Megatron's Adam over ``model`` (Megatron DDP): fp32 master weights and state under bf16, clipping by the
    global grad norm, computed on foreach kernels where Megatron lacks Apex's (``rlfw.megatron.multi_tensor``); on
    CUDA, Adam as torch's fused kernel (``use_fused_adam``). ``config``: OptimizerConfig's fields."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    multi_tensor.install()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                        **config),
        [model],
    )
    if device.type == "cuda":
        use_fused_adam(optimizer)
    return optimizer


def use_fused_adam(optimizer) -> None:
    """Run Megatron's Adam as torch's fused kernel.

    Without Transformer Engine or Apex, megatron-core (0.16 to 0.19) builds ``torch.optim.AdamW`` with neither
    ``fused`` nor ``foreach``, so torch picks its foreach implementation: about ten passes over the fp32 master
    weights, gradients and moments, one per arithmetic step. The fused kernel makes one pass. torch reads both flags
    from the parameter groups at every step, so setting them here is what ``AdamW(fused=True)`` would have done.
    Transformer Engine's or Apex's FusedAdam, where installed, is fused already and left as it is.
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part.optimizer, torch.optim.Adam | torch.optim.AdamW):
            for group in part.optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
