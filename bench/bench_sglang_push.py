"""Weight pushes to a real SGLang server, through the disk against as tensors (``rollout.sglang.weight_sync``): the
seconds of one push as the engine makes it (``SGLangEngine.update_weights``, attached to a server started here), per
shape, with the GPU's memory in use at its highest during the pushes (nvidia-smi, on CUDA). Prints one table; the
rows and the server's log go to ``--out``.

    python bench/bench_sglang_push.py --python .sglang/bin/python --device cpu --shapes tiny,0.5b   # make test's env
    # on a GPU, the server from bench/carry/build_sglang.sh (unpacked into /tmp/sglang-site):
    python3 bench/bench_sglang_push.py --python /opt/torch/.venv/bin/python3 --pythonpath /tmp/sglang-site \\
        --device cuda --shapes 0.5b,1.5b --out $OUT
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_engine import SHAPES  # noqa: E402
from bench_gpu_rl import MemoryTrace  # noqa: E402
from runner import table  # noqa: E402

from rlfw.config.schema import SGLangConfig  # noqa: E402
from rlfw.model.hf_convert import hf_config  # noqa: E402
from rlfw.rollout.engines.sglang import SGLangEngine, save_server_checkpoint  # noqa: E402
from rlfw.rollout.engines.sglang_client import SGLangClient  # noqa: E402
from rlfw.rollout.engines.sglang_server import ServerProcess, launch_argv  # noqa: E402

EOS = 2
FLAGS = {
    "cpu": ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup",
            "--dtype", "float32", "--max-total-tokens", "4096", "--mem-fraction-static", "0.2"],
    "cuda": ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph",
             "--skip-server-warmup", "--dtype", "bfloat16", "--mem-fraction-static", "0.3"],
}


def random_state(shape, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """HF-named weights of ``shape`` (the names and shapes of HF's model for it), random."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        names = AutoModelForCausalLM.from_config(hf_config(shape)).state_dict()
    generator = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=generator) * 0.02).to(dtype) for k, v in names.items()}


def bench_shape(name: str, args, out: Path) -> list[dict]:
    shape = SHAPES[name]
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    states = [random_state(shape, dtype, seed) for seed in (1, 2)]
    gib = sum(t.numel() * t.element_size() for t in states[0].values()) / 2**30
    work = Path(tempfile.mkdtemp(prefix=f"push_{name}_", dir=args.workdir))
    model = save_server_checkpoint(work / "initial", states[0], shape, EOS)
    env = ["env", "SGLANG_USE_CPU_ENGINE=1"] if args.device == "cpu" else ["env"]
    if args.pythonpath:
        env.append(f"PYTHONPATH={args.pythonpath}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ServerProcess(f"SGLang server ({name})", str(out / f"server_{name}.log"))
    server.start(launch_argv([*env, args.python, "-m", "sglang.launch_server"], str(model), "127.0.0.1", port, 1,
                             "0", 0, FLAGS[args.device]))
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        client, deadline = SGLangClient(url, 600.0, 10.0), time.monotonic() + args.startup_timeout_s
        while client.health_error() is not None:
            if server.returncode() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {server.log_tail(40)}")
            time.sleep(1)
        version = 0
        for sync in ("disk", "tensor"):
            engine = SGLangEngine(SGLangConfig(urls=[url], weight_sync=sync), shape, EOS, 0, 0, "127.0.0.1",
                                  work / sync)
            trace = MemoryTrace() if args.device == "cuda" else None
            if trace:
                trace.start()
            seconds = []
            for i in range(args.pushes + 1):  # the first is a warm-up
                version += 1
                fresh = {k: v.clone() for k, v in states[i % 2].items()}  # new tensors, as each step's are
                started = time.perf_counter()
                engine.update_weights(fresh, version)
                seconds.append(time.perf_counter() - started)
            assert str(client.model_info()["weight_version"]) == str(version)
            samples = trace.stop() if trace else []
            rows.append({"shape": name, "weights_gib": round(gib, 3), "weight_sync": sync,
                         "push_s": statistics.median(seconds[1:]), "max_push_s": max(seconds[1:]),
                         "first_push_s": seconds[0],
                         "gpu_peak_gib": max((m for _, m in samples), default=0.0) / 1024})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", required=True, help="the server's interpreter")
    parser.add_argument("--pythonpath", default="", help="the server's PYTHONPATH (an unpacked carry)")
    parser.add_argument("--device", choices=sorted(FLAGS), default="cpu")
    parser.add_argument("--shapes", default="tiny")
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--startup-timeout-s", type=float, default=300)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: the system's temp)")
    parser.add_argument("--out", default="outputs/bench/sglang_push")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [row for name in args.shapes.split(",") for row in bench_shape(name, args, out)]
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    keys = ["shape", "weights_gib", "weight_sync", "push_s", "max_push_s", "first_push_s", "gpu_peak_gib"]
    print(table(keys, [[r[k] for k in keys] for r in rows]), flush=True)


if __name__ == "__main__":
    main()
