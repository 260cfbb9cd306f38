#!/bin/bash
# bench/at_size.py on the device machine (one H200), carried with .device/ (the tested wheels, SmolLM2's tokenizer
# saved by transformers from its GGUF, WikiText-2 raw valid/test):
#   bash bench/at_size_device.sh PRECISION [by-hand]
# builds the 8B-shaped model once per machine (/tmp/m8b), runs quantlab on it (cache /tmp/qc), then, with by-hand,
# the same steps by hand on the tokens quantlab read. Everything measured goes to $OUT. The tokenizer and data may
# also come as one archive, .device/x/x.tgz (tok/ and data/), unpacked to /tmp/xt; the wheels install to /tmp/site
# once per machine (shared with bench/decode_device.sh).
set -u
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TORCH_EXTENSIONS_DIR=/tmp/te PYTHONWARNINGS=ignore
export TOKENIZERS_PARALLELISM=false
P=$1
[ -d /tmp/site/hydra ] || pip install --no-deps -q --target /tmp/site .device/wheels/*.whl > /tmp/pip.log 2>&1 \
  || tail -5 /tmp/pip.log
TOK=.device/tok DATA=.device/data
if [ -f .device/x/x.tgz ]; then
  [ -d /tmp/xt/tok ] || { mkdir -p /tmp/xt && tar xzf .device/x/x.tgz -C /tmp/xt; }
  TOK=/tmp/xt/tok DATA=/tmp/xt/data
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2 | tail -1
[ -f /tmp/m8b/config.json ] || python bench/at_size.py build --shape 8b --tokenizer $TOK --out /tmp/m8b \
  | tee $OUT/build.json
python bench/at_size.py quantlab --model /tmp/m8b --precision $P --data $DATA --run /tmp/q_$P --cache /tmp/qc \
  | tee $OUT/quantlab_$P.json
cp /tmp/q_$P/run.json $OUT/run_$P.json 2>/dev/null; cp /tmp/q_$P/bench_stdout.txt $OUT/stdout_$P.txt 2>/dev/null
cp /tmp/q_$P/metrics.json $OUT/metrics_$P.json 2>/dev/null
if [ "${2:-}" = by-hand ]; then
  python bench/at_size.py by-hand --model /tmp/m8b --precision $P --run /tmp/q_$P --cache /tmp/qc --out /tmp/h_$P \
    2>$OUT/byhand_$P.err | tee $OUT/byhand_$P.json
fi
tail -3 $OUT/stdout_$P.txt
