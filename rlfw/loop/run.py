"""The RL loop: rollout -> every role's pre-update pass -> advantages -> split -> train -> account -> push -> log.

Everything here runs in the driver; the heavy lifting happens in the rollout manager and the roles' train groups.
A step's weight push lands in the engines while the driver logs, checkpoints and starts the next step: the rollout
that needs those weights waits for them in the manager (``RolloutQueue.push``). ``loop=async`` differs in one
place: the rollout queue asks for the next ``loop.max_staleness`` steps' rollouts before the current step trains,
so they are generated meanwhile (``rlfw.rollout.queue`` says how the bound holds).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlfw.algo import algo_options
from rlfw.checkpoint.partial import PartialStep
from rlfw.ft.errors import BelowMinCellsError, StateLostError
from rlfw.ft.goodput import GoodputMeter
from rlfw.loop.ledger import Ledger, check_exactly_once, trained_sample_ids, verify_replicas_equal
from rlfw.loop.metrics import SignalWatch, log_events, log_skips, role_metrics
from rlfw.loop.prepare import plan_split, prepare_step
from rlfw.loop.recovery import restore_last_state, save_below_min
from rlfw.loop.roles import Role
from rlfw.rollout.queue import RolloutQueue


def max_staleness(cfg) -> int:
    """How many policy versions a sample may lag behind the weights that train on it (0: the synchronous loop)."""
    return cfg.loop.max_staleness if cfg.loop.mode == "async" else 0


class RLLoop:
    """The run's state (the weight version, the step under way, the ledger, the goodput meter) and the step's
    phases. ``roles``: the policy first (its weights serve the engines), then PPO's critic."""

    def __init__(self, cfg, roles: List[Role], manager, loggers, run_dir: Path, checkpointer=None,
                 started: Optional[float] = None, start_step: int = 0, meter: Optional[GoodputMeter] = None):
        self.cfg, self.roles, self.policy, self.loggers = cfg, roles, roles[0], loggers
        self.run_dir, self.checkpointer = run_dir, checkpointer
        self.started = started if started is not None else time.time()
        self.meter = meter if meter is not None else GoodputMeter(self.started)
        self.version = start_step  # the weight version counts committed RL steps
        self.step = self.next_step = start_step
        self.current: Optional[PartialStep] = None  # the step under way: what a save below ft.min_cells keeps
        self.restores = 0
        self.queue = RolloutQueue(manager, max_staleness(cfg), cfg.num_steps, cfg.rollout.step_timeout_s)
        self.ledger = Ledger(run_dir)
        self.signal = SignalWatch()

    def run(self, resumed: Optional[PartialStep] = None) -> Dict[str, float]:
        """Steps ``start_step`` .. ``num_steps - 1``; ``resumed``: the step a save below ft.min_cells interrupted,
        finished first on its saved batch."""
        metrics: Dict[str, float] = {}
        try:
            self.queue.push(self.policy.group.export_weights, self.version, wait=True)
            self.loggers.table("algo", ["option", "value"], algo_options(self.cfg.algo), self.step)
            while self.next_step < self.cfg.num_steps:
                self.step, self.next_step = self.next_step, self.next_step + 1
                t0 = time.perf_counter()
                try:
                    self.current = resumed if resumed is not None and resumed.step == self.step else self.prepare()
                    if self.current is None:
                        continue
                    metrics = self.train(self.current, t0)
                except StateLostError as e:  # nobody holds the trained state: the last checkpoint does
                    resumed = self.restore(e)
                    continue
                self.current = None
                self.version += 1
            self.queue.settle()  # the last push: its error, if any, is the run's
        except BelowMinCellsError as e:
            error = save_below_min(self.roles, self.loggers, self.meter, self.checkpointer, self.step, self.current, e)
            if error is e:
                raise
            raise error from e
        finally:
            self.ledger.close()
        return metrics

    # ------------------------------------------------------------------------------------------ the phases
    def prepare(self) -> Optional[PartialStep]:
        """This step's rollout (and the next ones' in loop=async) with every role's pre-update pass."""
        self.queue.fill(self.step, self.version)
        return prepare_step(self.cfg, self.roles, self.queue.take(self.step), self.loggers, self.step, self.version,
                            max_staleness(self.cfg))

    def train(self, current: PartialStep, t0: float) -> Dict[str, float]:
        """Train the prepared step on every role, account for it, push the new weights, log, checkpoint."""
        minibatches = current.batch.minibatches(self.cfg.algo.global_batch_size)
        metrics, record = dict(current.metrics), {"step": self.step}
        t2 = time.perf_counter()
        results = {}
        for role in self.roles:
            results[role.name] = role.group.train(plan_split(minibatches, self.cfg.split,
                                                             len(role.group.replica_ids())))
            record.update(self.account(role, current, minibatches, results[role.name], metrics))
        t3 = time.perf_counter()
        current.complete = True  # every minibatch is committed: a save from here on is between steps
        self.ledger.write(record)
        metrics.update(self.queue.push(self.policy.group.export_weights, self.version + 1))
        for role in self.roles:
            metrics.update(role_metrics(role, results[role.name], self.cfg.algo.on_nonfinite, self.step))
            log_events(self.loggers, self.meter, self.step, role.group.drain_events(), role)
            log_skips(self.loggers, self.step, results[role.name], role)
        self.log(metrics, current.examples, t0, t3 - t2)
        self.signal.observe(self.loggers, self.step, metrics, self.policy.train_key("grad_norm"))
        if self.checkpointer is not None:
            self.checkpointer.maybe_save(self.step, final=self.step == self.cfg.num_steps - 1)
        return metrics

    def account(self, role: Role, current: PartialStep, minibatches, results, metrics) -> Dict[str, Any]:
        """Every sample trained exactly once by ``role`` (those of minibatches committed before a save count), and
        its replicas bitwise equal every ``ft.verify_weights_every`` steps; returns its ledger fields."""
        trained = current.done_sample_ids(role.name, minibatches) + trained_sample_ids(results)
        check_exactly_once(current.batch, trained)
        fields: Dict[str, Any] = {"sample_ids": sorted(trained)} if role is self.policy else {}
        every = self.cfg.ft.verify_weights_every
        if every and self.step % every == 0:
            t_verify = time.perf_counter()
            fields[f"{role.ledger_prefix}weight_digests"] = verify_replicas_equal(role.group, self.step)
            metrics[role.key("time/verify_weights")] = time.perf_counter() - t_verify
        return fields

    def log(self, metrics: Dict[str, float], examples, t0: float, train_s: float) -> None:
        metrics.update({"time/train": train_s, "time/step": time.perf_counter() - t0,
                        "time/elapsed": time.time() - self.started})
        metrics.update(self.queue.utilisation(metrics.get("time/logprobs", 0.0) + metrics["time/train"],
                                              int(metrics.get("rollout/engines_alive", 1))))
        metrics.update(self.meter.committed(self.step, metrics["time/step"], metrics["train/num_samples"]))
        self.loggers.log(metrics, self.step)
        if self.step % 10 == 0:
            self.loggers.table("generations", ["sample_id", "prompt", "response", "reward"], examples, self.step)

    def restore(self, error: StateLostError) -> Optional[PartialStep]:
        """Every role from the last checkpoint, in this job (at most ``ft.max_state_restores`` times); returns the
        interrupted step that checkpoint holds, if any."""
        if self.checkpointer is None or self.restores >= self.cfg.ft.max_state_restores:
            raise error
        self.restores += 1
        self.queue.drain()  # rollouts asked for from newer weights than those restored
        self.next_step, resumed = restore_last_state(self.roles, self.loggers, self.meter, self.run_dir,
                                                     self.checkpointer, self.step, error)
        self.ledger.reopen()
        self.version = self.next_step
        self.queue.push(self.policy.group.export_weights, self.version, wait=True)  # before any rollout asks
        self.current = None
        return resumed


def run_loop(cfg, roles: List[Role], manager, loggers, run_dir: Path, checkpointer=None,
             started: Optional[float] = None, start_step: int = 0, resumed: Optional[PartialStep] = None,
             meter: Optional[GoodputMeter] = None) -> Dict[str, float]:
    """Steps ``start_step`` .. ``num_steps - 1`` (a resumed run starts past the steps its checkpoint holds);
    ``meter``: the run's goodput meter (a resumed run's holds the earlier jobs' kept steps)."""
    return RLLoop(cfg, roles, manager, loggers, run_dir, checkpointer, started, start_step, meter).run(resumed)
