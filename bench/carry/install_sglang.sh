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
PYTHONPATH="$SITE" "$PY" - "$SITE" <<'EOF'
import importlib, importlib.metadata as md, sys
from packaging.requirements import Requirement
site = sys.argv[1]
bad = []
for dist in md.distributions(path=[site]):
    name = dist.metadata["Name"]
    if name.lower() in ("sglang", "flashinfer-python", "sglang-kernel"):
        continue
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(f"{name} needs {req}: not installed"); continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            bad.append(f"{name} needs {req}: have {have}")
for mod in ["sgl_kernel", "flashinfer.sampling", "sglang.launch_server", "sglang.srt.entrypoints.http_server",
            "sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner",
            "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler", "sglang.srt.models.qwen2"]:
    try:
        importlib.import_module(mod)
    except Exception as e:
        bad.append(f"import {mod}: {type(e).__name__}: {e}")
print("\n".join("install_sglang.sh: WARNING " + b for b in bad)
      or f"install_sglang.sh: sglang {md.version('sglang')} imports from {site}; requirements met")
EOF
