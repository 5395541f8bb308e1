#!/usr/bin/env bash
# Offline install of the SGLang server build_sglang.sh carries: run `bash .sglang-whl/install_sglang.sh` from the
# repo root; it unpacks into $SITE (default /tmp/sglang-site, outside the tree, so a later command on the same
# machine finds it). Then the server runs as `env PYTHONPATH=$SITE python3 -m sglang.launch_server ...` (that
# folder alone: rlfw keeps the machine's transformers).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SITE="${SITE:-/tmp/sglang-site}"
PY="${PYTHON:-python3}"
rm -rf "$SITE" && mkdir -p "$SITE"
if command -v xz >/dev/null 2>&1; then
  tar -xJf "$HERE/sglang-site.tar.xz" -C "$SITE"
else
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$HERE/sglang-site.tar.xz" "$SITE"
fi

# check: the carried packages' requirements are met (by the carry or this python), and the server's modules import.
# sglang's and flashinfer's own lists name GPU kernels for other paths (FA3/4, DeepGEMM, cutlass-dsl...): not checked.
PYTHONPATH="$SITE" "$PY" "$HERE/check_carry.py" install_sglang.sh --site "$SITE" \
  --skip sglang,flashinfer-python,sglang-kernel \
  --modules sgl_kernel,flashinfer.sampling,sglang.launch_server,sglang.srt.entrypoints.http_server,\
sglang.srt.managers.scheduler,sglang.srt.model_executor.model_runner,sglang.srt.layers.attention.triton_backend,\
sglang.srt.layers.sampler,sglang.srt.models.qwen2
