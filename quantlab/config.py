"""Typed configuration. Dataclasses are the schema (registered in Hydra's ConfigStore); YAML holds values.

Every node is a structured config, so an unknown key fails at composition time instead of being ignored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import MISSING

PACKAGE_DIR = Path(__file__).resolve().parent


def conf_dir() -> Path:
    """Hydra's primary config directory: packaged copy in a wheel, the repo's conf/ otherwise."""
    packaged = PACKAGE_DIR / "_conf"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / "conf"


def calib_data_dir() -> Path:
    packaged = PACKAGE_DIR / "_calib_data"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / "calib_data"


# ----------------------------------------------------------------------------------------------- model
@dataclass
class EmbeddedModel:
    """A model shipped inside a Python package as a GGUF file (no hub needed)."""

    package: str = MISSING
    file: str = MISSING
    architecture: str = "LlamaForCausalLM"
    awq_block_size: Optional[int] = None  # preferred AWQ block when the model's dimensions need one
    note: str = ""


# accelerate's placement strategies, accepted by model.device_map (calibration, reference, fake-quant, torch engine)
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass
class ModelConfig:
    name: str = "smollm2_135m"
    path: Optional[str] = None  # a local HF checkpoint; when set, `embedded` is ignored
    embedded: Optional[EmbeddedModel] = None
    trust_remote_code: bool = False
    dtype: str = "auto"  # auto = float32 on CPU (bf16 matmul is ~400x slower there), bfloat16 on GPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    device_map: Optional[str] = None  # one of DEVICE_MAPS, to spread a large model over several GPUs


# ------------------------------------------------------------------------------------------------ data
@dataclass
class DataConfig:
    """A data recipe (calib_data/*.yaml). Source: `path` if set, else `dataset`, else Python's pydoc text."""

    path: Optional[str] = None  # local .txt or .jsonl
    dataset: Optional[str] = None  # HF `datasets` name, used only where it is available locally
    dataset_config: Optional[str] = None
    split: Optional[str] = None  # default: train for calibration, test for evaluation
    text_field: str = "text"  # jsonl / datasets column holding the text
    seq_len: int = 512
    seed: int = 0
    # eos | bos: every window is that token followed by seq_len - 1 text tokens, so the first text token is
    # scored too (lm-evaluation-harness's rolling-loglikelihood convention); null: plain text windows
    prefix_token: Optional[str] = None


@dataclass
class CalibConfig(DataConfig):
    num_samples: int = 32
    batch_size: int = 16  # AWQ-lite searches per batch: fewer, larger batches calibrate faster (bench/RESULTS.md)


@dataclass
class EvalConfig(DataConfig):
    max_windows: Optional[int] = 24  # cap on evaluation windows; null = every full window
    batch_size: int = 4
    topk: int = 64  # reference distribution kept per position for KL (top-k + one tail bin)
    gen_prompts: int = 4  # greedy-generation agreement: number of prompts (0 = off)
    gen_prompt_len: int = 32
    gen_tokens: int = 32
    attribution: bool = False  # also evaluate the fake-quant model to split quantization vs engine loss


# ------------------------------------------------------------------------------------------ precision
@dataclass
class PrecisionConfig:
    name: str = MISSING


@dataclass
class Fp8Config(PrecisionConfig):
    """W8A8 FP8 E4M3, per-tensor static scales (Hopper / Ada or newer for real FP8 GEMMs)."""

    name: str = "fp8"


@dataclass
class Int8SqConfig(PrecisionConfig):
    """W8A8 INT8 SmoothQuant: per-channel weights, per-tensor static activations."""

    name: str = "int8_sq"
    alpha: Optional[float] = None  # SmoothQuant migration strength; null = ModelOpt's default


@dataclass
class Int4AwqConfig(PrecisionConfig):
    """W4A16 AWQ with group-wise int4 weights."""

    name: str = "int4_awq"
    block_size: Optional[int] = None  # null = the model's preferred block (SmolLM2: 64), else 128


@dataclass
class W4A8AwqConfig(Int4AwqConfig):
    """W4A8 AWQ: int4 weights, FP8 activations (Ada / Hopper or newer)."""

    name: str = "w4a8_awq"


@dataclass
class Nvfp4Config(PrecisionConfig):
    """NVFP4 W4A4 with FP8 block scales (Blackwell or newer)."""

    name: str = "nvfp4"


@dataclass
class KvCacheConfig:
    dtype: str = "none"  # none | fp8


# --------------------------------------------------------------------------------------------- engine
@dataclass
class EngineConfig:
    name: str = "torch"  # torch | fakequant | trtllm | reference
    checkpoint: Optional[str] = None  # evaluate this exported checkpoint instead of quantizing (e.g. from hf_ptq)
    max_input_len: Optional[int] = None  # null = the model's max positions
    max_seq_len: Optional[int] = None
    max_batch_size: int = 64
    tensor_parallel_size: int = 1
    trtllm_backend: str = "pytorch"


# ----------------------------------------------------------------------------------------------- gate
@dataclass
class Threshold:
    min: Optional[float] = None
    max: Optional[float] = None


@dataclass
class StatisticalGate:
    """TensorRT-LLM accuracy-suite style test on per-window NLL (windows are the independent units)."""

    enabled: bool = True
    alpha: float = 0.05
    beta: float = 0.2


@dataclass
class GateConfig:
    thresholds: Dict[str, Threshold] = field(default_factory=dict)
    per_precision: Dict[str, Dict[str, Threshold]] = field(default_factory=dict)
    statistical: StatisticalGate = field(default_factory=StatisticalGate)
    baseline: Optional[str] = None  # metrics.json of an earlier release: regression check
    baseline_alpha: float = 0.05


# ----------------------------------------------------------------------------------------------- root
@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: Any = None  # chosen with +precision=NAME (not in the defaults list)
    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    calib: CalibConfig = field(default_factory=CalibConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    cache_dir: Optional[str] = None  # default: $QUANTLAB_CACHE or ~/.cache/quantlab
    stop_after: Optional[str] = None  # a stage name (e.g. export) to end the run early
    quiet: bool = False


PRECISION_SCHEMAS: Dict[str, type] = {
    "fp8": Fp8Config,
    "int8_sq": Int8SqConfig,
    "int4_awq": Int4AwqConfig,
    "w4a8_awq": W4A8AwqConfig,
    "nvfp4": Nvfp4Config,
}


def register_configs() -> None:
    """Register schemas and the calib_data/ recipes in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name, schema in PRECISION_SCHEMAS.items():
        cs.store(group="precision", name=f"_schema_{name}", node=schema)
    for recipe in sorted(calib_data_dir().glob("*.yaml")):
        cs.store(group="calib_data", name=recipe.stem, node=OmegaConf.load(recipe))
