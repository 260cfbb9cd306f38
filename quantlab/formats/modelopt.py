"""ModelOpt's unified checkpoint (export_hf_checkpoint): hf_quant_config.json beside config.json and safetensors."""
from __future__ import annotations

from pathlib import Path

from quantlab.checkpoint import QUANT_CONFIG, CheckpointTensors, read_json_file, read_quant_config, safetensors_files
from quantlab.formats.base import CheckpointFormat, Opened


def detect(path: Path) -> bool:
    """A directory with hf_quant_config.json."""
    return path.is_dir() and (path / QUANT_CONFIG).is_file()


def open_modelopt(path: Path) -> Opened:
    """hf_quant_config.json as it is; the tensors as they are."""
    quant = read_quant_config(path, required=True)
    config_file = path / "config.json"
    config = read_json_file(config_file, "config") if config_file.is_file() else {}
    tensors = CheckpointTensors(path)
    kv = f", {quant.kv_cache_quant_algo} KV cache" if quant.kv_cache_quant_algo else ""
    group = f" group {quant.group_size}" if quant.group_size else ""
    return Opened(path, "modelopt", "NVIDIA ModelOpt", f"{quant.quant_algo}{group}{kv}", quant, tensors,
                  safetensors_files(path), config if isinstance(config, dict) else {})


FORMAT = CheckpointFormat("modelopt", "NVIDIA ModelOpt", detect, open_modelopt)
