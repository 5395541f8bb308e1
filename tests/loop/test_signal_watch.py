"""The no-learning-signal event: a run whose policy gets no gradient for steps in a row says so once per stretch,
and a run that learns says nothing."""

import json

from rlfw.logging.loggers import JsonlLogger
from rlfw.loop.metrics import SignalWatch

KEY = "train/grad_norm"


def run(tmp_path, norms):
    logger = JsonlLogger(tmp_path)
    watch = SignalWatch(steps=3)
    for step, norm in enumerate(norms):
        metrics = {"rollout/num_groups": 32, "rollout/zero_variance_groups": 32 if norm == 0 else 4}
        if norm is not None:
            metrics[KEY] = norm
        watch.observe(logger, step, metrics, KEY)
    logger.finish()
    events = tmp_path / "events.jsonl"
    return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []


def test_three_steps_without_a_gradient_are_said_once_per_stretch(tmp_path):
    events = run(tmp_path, [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 1.2, 0.0, 0.0, 0.0])
    assert [(e["kind"], e["step"]) for e in events] == [("no_learning_signal", 3), ("no_learning_signal", 9)]
    assert events[0]["zero_variance_share"] == 1.0 and "every advantage 0" in events[0]["reason"]


def test_a_learning_run_and_steps_nothing_trained_say_nothing(tmp_path):
    assert run(tmp_path, [0.5, 0.0, 0.0, 0.3, 0.0, None, 0.0, 2.0]) == []
