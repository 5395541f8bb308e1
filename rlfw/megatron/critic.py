"""The PPO critic: a Megatron value model, its clipped value loss and its optimizer step.

The value model is the policy's ``GPTModel`` built without its last stage (``post_process=False``: no final norm, no
vocabulary output layer), followed by our own RMSNorm and a ``Linear(hidden, 1)`` value head. The decoder's output
is replicated on every tensor-parallel rank (its row-parallel projections end in an all-reduce), so the head is a
plain replicated module: every TP rank computes the same values and, since the backward of that all-reduce is the
identity, the same head gradients; nothing needs a TP collective of its own. Megatron's grad-norm counts
parameters without ``tensor_model_parallel`` once, so clipping is not skewed by the replication.

``ValueTrainer`` is a ``MegatronTrainer`` like the policy's (``rlfw.megatron.trainer``: set-up, micro-batches,
optimizer step), so the classic and cell gradient syncs, heals and weight digests work for it unchanged; it adds
only the value model, its values for the pre-update pass and the value loss.
"""

from __future__ import annotations

import math

import torch

from rlfw.data.batch import RolloutBatch
from rlfw.megatron.model import build_gpt
from rlfw.megatron.packing import MicroBatch, microbatches
from rlfw.megatron.trainer import MegatronTrainer, row_output
from rlfw.model.shape import ModelShape


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, weights: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over tokens of ``weights * 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)``.

    The clipped term keeps one step from moving a value further than ``value_clip`` from the value the returns were
    computed with (PPO's value clipping); ``value_clip = 0`` turns it off (plain squared error). ``weights`` are the
    policy loss's token weights (globally normalised), so the loss is split- and packing-invariant like the policy's.
    Tokens of weight 0 carry no loss, and their inputs are ignored.
    """
    active = weights != 0

    def on_active(t: torch.Tensor) -> torch.Tensor:
        return torch.where(active, t, torch.zeros_like(t))

    values, old_values, returns = on_active(values), on_active(old_values), on_active(returns)
    unclipped = (values - returns).square()
    per_token = unclipped
    clipped_more = torch.zeros_like(unclipped, dtype=torch.bool)
    if value_clip > 0:
        clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        clipped = (clipped_values - returns).square()
        clipped_more = clipped > unclipped
        per_token = torch.maximum(unclipped, clipped)
    per_token = 0.5 * per_token
    loss = on_active(per_token * weights).sum()
    stats = {
        "value_clip_frac": on_active(clipped_more.float() * weights).sum().detach(),
        "nonfinite_loss": (active & ~torch.isfinite(per_token)).sum().detach(),
    }
    return loss, stats


class ValueModel(torch.nn.Module):
    """``GPTModel`` trunk (no final stage) -> RMSNorm -> ``Linear(hidden, 1)``; returns values ``[batch, tokens]``."""

    def __init__(self, shape: ModelShape, config, core_attention: str = "auto"):
        super().__init__()
        self.config = config  # Megatron's schedules read the model's TransformerConfig
        self.trunk = build_gpt(shape, config, core_attention, post_process=False)
        self.model_type = self.trunk.model_type  # read by Megatron's schedules
        self.final_norm = torch.nn.RMSNorm(shape.hidden_size, eps=shape.norm_epsilon, dtype=config.params_dtype)
        self.value_head = torch.nn.Linear(shape.hidden_size, 1, dtype=config.params_dtype)
        # Small outputs at the start, like the policy's output layer: std 1 / sqrt(hidden + 1), zero bias.
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / math.sqrt(shape.hidden_size + 1))
        torch.nn.init.zeros_(self.value_head.bias)

    def set_input_tensor(self, input_tensor) -> None:
        self.trunk.set_input_tensor(input_tensor)

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None) -> torch.Tensor:
        hidden = self.trunk(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)  # [s, b, h]
        return self.value_head(self.final_norm(hidden)).squeeze(-1).transpose(0, 1).float()  # [b, s]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """For Megatron's distributed checkpoints: the trunk's own sharding; the norm and head are replicated."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        out = {}
        for name, child in self.named_children():
            out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
        return out

    def load_policy_state(self, state: dict[str, torch.Tensor]) -> None:
        """Initialise from a policy state dict (Megatron names): the trunk and the final norm; the value head has
        no counterpart in the policy and keeps its own initialisation."""
        norm = "decoder.final_layernorm.weight"
        trunk = {k: v for k, v in state.items() if not k.startswith(("output_layer.", norm))}
        self.trunk.load_state_dict(trunk, strict=True)
        with torch.no_grad():
            self.final_norm.weight.copy_(state[norm])


class ValueTrainer(MegatronTrainer):
    """Requires torch.distributed and Megatron's parallel_state to be initialised for this rank's world.

    ``critic``: the ``algo.critic`` config (lr, value_clip); the Adam betas, weight decay, gradient clipping, loss
    aggregation and micro-batch budget are the policy's (``algo``).
    """

    def __init__(
        self, shape: ModelShape, algo, critic, tp: int, device: torch.device, init_seed: int, bf16: bool = False,
        core_attention: str = "auto", recompute: str = "none", recompute_modules=("mlp",),
    ):
        self.critic = critic
        # With init_from_policy the trunk draws the policy's random initial weights (same seed, same draw order);
        # otherwise a seed of its own. Either way every rank and cell builds identical weights.
        seed = init_seed if critic.init_from_policy else init_seed + 1
        super().__init__(shape, algo, tp, device, seed, critic.lr, bf16, core_attention, recompute,
                         recompute_modules)

    def build_module(self, core_attention: str) -> torch.nn.Module:
        return ValueModel(self.shape, self.config, core_attention).to(self.device)

    def load_hf_policy(self, path: str) -> None:
        """Initialise the trunk and final norm from the HF checkpoint the policy starts from."""
        from megatron.core import parallel_state

        from rlfw.model.hf_checkpoint import SafetensorsCheckpoint
        from rlfw.model.hf_convert import hf_to_megatron

        state = hf_to_megatron(
            SafetensorsCheckpoint(path), self.shape, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(), source=f"HF checkpoint {path!r}",
        )
        self.model.module.load_policy_state(state)
        self.optimizer.reload_model_params()

    # -------------------------------------------------------------------------------------------------- values
    @torch.no_grad()
    def values(self, batch: RolloutBatch) -> dict[str, list[list[float]]]:
        """Per-sample values V(s_t) of every response token: the value at the position that predicts token t."""
        out: list[list[float] | None] = [None] * len(batch)
        self.model.eval()
        for indices, mb in microbatches(batch, self.algo.max_tokens_per_microbatch, dense_mask=self.dense_mask):
            mb = mb.to(self.device)
            values = row_output(self.model, mb)[0]
            for i, sl in zip(indices, mb.response_slices):
                out[i] = values[sl].tolist()
        self.model.train()
        return {"old_values": out}

    # ------------------------------------------------------------------------------------------------ training
    def loss(self, output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped value loss towards ``returns`` (columns ``old_values`` and ``returns``)."""
        return value_loss(output, mb.old_values, mb.returns, mb.loss_weight, self.critic.value_clip)
