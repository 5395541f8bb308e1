"""rlfw against TRL's GRPOTrainer on the same work, one after the other in one invocation: on the CPU, rlfw's
default job; with ``--gpu SHAPE``, the GPU RL table's job (``bench_gpu_rl.py``) on the lent GPU.

    .venv/bin/pip install -e '.[bench]'          # TRL (optional: only this benchmark needs it)
    .venv/bin/python bench/bench_vs_trl.py [--steps 60] [--repeats 1] [--rlfw-only] \
        [--rlfw-overrides algo.max_tokens_per_microbatch=2048 ...]   # another rlfw row beside the default one
    python3 bench/bench_vs_trl.py --gpu 0.5b --steps 30 --rlfw-rows separate_sync,separate_async algo.lr=1e-5
    python3 bench/bench_vs_trl.py --gpu 0.5b --steps 30 --trl-only --trl-timeout-s 300 algo.lr=1e-5   # TRL alone

The CPU work: the built-in copy task (its tokenizer, prompts and reward, imported from rlfw), the tiny Llama shape of
``model=tiny``, 32 prompts x 8 samples a step, at most 4 new tokens, GRPO with no KL (TRL ``beta=0``), the token-mean
loss (TRL ``loss_type="dapo"``), one optimizer step per rollout (``num_iterations=1``), Adam at lr 1e-3, betas (0.9,
0.99), no weight decay, grad clip 1.0, a constant learning rate, fp32, on the CPU. The GPU work: the same settings
over ``bench_gpu_rl.py``'s overrides (a Qwen2 shape with random weights and the 151,936-row output layer, the copy
task of lengths 2-64, 64 prompts x 8 samples, responses up to 65 tokens), bf16 (rlfw: Megatron's bf16 with fp32
master weights; TRL: ``bf16=True``, autocast over fp32 weights), TRL's 512 samples in micro-batches of
``--trl-micro-batch`` with one optimizer step. Both sides read the same composed Hydra config (the positional
overrides go to both). Each side runs in a fresh process, timed from its launch:

* launch to the first step's end (imports, Ray, workers, first rollout and update);
* per-step median (from the second step on);
* trained samples/s (samples per step over that median);
* shutdown (the last step's end to the process' exit);
* the mean reward of the first and of the last 5 steps (the same prompts on both sides, sampled from the task with
  rlfw's per-step seeds).

Differences that remain, and the side each favours:

* rlfw runs its layout: on the CPU a driver, a rollout manager, an engine actor and two cells (Megatron worlds, one
  thread each) whose gradients meet through torchft; TRL runs one process with torch's default threads (both
  cores). The layouts are the products' defaults; the thread split favours TRL on the forward/backward. On the GPU
  rlfw's rows name their placement (``bench_gpu_rl.ROWS``); TRL generates with ``transformers``' ``generate`` on
  the model it trains (no vLLM: the GPU machine has none).
* rlfw pushes the new weights to its engine every step and checks the replicas' weight digests every 10 steps
  (5 on the GPU; ``ft.verify_weights_every``); TRL generates with the model it trains. Favours TRL.
* rlfw saves its final checkpoint after the last step on the CPU (``checkpoint.save_final``, the default), inside its
  shutdown figure; TRL saves nothing (``save_strategy="no"``). Favours TRL on shutdown.
* rlfw logs jsonl only here (``logger=jsonl``; its default also writes an offline W&B run), TRL logs nothing
  (``report_to="none"``). Favours TRL slightly.
* The initial weights differ (Megatron's init against transformers'), so the sampled tokens differ; on the CPU the
  work per step does not (4 new tokens at most, fixed batch); on the GPU the responses' lengths follow each policy
  (the tables give both sides' mean response length).
* TRL scales advantages by the group std like rlfw's ``normalize_adv_std`` and clips the ratio at 0.2 like rlfw.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_gpu_rl import COMMON as GPU_COMMON
from bench_gpu_rl import ROWS, SHAPES
from runner import OUT, ROOT, run_training, table

STEPS = 60


def summary(side: str, launched: float, exited: float, ends: list, rewards: list, samples: int,
            response_lens: list) -> dict:
    step_s = statistics.median(ends[i] - ends[i - 1] for i in range(2, len(ends)))
    return {"side": side, "launch_to_first_step_s": ends[0] - launched, "step_median_s": step_s,
            "samples_per_s": samples / step_s, "shutdown_s": exited - ends[-1], "wall_s": exited - launched,
            "first_reward": statistics.mean(rewards[:5]), "final_reward": statistics.mean(rewards[-5:]),
            "response_len": statistics.mean(response_lens) if response_lens else float("nan")}


def rlfw_row(steps: int, overrides: list[str], side: str, name: str) -> dict:
    launched = time.time()
    run = run_training(name, [f"num_steps={steps}", "logger=jsonl", *overrides])
    rows = run["rows"]
    return summary(side, launched, launched + run["wall_s"], [r["time/wall"] for r in rows],
                   [r["reward/mean"] for r in rows], rows[-1]["train/num_samples"],
                   [r["rollout/response_len"] for r in rows])


def trl_row(steps: int, overrides: list[str], device: str, micro_batch: int, timeout_s: float) -> dict:
    """TRL's side in a child process; past ``timeout_s`` the child is killed and the row holds the steps it
    finished (the child rewrites its result after every step), its side naming how many."""
    launched = time.time()
    out = OUT / "vs_trl_trl.json"
    out.unlink(missing_ok=True)
    side = "TRL {version} GRPOTrainer"
    with open(OUT / "vs_trl_trl.stderr.log", "w") as stderr:
        try:
            subprocess.run([sys.executable, __file__, "--trl-child", str(steps), str(out), "--device", device,
                            "--trl-micro-batch", str(micro_batch), *overrides], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL, stderr=stderr, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            side += f" (stopped after {timeout_s:.0f} s: {{done}} of {steps} steps)"
    exited = time.time()
    if not out.exists():
        raise RuntimeError(f"TRL finished no step in {exited - launched:.0f} s; see {OUT / 'vs_trl_trl.stderr.log'}")
    result = json.loads(out.read_text())
    return summary(side.format(version=result["version"], done=len(result["step_ends"])), launched, exited,
                   result["step_ends"], result["rewards"], result["samples"], result["response_lens"])


def trl_child(steps: int, out: Path, overrides: list[str], device: str, micro_batch: int) -> None:
    """TRL's side, in a process of its own: the task, shape and settings of rlfw's config composed with
    ``overrides``; ``micro_batch`` samples per forward/backward (0: a step's samples at once)."""
    import numpy as np
    import torch
    import trl
    from datasets import Dataset
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rlfw.config import register_configs
    from rlfw.model.hf_convert import hf_config
    from rlfw.rollout.manager import padded_vocab_size
    from rlfw.rollout.types import Prompt
    from rlfw.train_group.worker import model_shape

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    task = instantiate(cfg.task)
    # TRL takes a transformers tokenizer: the task's own, saved and read back as one (the same ids, tested in
    # tests/rollout/test_tokenizer.py)
    task.tokenizer.save_pretrained(out.parent / "vs_trl_tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(out.parent / "vs_trl_tokenizer")
    shape = model_shape(cfg, cfg.model.vocab_size or padded_vocab_size(len(tokenizer), 1))
    rollout, algo = cfg.rollout, cfg.algo
    prompts = [p for step in range(steps)
               for p in task.sample_prompts(rollout.num_prompts, step, np.random.default_rng([cfg.seed, step]))]
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(p.token_ids) for p in prompts],
                                 "target": [p.target for p in prompts]})
    response_lens = []

    def copy_reward(prompts, completions, completion_ids, target, **_):
        response_lens.append(statistics.mean(len(ids) for ids in completion_ids))
        return [task.reward(Prompt(prompt_id=0, token_ids=[], target=t), ids) for t, ids in zip(target, completion_ids)]

    config = hf_config(shape)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = (tokenizer.eos_token_id, tokenizer.pad_token_id,
                                                                     tokenizer.bos_token_id)
    torch.manual_seed(cfg.model.init_seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    samples = rollout.num_prompts * rollout.n_samples_per_prompt
    micro_batch = micro_batch or samples
    if samples % micro_batch:
        raise ValueError(f"--trl-micro-batch {micro_batch} does not divide a step's {samples} samples")
    on_gpu = device == "cuda"
    args = trl.GRPOConfig(
        output_dir=str(OUT / "vs_trl_trl"), use_cpu=not on_gpu, bf16=on_gpu, fp16=False, report_to="none",
        max_steps=steps, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=samples // micro_batch,
        num_generations=rollout.n_samples_per_prompt, max_completion_length=task.max_response_len,
        temperature=rollout.temperature, top_p=rollout.top_p, beta=0.0, loss_type="dapo", num_iterations=1,
        epsilon=algo.clip_eps_low, epsilon_high=algo.clip_eps_high, learning_rate=algo.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=algo.weight_decay, adam_beta1=algo.adam_beta1,
        adam_beta2=algo.adam_beta2, max_grad_norm=algo.grad_clip, shuffle_dataset=False, logging_steps=1,
        save_strategy="no", gradient_checkpointing=False, disable_dropout=True, seed=cfg.seed,
        dataloader_num_workers=0,
    )
    step_ends, rewards = [], []

    def write() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": trl.__version__, "step_ends": step_ends, "rewards": rewards,
                                   "samples": samples, "response_lens": response_lens}))
        tmp.replace(out)

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.time())
            if len(step_ends) > 2:  # a row needs two step-to-step intervals
                write()

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[copy_reward], args=args,
                              train_dataset=dataset, callbacks=[Clock()])
    trainer.train()
    write()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rlfw-only", action="store_true")
    parser.add_argument("--trl-only", action="store_true")
    parser.add_argument("--trl-timeout-s", type=float, default=1800.0,
                        help="TRL's side is stopped past this, its row holding the steps it finished")
    parser.add_argument("--gpu", choices=sorted(SHAPES), help="the GPU RL table's job at this Qwen2 shape")
    parser.add_argument("--rlfw-rows", default="separate_sync,separate_async",
                        help="with --gpu: bench_gpu_rl.py's rows to run for rlfw")
    parser.add_argument("--trl-micro-batch", type=int, default=0, help="TRL's per-device batch (default: a step's "
                        "samples on the CPU, 64 on the GPU)")
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--trl-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--rlfw-overrides", nargs="+", action="append", default=[], metavar="OVERRIDE",
                        help="another rlfw row with these Hydra overrides (repeatable), beside the default one")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides")
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(int(args.trl_child[0]), Path(args.trl_child[1]), args.overrides, args.device,
                         args.trl_micro_batch)
    if args.gpu:
        common, device, micro_batch = [*GPU_COMMON, *SHAPES[args.gpu], *args.overrides], "cuda", 64
        rlfw_rows = [(f"rlfw {name}", [*common, *ROWS[name]]) for name in args.rlfw_rows.split(",")]
    else:
        common, device, micro_batch = list(args.overrides), "cpu", 0
        rlfw_rows = [("rlfw (cells, default)", common)]
    rlfw_rows += [(f"rlfw {' '.join(extra)}", [*common, *extra]) for extra in args.rlfw_overrides]
    if args.trl_only:
        rlfw_rows = []
    rows = []
    for _ in range(args.repeats):
        rows += [rlfw_row(args.steps, overrides, side, f"vs_trl_rlfw_{i}")
                 for i, (side, overrides) in enumerate(rlfw_rows)]
        if not args.rlfw_only:
            rows.append(trl_row(args.steps, common, device, args.trl_micro_batch or micro_batch, args.trl_timeout_s))
    headers = list(rows[0])
    print(table(headers, [[r[h] for h in headers] for r in rows]))
    (OUT / "vs_trl.json").write_text(json.dumps(rows, indent=1))
    print(f"load average while it ran (others' work on this machine counts): {os.getloadavg()}")


if __name__ == "__main__":
    main()
