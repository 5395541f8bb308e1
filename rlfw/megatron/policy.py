"""The Megatron side of one replica rank: model, DDP grad buffers, optimizer, log-probs and the policy step.

It knows nothing of how replicas exchange gradients: ``forward_backward`` leaves this rank's (globally normalised)
gradients in Megatron's contiguous grad buffers, and the train group decides how to reduce them (Megatron DDP in
classic mode, torchft across cells) before ``optimizer_step``.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from rlfw.algo.losses import needs_reference, policy_loss
from rlfw.data.batch import RolloutBatch
from rlfw.megatron import multi_tensor
from rlfw.megatron.head import emit_hidden_states, head_logprobs, head_weight
from rlfw.megatron.model import build_gpt, takes_sequence_offsets, transformer_config
from rlfw.model.shape import ModelShape
from rlfw.megatron.packing import MicroBatch, build_rows, microbatches, pack_by_token_budget


class PolicyTrainer:
    """Requires torch.distributed and Megatron's parallel_state to be initialised for this rank's world."""

    def __init__(
        self, shape: ModelShape, algo, tp: int, temperature: float, device: torch.device, init_seed: int,
        bf16: bool = False, core_attention: str = "auto", recompute: str = "none",
        recompute_modules=("mlp",),
    ):
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.shape, self.algo, self.device = shape, algo, device
        # The engine samples from softmax(logits / T); recomputed log-probs must use the same distribution.
        self.temperature = temperature if temperature > 0 else 1.0
        # bf16 (CUDA only): bf16 weights and activations; DDP keeps fp32 main grads (grad_reduce_in_fp32) and the
        # mixed-precision optimizer fp32 master weights and Adam state. On CPU the flag is ignored (fp32 throughout).
        self.bf16 = bf16 and device.type == "cuda"
        self.config = transformer_config(shape, tp=tp, bf16=self.bf16, recompute=recompute,
                                         recompute_modules=recompute_modules, device=device)
        # Same seed on every rank and cell: identical initial weights everywhere, whatever the parallel layout
        # (CPU initialisation builds the full weight and slices it per TP rank).
        torch.manual_seed(init_seed)
        # On CPU there is no CUDA RNG to track: the inference tracker's fork() is a no-op (no dropout is used).
        tensor_parallel.model_parallel_cuda_manual_seed(init_seed, inference_rng_tracker=device.type == "cpu")
        module = build_gpt(shape, self.config, core_attention).to(device)
        emit_hidden_states(module)  # the head runs chunked in the loss (``_head``), never as [tokens, vocab]
        # Packed rows reach SDPAttention as sequence offsets; only Megatron's own attention needs T x T masks.
        self.dense_mask = not takes_sequence_offsets(module)
        self.reference = None
        if needs_reference(algo):
            # A second model loaded with the policy's weights: deepcopy cannot copy the process groups TP layers hold.
            self.reference = build_gpt(shape, self.config, core_attention).to(device)
            self.reference.load_state_dict(module.state_dict())
            emit_hidden_states(self.reference)
            self.reference.eval().requires_grad_(False)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.model = DistributedDataParallel(self.config, ddp_config, module)
        self.optimizer = megatron_adam(self.model, device, self.bf16, lr=algo.lr, weight_decay=algo.weight_decay,
                                       adam_beta1=algo.adam_beta1, adam_beta2=algo.adam_beta2,
                                       clip_grad=algo.grad_clip)

    # ----------------------------------------------------------------------------------------------- log-probs
    def _head(self, gpt, hidden: torch.Tensor, labels: torch.Tensor, entropy: bool = False):
        """Log-probs (and entropy) of softmax(logits / T) from ``gpt``'s last hidden state, chunk by chunk
        (``rlfw.megatron.head``): the [tokens, vocab] logits are never held."""
        from megatron.core import parallel_state

        return head_logprobs(hidden, head_weight(gpt), labels, self.temperature, self.algo.head_chunk_tokens,
                             parallel_state.get_tensor_model_parallel_group(), entropy)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch) -> Dict[str, List[List[float]]]:
        """Per-sample response log-probs under the current policy (and the reference model, if any)."""
        out = {"old_logprobs": [None] * len(batch)}
        models = [("old_logprobs", self.model.module)]
        if self.reference is not None:
            out["ref_logprobs"] = [None] * len(batch)
            models.append(("ref_logprobs", self.reference))
        self.model.eval()
        for indices, mb in microbatches(batch, self.algo.max_tokens_per_microbatch, dense_mask=self.dense_mask):
            mb = mb.to(self.device)
            for key, model in models:
                lp = self._head(model, row_output(model, mb), mb.labels)[0][0]
                for i, sl in zip(indices, mb.response_slices):
                    out[key][i] = lp[sl].tolist()
        self.model.train()
        return out

    # ------------------------------------------------------------------------------------------------ training
    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def forward_backward(self, part: RolloutBatch, on_microbatch=None) -> Dict[str, float]:
        """Accumulate this rank's share of the step's gradient; returns weighted sums of the loss terms."""
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
        algo = self.algo

        counter = iter(range(len(bins)))

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if on_microbatch is not None:  # a hook between micro-batches (fault injection uses it)
                on_microbatch(next(counter))
            hidden = row_output(model, mb)

            def loss_func(output):
                lp, entropy = self._head(self.model.module, output, mb.labels, entropy=algo.entropy_coef > 0)
                loss, stats = policy_loss(
                    lp, mb.old_logprobs, mb.advantages, mb.loss_weight, algo, mb.ref_logprobs, mb.rollout_logprobs,
                    entropy,
                )
                stats["loss"] = loss.detach()
                # calculate_per_token_loss=True: Megatron uses this loss as is (it is globally normalised already).
                return loss, torch.tensor(1, dtype=torch.int), stats

            return hidden, loss_func

        results = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=rows,
            model=[self.model],
            num_microbatches=len(bins),
            seq_length=max(sum(lengths[i] for i in b) for b in bins),
            micro_batch_size=1,
            forward_only=False,
        )
        for stats in results:
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value)
        if sums["nonfinite_ratio"] or sums["nonfinite_loss"]:
            # Make the verdict reach every replica: the SUM reduction spreads a NaN to all of them, and each then
            # skips the optimizer step (``optimizer_step``), classic or cells alike.
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

    # ------------------------------------------------------------------------------------------------- weights
    def named_weights(self) -> Dict[str, torch.Tensor]:
        """This rank's shard of the weights (Megatron names, without DDP's ``module.`` prefix)."""
        return {k: v for k, v in self.model.module.state_dict().items() if not k.endswith("_extra_state")}

    def full_weights(self) -> Dict[str, torch.Tensor]:
        """The unsharded weights on every tensor-parallel rank (a collective: all TP ranks must call it).

        Column- and row-parallel shards concatenate along their partition dim, except SwiGLU's fused fc1: each
        rank holds [gate shard; up shard], and the full weight is [all gate rows; all up rows].
        """
        import torch.distributed as dist
        from megatron.core import parallel_state

        weights = self.named_weights()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp == 1:
            return weights
        group = parallel_state.get_tensor_model_parallel_group()
        params = dict(self.model.module.named_parameters())
        full = {}
        for name, shard in weights.items():
            param = params.get(name)
            if param is None or not getattr(param, "tensor_model_parallel", False):
                full[name] = shard  # replicated on every TP rank (norms)
                continue
            shards = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(shards, shard.contiguous(), group=group)
            if name.endswith("mlp.linear_fc1.weight"):
                gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
                full[name] = torch.cat([*gates, *ups], dim=0)
            else:
                full[name] = torch.cat(shards, dim=param.partition_dim)
        return full


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
