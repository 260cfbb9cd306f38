#!/bin/bash
# usage (from the repo root on the device, with the wheels of ../shared/wheels-py312 and pytest in .device/wheels):
#   JOBS=8 bash bench/h200_matrix.sh --kv none
# the family matrix on the device: wheels installed into .device/site, ModelOpt's extension built once
set -u
export PYTHONPATH=$PWD/.device/site:$PWD
export TORCH_EXTENSIONS_DIR=/tmp/torch_ext
export HF_HUB_OFFLINE=1
pip install --no-deps --target .device/site .device/wheels/*.whl > /tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
python -c "import torch, transformers, modelopt, jinja2, matplotlib, scipy, accelerate, filelock, safetensors, pytest; print(torch.__version__, transformers.__version__, modelopt.__version__, torch.cuda.get_device_name(0))" 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout ${MATRIX_TIMEOUT:-480} python bench/family_matrix.py --out $OUT/matrix --jobs ${JOBS:-6} "$@" 2>&1 | grep -v Warning | tail -${TAIL:-150}
cp $OUT/matrix/matrix.md $OUT/matrix/matrix.json $OUT/ 2>/dev/null; rm -rf $OUT/matrix
