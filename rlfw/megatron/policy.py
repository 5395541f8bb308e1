"""The policy's trainer: a Megatron ``GPTModel`` whose output head runs inside the loss, chunk by chunk.

Set-up, the micro-batch schedule and the optimizer step are every trainer's (``rlfw.megatron.trainer``); the policy
adds its model (with the frozen reference where the KL term needs one), its log-probs for the pre-update pass, its
loss (``rlfw.algo.losses.policy_loss``) and the full weights it exports to the engines.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from rlfw.algo.losses import needs_reference, policy_loss
from rlfw.data.batch import RolloutBatch
from rlfw.megatron.head import emit_hidden_states, head_logprobs, head_weight
from rlfw.megatron.model import build_gpt
from rlfw.megatron.packing import MicroBatch, microbatches
from rlfw.megatron.trainer import MegatronTrainer, row_output
from rlfw.model.shape import ModelShape


class PolicyTrainer(MegatronTrainer):
    """Requires torch.distributed and Megatron's parallel_state to be initialised for this rank's world."""

    NONFINITE = ("nonfinite_ratio", "nonfinite_loss")

    def __init__(
        self, shape: ModelShape, algo, tp: int, temperature: float, device: torch.device, init_seed: int,
        bf16: bool = False, core_attention: str = "auto", recompute: str = "none",
        recompute_modules=("mlp",),
    ):
        # The engine samples from softmax(logits / T); recomputed log-probs must use the same distribution.
        self.temperature = temperature if temperature > 0 else 1.0
        self.reference = None
        # Same seed on every rank and cell: identical initial weights everywhere, whatever the parallel layout
        # (CPU initialisation builds the full weight and slices it per TP rank).
        super().__init__(shape, algo, tp, device, init_seed, algo.lr, bf16, core_attention, recompute,
                         recompute_modules)

    def build_module(self, core_attention: str) -> torch.nn.Module:
        module = build_gpt(self.shape, self.config, core_attention).to(self.device)
        emit_hidden_states(module)  # the head runs chunked in the loss (``_head``), never as [tokens, vocab]
        if needs_reference(self.algo):
            # A second model loaded with the policy's weights: deepcopy cannot copy the process groups TP layers hold.
            self.reference = build_gpt(self.shape, self.config, core_attention).to(self.device)
            self.reference.load_state_dict(module.state_dict())
            emit_hidden_states(self.reference)
            self.reference.eval().requires_grad_(False)
        return module

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
    def loss(self, output: torch.Tensor, mb: MicroBatch) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        lp, entropy = self._head(self.model.module, output, mb.labels, entropy=self.algo.entropy_coef > 0)
        return policy_loss(lp, mb.old_logprobs, mb.advantages, mb.loss_weight, self.algo, mb.ref_logprobs,
                           mb.rollout_logprobs, entropy)

    # ------------------------------------------------------------------------------------------------- weights
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
