#!/usr/bin/env bash
# Builds .whl/ (git-ignored): what the lent GPU machine lacks to run rlfw there. That machine has Python 3.12 with
# torch, triton, transformers and numpy, and no network, so rlfw's other runtime dependencies travel as cp312 wheels
# (the device tool's `carry=[".whl"]`, at most 64 MiB with the tree). Ray's wheel (79 MB) is over that limit: it goes
# as a tar.xz of its installed tree without the Java jars and the dashboard's source maps (27 MB). wandb,
# and math-verify stay behind: the default job (logger=jsonl, the copy task) never imports them; TRL and datasets go for
# the GPU peer row (bench/bench_vs_trl.py --gpu).
# On the machine: `bash .whl/install.sh`, then `export PYTHONPATH=/tmp/site:$PWD`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP="${PIP:-.venv/bin/pip}"
OUT=.whl
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
rm -rf "$OUT" && mkdir -p "$OUT/wheels" "$OUT/extra"
CP312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64)

"$PIP" download "${CP312[@]}" -d "$OUT/wheels" \
  torchft==0.2.0 megatron-core==0.19.2 hydra-core==1.3.8 omegaconf==2.3.1 einops==0.8.2 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  googleapis-common-protos==1.76.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-http-transport==0.66b2 \
  opentelemetry-exporter-otlp-common==0.66b2
# bench/bench_vs_trl.py --gpu: TRL and what it needs that the machine lacks (it has accelerate, pandas, pyarrow)
"$PIP" download "${CP312[@]}" -d "$OUT/wheels" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# antlr4's runtime is on PyPI as source only: pure Python, so a wheel built here serves 3.12 too
"$PIP" wheel --no-deps -w "$OUT/wheels" antlr4-python3-runtime==4.9.3
# installed only where the machine's own are too old (install.sh checks): protobuf >= 6.33.5, packaging >= 24.2
"$PIP" download "${CP312[@]}" -d "$OUT/extra" protobuf==7.36.2 packaging==26.4

"$PIP" install "${CP312[@]}" --target "$TMP/ray" ray==2.60.0
rm -rf "$TMP/ray/ray/jars"
find "$TMP/ray" \( -name '*.map' -o -name '__pycache__' \) -prune -exec rm -rf {} +
sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$TMP/ray/bin/"*
XZ_OPT=-9 tar -cJf "$OUT/ray.tar.xz" -C "$TMP/ray" ray ray-2.60.0.dist-info bin
cp bench/carry/install.sh bench/carry/check_carry.py "$OUT/"
du -sh "$OUT"
