#!/bin/bash
# bench/decode.py --check on the device machine (one H100 or H200), with the tested wheels of .device/wheels (carried):
#   bash bench/decode_device.sh [more bench/decode.py flags]
# The documented run at its default budget (480 s: the whole call fits 600 s on a fresh machine). Its log goes to
# $OUT/decode.log and its JSON to $OUT/decode.json (rewritten after every section: a run cut off keeps its rows).
set -u
[ -d /tmp/site/hydra ] || pip install --no-deps -q --target /tmp/site .device/wheels/*.whl > /tmp/pip.log 2>&1 \
  || tail -5 /tmp/pip.log
export PYTHONPATH=/tmp/site:$PWD TORCH_EXTENSIONS_DIR=/tmp/te HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python bench/decode.py --check --out "$OUT/decode.json" "$@" 2>&1 | tee "$OUT/decode.log"
exit "${PIPESTATUS[0]}"
