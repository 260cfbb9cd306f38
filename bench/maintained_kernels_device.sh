#!/bin/bash
# bench/maintained_kernels.py on the device machine (one H100 or H200): torch's tinygemm, torchao 0.18 and gemlite 0.6
# against quantlab's W4A16 and FP8 kernels at the 8B decode shapes (FlashInfer: import probed, never run). Carry
# .device/wheels (the project's dependencies, as bench/decode_device.sh) and .device/mk (the torchao wheel, gemlite's
# wheel built offline from its sdist, and the sdist itself: unpacked onto the path if the wheel does not install):
#   bash bench/maintained_kernels_device.sh [more bench/maintained_kernels.py flags]
# Its log goes to $OUT/maintained_kernels.log and its JSON to $OUT/maintained_kernels.json (rewritten after every
# section: a run cut off keeps its rows). Default budget 420 s: the whole call fits 600 s on a fresh machine.
set -u
[ -d /tmp/site/hydra ] || pip install --no-deps -q --target /tmp/site .device/wheels/*.whl > /tmp/pip.log 2>&1 \
  || tail -5 /tmp/pip.log
[ -d /tmp/mk/torchao ] || pip install --no-deps -q --target /tmp/mk .device/mk/*.whl > /tmp/pip-mk.log 2>&1 \
  || tail -5 /tmp/pip-mk.log
if [ ! -d /tmp/mk/gemlite ]; then  # pure Python: the sdist's package directory serves as well
  mkdir -p /tmp/mk-src && tar xzf .device/mk/gemlite-*.tar.gz -C /tmp/mk-src && cp -r /tmp/mk-src/gemlite-*/gemlite /tmp/mk/
fi
export PYTHONPATH=/tmp/site:/tmp/mk:$PWD TORCH_EXTENSIONS_DIR=/tmp/te HF_HUB_OFFLINE=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python bench/maintained_kernels.py --out "$OUT/maintained_kernels.json" "$@" 2>&1 | tee "$OUT/maintained_kernels.log"
exit "${PIPESTATUS[0]}"
