"""The GPU memory check (rlfw.config.devices): its estimate against the peaks the GPU runs measured, and the errors it
raises before a run starts instead of an out-of-memory crash mid-run."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rlfw.config import ConfigError, register_configs
from rlfw.config.devices import (GIB, TRAIN_BYTES_PER_PARAM, activation_bytes, check_gpu_memory, num_params,
                                 packed_bytes)
from rlfw.model.shape import ModelShape

CONF = str(Path(__file__).resolve().parents[2] / "conf")
register_configs()
QWEN2 = dict(num_query_groups=2, vocab_size=151936, max_seq_len=160, qkv_bias=True, tie_word_embeddings=True)
QWEN2_0P5B = ModelShape(num_layers=24, hidden_size=896, num_attention_heads=14, ffn_hidden_size=4864, **QWEN2)
QWEN2_1P5B = ModelShape(num_layers=28, hidden_size=1536, num_attention_heads=12, ffn_hidden_size=8960, **QWEN2)
ON_GPU = ("cluster.device=cuda",)


def load(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_shapes_are_qwen2s():
    assert abs(num_params(QWEN2_0P5B) - 494_032_768) < 1e6 and abs(num_params(QWEN2_1P5B) - 1_543_714_304) < 1e6


# A trainer rank's peak allocated GPU memory in a training call, as BENCHMARKS.md's GPU runs measured it (H100 80GB,
# bf16): (shape, overrides, weights shared on the device, measured GiB)
RANK_PEAKS = [
    (QWEN2_0P5B, ["algo.max_tokens_per_microbatch=16384"], True, 28.9),  # RL rows, separate_sync, 2026-12-07
    (QWEN2_0P5B, ["algo.max_tokens_per_microbatch=16384"], False, 27.8),  # beside SGLang, 16384-token micro-batches
    (QWEN2_0P5B, ["algo.max_tokens_per_microbatch=4096"], False, 15.1),  # beside SGLang, 4096
    (QWEN2_1P5B, ["algo.max_tokens_per_microbatch=16384"], True, 66.0),  # RL rows, 1.5B separate_sync
]
# The trainer alone (bench.gpu, 1.5B, 2026-12-05 17:35 UTC): the state at rest, 29.9 GiB, and the step's peak
TRAINER_PEAKS = [
    (["algo.max_tokens_per_microbatch=4096"], 41.1),
    (["algo.max_tokens_per_microbatch=16384"], 66.2),
    (["algo.max_tokens_per_microbatch=16384", "model.recompute=full"], 35.8),
    (["algo.max_tokens_per_microbatch=16384", "model.recompute=selective", "model.recompute_modules=[mlp]"], 43.3),
]


@pytest.mark.parametrize("shape, overrides, on_device, measured", RANK_PEAKS)
def test_a_ranks_estimate_is_within_5_percent_of_its_measured_peak(shape, overrides, on_device, measured):
    cfg = load(*ON_GPU, *overrides)
    estimate = num_params(shape) * TRAIN_BYTES_PER_PARAM + activation_bytes(cfg, shape)
    estimate += packed_bytes(shape) if on_device else 0
    assert abs(estimate / GIB - measured) / measured < 0.05, estimate / GIB


@pytest.mark.parametrize("overrides, measured", TRAINER_PEAKS)
def test_the_activations_of_each_recompute_match_the_trainers_peaks(overrides, measured):
    estimate = 29.9 + activation_bytes(load(*ON_GPU, *overrides), QWEN2_1P5B) / GIB
    assert abs(estimate - measured) / measured < 0.05, estimate


def test_activations_follow_the_micro_batch_recompute_precision_and_tensor_parallelism():
    def act(*overrides):
        return activation_bytes(load(*ON_GPU, "algo.max_tokens_per_microbatch=16384", *overrides), QWEN2_0P5B)

    assert act("model.recompute=full") < act("model.recompute=selective") < act()
    assert act("model.recompute=selective", "model.recompute_modules=[core_attn]") == act()  # flash keeps no scores
    assert act("algo.max_tokens_per_microbatch=4096") < act()
    assert act("model.bf16=false") > act()  # fp32 activations
    assert act("dp.tp=2") < act()


def test_a_placement_that_cannot_fit_the_gpu_names_sizes_and_keys():
    two_cells = (*ON_GPU, "dp.num_cells=2", "cluster.gpus_per_worker=0.5", "cluster.placement=colocated",
                 "algo.max_tokens_per_microbatch=4096")
    with pytest.raises(ConfigError, match=r"a GPU of 40\.0 GiB cannot hold this run's training phase: it needs 80\.5"
                                          r".*21\.4 GiB of it the activations of 2 rank\(s\) at algo\.max_tokens_per"
                                          r"_microbatch=4096, model\.recompute=none.*model\.recompute=selective or "
                                          r"full.*cluster\.gpus_per_worker=1.*rollout\.max_batch"):
        check_gpu_memory(load(*two_cells, "rollout.weight_transport=host"), QWEN2_1P5B, 40 * GIB,
                         samples_per_engine=512)
    # weights handed over on the GPU: the writer's packed bf16 copy too (3.3 GiB)
    with pytest.raises(ConfigError, match=r"training phase: it needs 83\.8"):
        check_gpu_memory(load(*two_cells), QWEN2_1P5B, 40 * GIB, samples_per_engine=512)
    budget = check_gpu_memory(load(*two_cells, "model.recompute=full"), QWEN2_1P5B, 80 * GIB, samples_per_engine=512)
    assert budget.generate < budget.train  # the optimizer state left the GPU while the engine generates
    # 16384-token micro-batches without recompute do not fit two 1.5B ranks on 80 GiB
    with pytest.raises(ConfigError, match=r"training phase: it needs 1[0-9][0-9]\.\d GiB"):
        check_gpu_memory(load(*two_cells, "algo.max_tokens_per_microbatch=16384"), QWEN2_1P5B, 80 * GIB,
                         samples_per_engine=512)


def test_a_colocated_servers_share_must_leave_the_trainers_their_training_phase():
    two_cells = [*ON_GPU, "rollout=sglang", "dp.num_cells=2", "cluster.gpus_per_worker=0.5",
                 "cluster.placement=colocated", "algo.max_tokens_per_microbatch=4096"]

    def check(fraction: float):
        cfg = load(*two_cells, f"rollout.sglang.extra_args=['--mem-fraction-static={fraction}']")
        return check_gpu_memory(cfg, QWEN2_0P5B, 80 * GIB, samples_per_engine=512)

    # the cells' resident state (2 x 2.8 GiB) and their processes (2 x 1.5) leave 71.4 GiB; the server takes half
    budget = check(0.5)
    assert budget.server / GIB == pytest.approx(35.7 + 1.5, abs=0.05)
    assert budget.generate / GIB == pytest.approx(5.52 + 3.0 + 37.2, abs=0.05)
    assert budget.train / GIB == pytest.approx(2 * (8.28 + 6.3 + 1.5) + 37.2, abs=0.1)
    with pytest.raises(ConfigError, match=r"training phase beside its SGLang server, which keeps 65\.8 GiB .*"
                                          r"need 32\.2 GiB.*lower --mem-fraction-static"):
        check(0.9)
    with pytest.raises(ConfigError, match=r"--mem-fraction-static=0\.01 gives the SGLang server 0\.7 GiB of the 71\.5"
                                          r" GiB .* resident 8\.5 GiB: less than its 0\.9 GiB of bf16 weights"):
        check(0.01)
