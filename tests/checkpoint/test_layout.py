"""The checkpoint directory rules: what is committed verifies, anything else is never loaded."""

import json
import logging
import shutil

import pytest

from rlfw.checkpoint.layout import (
    COMPLETE,
    CheckpointError,
    commit,
    find_latest,
    list_steps,
    prune,
    read_meta,
    staging_dir,
    step_dir,
    verify,
)
from rlfw.checkpoint.resume import check_compatible, resolve_resume, rewind_step_logs
from rlfw.errors import ConfigError
from rlfw.model.shape import ModelShape

SHAPE = ModelShape(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                   vocab_size=64, max_seq_len=64)


def _save(root, steps_done, payload=b"weights", **meta):
    staging = staging_dir(root, steps_done)
    (staging / "shards").mkdir(parents=True)
    (staging / "shards" / "0.distcp").write_bytes(payload * 100)
    (staging / "common.pt").write_bytes(b"common")
    return commit(staging, step_dir(root, steps_done), {"step": steps_done, **meta})


def test_commit_seals_every_file(tmp_path):
    path = _save(tmp_path, 3, wandb_run_id="abc")
    assert (path / COMPLETE).exists() and not staging_dir(tmp_path, 3).exists()
    meta = verify(path)
    assert meta["step"] == 3 and meta["wandb_run_id"] == "abc"
    assert set(meta["files"]) == {"shards/0.distcp", "common.pt"}
    assert meta["files"]["shards/0.distcp"]["bytes"] == 700


def test_truncated_or_altered_file_fails_verify(tmp_path):
    path = _save(tmp_path, 1)
    shard = path / "shards" / "0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="0.distcp has 699 bytes, 700 committed"):
        verify(path)
    shard.write_bytes(b"X" + (b"weights" * 100)[1:])
    with pytest.raises(CheckpointError, match="SHA-256"):
        verify(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        verify(path)


def test_uncommitted_directory_is_not_a_checkpoint(tmp_path):
    staging = staging_dir(tmp_path, 2)
    staging.mkdir()
    (staging / "common.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        read_meta(staging)
    assert list_steps(tmp_path) == []  # step_2.tmp is not a step directory
    empty = staging_dir(tmp_path, 5)
    empty.mkdir()
    with pytest.raises(CheckpointError, match="nothing was written"):
        commit(empty, step_dir(tmp_path, 5), {"step": 5})


def test_find_latest_skips_corrupt_checkpoints_with_a_warning(tmp_path, caplog):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    newest = _save(tmp_path, 6)
    (newest / "rlfw.json").write_text("{not json")
    shard = step_dir(tmp_path, 4) / "common.pt"
    shard.write_bytes(b"changed")
    with caplog.at_level(logging.WARNING, logger="rlfw.checkpoint"):
        path, meta = find_latest(tmp_path)
    assert path == step_dir(tmp_path, 2) and meta["step"] == 2
    assert "step_6/rlfw.json is unreadable" in caplog.text and "step_4" in caplog.text
    assert find_latest(tmp_path / "nowhere") is None


def test_commit_replaces_a_checkpoint_of_the_same_step(tmp_path):
    _save(tmp_path, 3, payload=b"old")
    path = _save(tmp_path, 3, payload=b"new")
    assert (path / "shards" / "0.distcp").read_bytes().startswith(b"new")
    verify(path)
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]


def test_a_swap_interrupted_by_a_crash_keeps_the_earlier_save(tmp_path):
    """An emergency save of a step already saved swaps the two; a crash between the renames must not lose the
    step (the earlier save is put back), nor leave its leftovers after a swap that got through."""
    _save(tmp_path, 4, payload=b"first")
    staging = staging_dir(tmp_path, 4)
    (staging / "shards").mkdir(parents=True)
    (staging / "shards" / "0.distcp").write_bytes(b"second")
    final = step_dir(tmp_path, 4)
    final.rename(final.with_name(final.name + ".old"))  # the first rename of the swap, then the crash
    path, meta = find_latest(tmp_path)
    assert path == final and meta["step"] == 4
    assert (final / "shards" / "0.distcp").read_bytes() == b"first" * 100
    shutil.rmtree(staging)  # (the crashed save's staging: a new save starts it afresh)
    _save(tmp_path, 4, payload=b"third")  # a swap that got through, its .old left behind by a crash
    (tmp_path / "step_4.old").mkdir()
    assert find_latest(tmp_path)[0] == final and not (tmp_path / "step_4.old").exists()


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    prune(tmp_path, keep_last=2)
    assert [s for s, _ in list_steps(tmp_path)] == [4, 3]
    prune(tmp_path, keep_last=0)
    assert [s for s, _ in list_steps(tmp_path)] == [4, 3]


def test_resolve_resume(tmp_path):
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing yet: a fresh start
    _save(tmp_path, 2, model_shape={})
    point = resolve_resume("auto", tmp_path)
    assert point.step == 2 and point.path == step_dir(tmp_path, 2).resolve()
    assert resolve_resume(str(step_dir(tmp_path, 2)), tmp_path).step == 2
    with pytest.raises(ConfigError, match="no such checkpoint directory"):
        resolve_resume(str(tmp_path / "step_9"), tmp_path)
    (step_dir(tmp_path, 2) / COMPLETE).unlink()
    with pytest.raises(ConfigError, match="no COMPLETE marker"):
        resolve_resume(str(step_dir(tmp_path, 2)), tmp_path)


def test_a_different_model_shape_is_refused_naming_the_fields(tmp_path):
    import dataclasses

    saved = dataclasses.asdict(dataclasses.replace(SHAPE, hidden_size=256, num_layers=4))
    _save(tmp_path, 2, model_shape=saved)
    point = resolve_resume("auto", tmp_path)
    with pytest.raises(ConfigError, match=r"num_layers: checkpoint 4, config 2; hidden_size: checkpoint 256"):
        check_compatible(point, SHAPE, num_steps=10)
    _save(tmp_path, 3, model_shape=dataclasses.asdict(SHAPE), critic=False)
    with pytest.raises(ConfigError, match="past num_steps=2"):
        check_compatible(resolve_resume("auto", tmp_path), SHAPE, num_steps=2)
    with pytest.raises(ConfigError, match="has no critic state"):  # algo=ppo needs the critic it saved
        check_compatible(resolve_resume("auto", tmp_path), SHAPE, num_steps=10, needs_critic=True)
    check_compatible(resolve_resume("auto", tmp_path), SHAPE, num_steps=10)


def test_rewind_moves_the_records_of_redone_steps(tmp_path):
    lines = [json.dumps({"step": s, "loss": s}) for s in range(5)] + ['{"step": 5, "lo']  # torn by the crash
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "events.jsonl").write_text(json.dumps({"step": 0, "kind": "x"}) + "\n")
    moved = rewind_step_logs(tmp_path, 3)
    assert moved == {"metrics.jsonl": 3}
    kept = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [0, 1, 2]
    assert len((tmp_path / "metrics.jsonl.rewound").read_text().splitlines()) == 3
    assert (tmp_path / "events.jsonl").read_text().count("\n") == 1
