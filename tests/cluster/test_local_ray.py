"""Without cluster.address a run starts its own Ray, whatever cluster the machine remembers or the shell names.

Ray's address discovery would join the cluster in ``<ray temp dir>/ray_current_cluster`` (written by any
``ray start`` on the machine) or ``RAY_ADDRESS``: a dead one fails the run, a live one is a stranger's. Here both
name a loopback port where nothing listens, in a fresh process with its own Ray temp dir."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, ray
from omegaconf import OmegaConf
from rlfw.cluster.ray_cluster import start_ray, stop_ray
from rlfw.config.schema import ClusterConfig
start_ray(OmegaConf.structured(ClusterConfig(num_cpus=1)))
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                  "nodes": [n["NodeManagerAddress"] for n in ray.nodes()]}))
stop_ray()
"""


def test_a_local_run_never_joins_a_remembered_or_named_cluster():
    tmp_path = Path(tempfile.mkdtemp(prefix="rlfw-ray-", dir="/tmp"))  # Ray's socket paths must stay short
    try:
        run_local(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def run_local(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing of ours listens there
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    (ray_tmp / "ray_current_cluster").write_text(dead)
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path), "RAY_ADDRESS": dead, "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    started = json.loads(result.stdout.strip().splitlines()[-1])
    assert started["gcs"] != dead and started["gcs"].startswith("127.0.0.1:")
    assert started["nodes"] == ["127.0.0.1"]
