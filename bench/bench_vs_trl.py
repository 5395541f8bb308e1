"""rlfw's default job against TRL's GRPOTrainer on the same work, one after the other in one invocation.

    .venv/bin/pip install -e '.[bench]'          # TRL (optional: only this benchmark needs it)
    .venv/bin/python bench/bench_vs_trl.py [--steps 60] [--repeats 1] [--rlfw-only] \
        [--rlfw-overrides algo.max_tokens_per_microbatch=2048 ...]   # another rlfw row beside the default

The work: the built-in copy task (its tokenizer, prompts and reward, imported from rlfw), the tiny Llama shape of
``model=tiny``, 32 prompts x 8 samples a step, at most 4 new tokens, GRPO with no KL (TRL ``beta=0``), the token-mean
loss (TRL ``loss_type="dapo"``), one optimizer step per rollout (``num_iterations=1``), Adam at lr 1e-3, betas (0.9,
0.99), no weight decay, grad clip 1.0, a constant learning rate, fp32, on the CPU. Each side runs in a fresh
process, timed from its launch:

* launch to the first step's end (imports, Ray, workers, first rollout and update);
* per-step median (from the second step on);
* trained samples/s (samples per step over that median);
* shutdown (the last step's end to the process' exit).

Differences that remain, and the side each favours:

* rlfw runs its default layout: a driver, a rollout manager, an engine actor and two cells (Megatron worlds, one
  thread each) whose gradients meet through torchft; TRL runs one process with torch's default threads (both
  cores). The layouts are the products' defaults; the thread split favours TRL on the forward/backward.
* rlfw pushes the new weights to its engine every step and checks the replicas' weight digests every 10 steps
  (``ft.verify_weights_every``); TRL generates with the model it trains. Favours TRL.
* rlfw saves its final checkpoint after the last step (``checkpoint.save_final``, the default), inside its
  shutdown figure; TRL saves nothing (``save_strategy="no"``). Favours TRL on shutdown.
* rlfw logs jsonl only here (``logger=jsonl``; its default also writes an offline W&B run), TRL logs nothing
  (``report_to="none"``). Favours TRL slightly.
* The initial weights differ (Megatron's init against transformers'), so the sampled tokens differ; the amount of
  work per step does not (4 new tokens at most, fixed batch). Favours neither.
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

from runner import OUT, ROOT, run_training, table

STEPS = 60


def rlfw_row(steps: int, overrides: list[str]) -> dict:
    launched = time.time()
    run = run_training("vs_trl_rlfw", [f"num_steps={steps}", "logger=jsonl", *overrides])
    rows = run["rows"]
    ends = [r["time/wall"] for r in rows]
    samples = rows[-1].get("train/num_samples", 256)
    step_s = statistics.median(ends[i] - ends[i - 1] for i in range(2, len(ends)))
    side = "rlfw (cells, default)" if not overrides else f"rlfw {' '.join(overrides)}"
    return {"side": side, "launch_to_first_step_s": ends[0] - launched, "step_median_s": step_s,
            "samples_per_s": samples / step_s, "shutdown_s": launched + run["wall_s"] - ends[-1],
            "wall_s": run["wall_s"], "final_reward": sum(r["reward/mean"] for r in rows[-5:]) / 5}


def trl_row(steps: int) -> dict:
    launched = time.time()
    out = OUT / "vs_trl_trl.json"
    out.unlink(missing_ok=True)
    with open(OUT / "vs_trl_trl.stderr.log", "w") as stderr:
        subprocess.run([sys.executable, __file__, "--trl-child", str(steps), str(out)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=stderr, timeout=1800)
    exited = time.time()
    result = json.loads(out.read_text())
    ends, rewards = result["step_ends"], result["rewards"]
    step_s = statistics.median(ends[i] - ends[i - 1] for i in range(2, len(ends)))
    return {"side": f"TRL {result['version']} GRPOTrainer", "launch_to_first_step_s": ends[0] - launched,
            "step_median_s": step_s, "samples_per_s": 256 / step_s, "shutdown_s": exited - ends[-1],
            "wall_s": exited - launched, "final_reward": sum(rewards[-5:]) / max(len(rewards[-5:]), 1)}


def trl_child(steps: int, out: Path) -> None:
    """TRL's side, in a process of its own: the same task, shape and settings as rlfw's default config."""
    import numpy as np
    import torch
    import trl
    from datasets import Dataset
    from hydra import compose, initialize_config_dir
    from transformers import LlamaForCausalLM, TrainerCallback

    from rlfw.config import register_configs
    from rlfw.model.hf_convert import hf_config
    from rlfw.rollout.manager import padded_vocab_size
    from rlfw.rollout.tasks.copy import CopyTask
    from rlfw.rollout.types import Prompt
    from rlfw.train_group.worker import model_shape

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config")
    task = CopyTask(**{k: v for k, v in cfg.task.items() if k != "_target_"})
    tokenizer = task.tokenizer
    shape = model_shape(cfg, padded_vocab_size(len(tokenizer), 1))
    rollout, algo = cfg.rollout, cfg.algo
    prompts = [p for step in range(steps)
               for p in task.sample_prompts(rollout.num_prompts, step, np.random.default_rng([cfg.seed, step]))]
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(p.token_ids) for p in prompts],
                                 "target": [p.target for p in prompts]})

    def copy_reward(prompts, completions, completion_ids, target, **_):
        return [task.reward(Prompt(prompt_id=0, token_ids=[], target=t), ids) for t, ids in zip(target, completion_ids)]

    config = hf_config(shape)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = (tokenizer.eos_token_id, tokenizer.pad_token_id,
                                                                     tokenizer.bos_token_id)
    torch.manual_seed(cfg.model.init_seed)
    model = LlamaForCausalLM(config).float()
    samples = rollout.num_prompts * rollout.n_samples_per_prompt
    args = trl.GRPOConfig(
        output_dir=str(OUT / "vs_trl_trl"), use_cpu=True, bf16=False, fp16=False, report_to="none",
        max_steps=steps, per_device_train_batch_size=samples, gradient_accumulation_steps=1,
        num_generations=rollout.n_samples_per_prompt, max_completion_length=task.max_response_len,
        temperature=rollout.temperature, top_p=rollout.top_p, beta=0.0, loss_type="dapo", num_iterations=1,
        epsilon=algo.clip_eps_low, epsilon_high=algo.clip_eps_high, learning_rate=algo.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=algo.weight_decay, adam_beta1=algo.adam_beta1,
        adam_beta2=algo.adam_beta2, max_grad_norm=algo.grad_clip, shuffle_dataset=False, logging_steps=1,
        save_strategy="no", gradient_checkpointing=False, disable_dropout=True, seed=cfg.seed,
        dataloader_num_workers=0,
    )
    step_ends, rewards = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.time())

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer = trl.GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[copy_reward], args=args,
                              train_dataset=dataset, callbacks=[Clock()])
    trainer.train()
    out.write_text(json.dumps({"version": trl.__version__, "step_ends": step_ends, "rewards": rewards}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rlfw-only", action="store_true")
    parser.add_argument("--trl-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--rlfw-overrides", nargs="+", action="append", default=[], metavar="OVERRIDE",
                        help="another rlfw row with these Hydra overrides (repeatable), beside the default one")
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(int(args.trl_child[0]), Path(args.trl_child[1]))
    rows = []
    for _ in range(args.repeats):
        rows.append(rlfw_row(args.steps, []))
        rows += [rlfw_row(args.steps, overrides) for overrides in args.rlfw_overrides]
        if not args.rlfw_only:
            rows.append(trl_row(args.steps))
    headers = list(rows[0])
    print(table(headers, [[r[h] for h in headers] for r in rows]))
    (OUT / "vs_trl.json").write_text(json.dumps(rows, indent=1))
    print(f"load average while it ran (others' work on this machine counts): {os.getloadavg()}")


if __name__ == "__main__":
    main()
