"""The timed workloads: rlfw's whole train step, and bare Megatron on the same packed rows.

Both time four phases with a device sync after each: zero the grads, forward + backward over the micro-batches,
Megatron DDP's grad reduction (``finish_grad_sync``), and the optimizer step (Megatron's mixed-precision optimizer:
clipping, Adam, the bf16 copy of the master weights).
"""

from __future__ import annotations

import time

import torch

from rlfw.megatron.packing import MicroBatch, build_rows, pack_by_token_budget


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _phases(device, zero, fwd_bwd, reduce, optimize) -> dict:
    """Seconds per phase; on CUDA also the memory held at the step's start (``rest_gib``: weights, grads, optimizer
    state) and each phase's peak (``<phase>_peak_gib``), so that a peak can be told from the state beneath it."""
    marks, memory = [], {}
    names = ("zero", "fwd_bwd", "reduce", "optim")
    cuda = device.type == "cuda"
    for name, phase in zip(names, (zero, fwd_bwd, reduce, optimize)):
        sync(device)
        marks.append(time.perf_counter())
        if cuda:
            memory.setdefault("rest_gib", torch.cuda.memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
        phase()
        if cuda:
            memory[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    sync(device)
    marks.append(time.perf_counter())
    return {"step_s": marks[-1] - marks[0], **{f"{n}_s": b - a for n, a, b in zip(names, marks, marks[1:])},
            **memory}


def rlfw_step(trainer, batch, device) -> dict:
    """``PolicyTrainer``'s step: packing on the host (overlapped with the device), the GRPO loss, the finite check."""
    out = {}
    return {**_phases(device, trainer.zero_grad, lambda: out.update(trainer.forward_backward(batch)),
                      trainer.model.finish_grad_sync, lambda: out.update(grad_norm=trainer.optimizer_step())),
            "loss": out.get("loss"), "grad_norm": out.get("grad_norm")}


def device_rows(batch, budget: int, device) -> list[MicroBatch]:
    """The micro-batches rlfw packs ``batch`` into, with sequence offsets, already on the device."""
    bins = pack_by_token_budget([len(t) for t in batch.samples["tokens"]], budget)
    return [mb.to(device) for mb in build_rows(batch, bins, "token_mean")]


def bare_step(trainer, rows: list[MicroBatch], device) -> dict:
    """Megatron's schedule and its own LM loss on ``rows`` (prebuilt on the device; the same ``PackedRow`` offsets
    reach the attention), Megatron DDP's grad sync and Megatron's optimizer step: no rlfw packing, loss or finite
    check. Megatron's own output layer and cross-entropy: the [tokens, vocab] logits, as a user of Megatron gets
    them (rlfw's chunked head is switched off for this step and back on after it). The kernels under it are the
    model's as it stands; ``setup.as_shipped`` takes rlfw's out for the "as a user gets it" rows."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlfw.megatron.attention import packed_row
    from rlfw.megatron.head import emit_hidden_states

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        params = packed_row(mb.cu_seqlens, mb.max_seqlen, mb.tokens.size(1))
        loss = model(mb.tokens, mb.position_ids, None, labels=mb.labels, packed_seq_params=params)  # [1, T] fp32

        def loss_func(output):
            total = (output * mb.loss_weight).sum()
            return total, torch.tensor(1, dtype=torch.int), {"loss": total.detach()}

        return loss, loss_func

    def fwd_bwd():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(rows), model=[trainer.model],
            num_microbatches=len(rows), seq_length=max(mb.tokens.size(1) for mb in rows), micro_batch_size=1,
            forward_only=False,
        )

    emit_hidden_states(trainer.model.module, emit=False)
    try:
        return _phases(device, trainer.zero_grad, fwd_bwd, trainer.model.finish_grad_sync, trainer.optimizer.step)
    finally:
        emit_hidden_states(trainer.model.module)


def repeat(fn, repeats: int) -> list[dict]:
    """One warm-up call (allocations, the optimizer state), then ``repeats`` timed ones."""
    fn()
    return [fn() for _ in range(repeats)]
