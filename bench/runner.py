"""Run ``python -m rlfw.train`` as a user would (a fresh process), and read back what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "bench"


def run_training(name: str, overrides: Sequence[str], timeout_s: float = 1800) -> Dict:
    """Returns {"run_dir", "rows" (metrics.jsonl), "events", "wall_s", "first_step_s"} of one run. Its stderr (the
    workers' logs too) goes to ``outputs/bench/<name>.stderr.log``: a pipe nobody reads while the run goes on would
    fill and stall the run."""
    run_dir = OUT / name
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cmd = [sys.executable, "-m", "rlfw.train", f"run_dir={run_dir}", *overrides]
    started = time.time()
    stderr_path = OUT / f"{name}.stderr.log"
    stderr_path.parent.mkdir(parents=True, exist_ok=True)
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    first_step_s = None
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        if first_step_s is None and metrics.exists() and metrics.stat().st_size > 0:
            first_step_s = time.time() - started
        time.sleep(0.05)
        if time.time() - started > timeout_s:
            proc.kill()
            raise TimeoutError(f"{name} ran past {timeout_s} s")
    wall_s = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}): {' '.join(cmd)}\n{stderr_path.read_text()[-3000:]}")
    return {
        "run_dir": run_dir,
        "rows": read_jsonl(metrics),
        "events": read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else [],
        "wall_s": wall_s,
        "first_step_s": first_step_s,
    }


def read_jsonl(path: Path) -> List[Dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.rjust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])
