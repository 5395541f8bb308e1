"""GPU benchmark of rlfw's Megatron trainer: one call on one GPU measures the bf16 matmul ceiling, checks the packed
attention against an fp32 reference, and times whole GRPO train steps against bare Megatron on the same rows.

Model: Qwen2-1.5B-shaped (no q/k/v biases), random weights; bf16 weights and activations, fp32 main grads, fp32
master weights and Adam state (Megatron's mixed-precision optimizer); world size 1 (NCCL, Megatron parallel_state).

Modules: ``model`` (shapes, FLOPs, the matmul rate), ``data`` (sequence lengths, rollout batches), ``setup`` (the
world and the trainer, old and new paths), ``steps`` (the timed workloads), ``attribution`` (torch.profiler: where
the device time goes), ``checks`` (numerics of the packed attention), ``report`` (results, tables).

Usage (GPU; megatron-core carried as a wheel): ``PYTHONUNBUFFERED=1 python3 -m bench.gpu --out $OUT``.
Dry run on CPU (tiny model, fp32, gloo): ``python -m bench.gpu --cpu-dry-run``.
"""
