#!/usr/bin/env bash
# Builds .sglang-whl/ (git-ignored): a stock SGLang server for a GPU machine without network (Python 3.12, torch
# 2.11.0+cu130), beside rlfw's own carry (build.sh). sglang 0.5.17 is the last release pinning that torch; it pins
# transformers 5.12.1 (which wants tokenizers <= 0.23.0: 0.22.2) and sglang-kernel 0.4.5. The server's own
# environment is a folder of its own, /tmp/sglang-site on the machine, put on the server's PYTHONPATH alone
# (rollout.sglang.launch_command), so rlfw's trainer keeps the machine's transformers.
#
# What travels: the packages the server imports on the GPU path that the machine lacks, found by importing its
# modules (launch_server, http_server, scheduler, model_runner, the triton attention backend, the sampler, Qwen2 and
# Llama); flashinfer-python goes too, since sglang's sampler imports flashinfer.sampling on CUDA even with
# --sampling-backend pytorch. flashinfer compiles a kernel (nvcc, on the machine) when one is first used, and one
# is: sgl_kernel's RMSNorm calls flashinfer's whenever flashinfer imports (seen on an H100: without its sources the
# server died at its first forward, "Ninja build failed ... flashinfer/data/csrc/norm.cu missing"). So its CUDA
# sources and headers travel (csrc, include, cccl, spdlog: ~8 MB compressed); CUTLASS's headers (37 MB), which the
# norm kernel does not include, stay behind.
# sglang-kernel without FA3 (flash_ops), FlashMLA, InfLLM and the sm100 build: kept are sm90/common_ops (Hopper) and
# the dist-info sglang's version check reads. Also left out: xgrammar's static library, jedi's typeshed stubs (IPython
# completion), sglang's diffusion-model server. The installed tree (298 MB) goes as one tar.xz of ~54 MB: with the
# tree it travels in one call, and rlfw's own carry (.whl, 33 MB) in the next (64 MiB a call), while /tmp lasts.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP="${PIP:-.venv/bin/pip}"
OUT=.sglang-whl
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
CP312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
       --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64)

"$PIP" install "${CP312[@]}" --no-compile --target "$TMP/site" \
  sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 transformers==5.12.1 tokenizers==0.22.2 \
  xgrammar==0.2.1 apache-tvm-ffi==0.1.11 openai==2.6.1 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 python-multipart==0.0.34 orjson==3.13.0 msgspec==0.23.0 \
  pybase64==1.5.1 pyzmq==27.3.0 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 interegular==0.3.3 \
  dill==0.4.1 opentelemetry-api==1.45.3 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 \
  ipython==9.19.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 \
  pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.5 stack-data==0.6.3 executing==2.3.0 \
  asttokens==3.0.2 pure-eval==0.2.4 traitlets==5.16.1

site="$TMP/site"
rm -rf "$site/sgl_kernel/flash_ops".* "$site/sgl_kernel/flashmla_ops".* "$site/sgl_kernel/infllm_ops".* \
       "$site/sgl_kernel/sm100" "$site/flashinfer/data/cutlass" "$site/xgrammar/lib" "$site/jedi/third_party" \
       "$site/sglang/multimodal_gen" "$site/bin"
find "$site" -name '__pycache__' -prune -exec rm -rf {} +
test -f "$site/sgl_kernel/sm90/common_ops.abi3.so" && test -d "$site"/sglang_kernel-0.4.5.dist-info

rm -rf "$OUT" && mkdir -p "$OUT"
tar -cf - -C "$site" . | xz -T2 -6 > "$OUT/sglang-site.tar.xz"
cp bench/carry/install_sglang.sh bench/carry/check_carry.py "$OUT/"
du -sh "$OUT" "$site"
