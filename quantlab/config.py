"""Typed configuration: the dataclasses are the schema (registered in Hydra's ConfigStore by quantlab.compose);
YAML files hold values only. Every node is a structured config, so an unknown key fails at composition time.

Precision and engine schemas live beside their registry entries (quantlab.precisions, quantlab.engines.registry):
the config group chosen (`precision=fp8`, `engine=torch`) decides the node's type, and the type decides what runs.
No field names the mode, so nothing can claim one mode while another runs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from omegaconf import MISSING

from quantlab.gate.config import GateConfig

# The two environment variables quantlab reads outside Hydra (process settings, not a run's: the engine's kernel
# switches are engine.kernels.*, quantlab/engines/registry.py)
ENV_CACHE = "QUANTLAB_CACHE"  # the artifact store's directory when cache_dir is not set
ENV_PROGRESS = "QUANTLAB_PROGRESS"  # auto | lines | off: how progress is shown on stderr


def env_cache_dir() -> str | None:
    """$QUANTLAB_CACHE: the artifact store's directory when cache_dir is not set (None when unset or empty)."""
    return os.environ.get(ENV_CACHE) or None


def env_progress_mode() -> str:
    """$QUANTLAB_PROGRESS, lower-cased: auto (the default), lines or off."""
    return os.environ.get(ENV_PROGRESS, "auto").strip().lower()

PACKAGE_DIR = Path(__file__).resolve().parent


def conf_dir() -> Path:
    """Hydra's primary config directory: packaged copy in a wheel, the repo's conf/ otherwise."""
    packaged = PACKAGE_DIR / "_conf"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / "conf"


def calib_data_dir() -> Path:
    """The data recipes directory: packaged copy in a wheel, the repo's calib_data/ otherwise."""
    packaged = PACKAGE_DIR / "_calib_data"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / "calib_data"


# ----------------------------------------------------------------------------------------------- model
@dataclass
class EmbeddedModel:
    """A model shipped inside a Python package as a GGUF file (no hub needed)."""

    package: str = MISSING
    file: str = MISSING
    architecture: str = "LlamaForCausalLM"
    note: str = ""
    # > 0: the package ships the GGUF in that many chunk packages (PACKAGE_part1..N) and assembles it (its
    # assemble(path), sha256-checked against its EXPECTED_SHA256): assembled into a temporary file for the one
    # conversion, keyed by that sha256
    parts: int = 0
    # the converted model's shape (config.json's names, and its parameter count): what the plan prices a run at
    # on a machine that has not converted it yet (quantlab.prior); checked against the conversion by the tests
    shape: Optional[Dict[str, int]] = None


# accelerate's placement strategies, accepted by model.device_map (calibration, reference, fake-quant, torch engine)
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass
class ModelConfig:
    """The model: a local HF checkpoint (`path`) or the embedded one. Its name in reports is derived from what is
    loaded (the directory, or the embedded file), never set separately."""

    path: Optional[str] = None  # a local HF checkpoint directory (model=local requires it)
    embedded: Optional[EmbeddedModel] = None
    trust_remote_code: bool = False
    dtype: str = "auto"  # auto = float32 on CPU (bf16 matmul is ~400x slower there), bfloat16 on GPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    device_map: Optional[str] = None  # one of DEVICE_MAPS, to spread a large model over several GPUs
    unverified_family: bool = False  # run a family the support table (quantlab.families) does not list


# ------------------------------------------------------------------------------------------------ data
@dataclass
class DataConfig:
    """A data recipe (calib_data/*.yaml). Source: `path` if set, else `dataset`, else Python's pydoc text."""

    path: Optional[str] = None  # local text / .jsonl / .json / .csv / .tsv / .parquet file
    format: str = "auto"  # auto (by suffix) | text | jsonl | json | csv | tsv | parquet
    dataset: Optional[str] = None  # HF `datasets` name, used only where it is available locally
    dataset_config: Optional[str] = None
    split: Optional[str] = None  # default: train for calibration, test for evaluation
    text_field: str = "text"  # jsonl / csv / datasets column holding the text
    seq_len: int = 512
    seed: int = 0
    # auto: what the model expects (quantlab.conventions: its tokenizer adds BOS, its chat template or its family
    # starts with BOS -> bos; else none); eos | bos: every window is that token followed by seq_len - 1 text tokens,
    # so the first text token is scored too (lm-evaluation-harness's rolling-loglikelihood convention); none (or
    # null): plain text windows. An explicit choice the model would not expect is a warning.
    prefix_token: Optional[str] = "auto"
    # Documents (the gate's clusters, docs/statistics.md): records, rows and pydoc topics are documents; plain text is
    # cut at blank lines. A regular expression here: a line of plain text (or a record's whole text) that fully
    # matches it starts a new document and the lines / records up to the next match belong to it (WikiText's
    # article headings: '^ = [^=].* = $'). Only the evaluation set uses documents.
    doc_separator: Optional[str] = None


@dataclass
class CalibConfig(DataConfig):
    """Calibration data: num_samples windows drawn (seeded) from the first pool_windows windows, calibrated in
    batches."""
    num_samples: int = 32
    pool_windows: int = 1024  # windows are drawn from the first pool_windows windows (reading stops there)
    batch_size: int = 16  # AWQ-lite searches per batch: fewer, larger batches calibrate faster (bench/RESULTS.md)


@dataclass
class EvalConfig(DataConfig):
    """Evaluation data and settings: windows up to the cap, batch size, greedy generations, attribution."""

    # cap on evaluation windows (the sequential gate stops earlier once every check is decided); null = every
    # full window of the text. 160: a fault confined to 2% of the text's windows is absent from all of them with
    # probability 0.98^160 = 4% (docs/statistics.md); a healthy run passes from 72 windows on (the tail checks)
    max_windows: Optional[int] = 160
    # the windows are chosen from the first pool_windows windows of the text (null: all of it), spread across its
    # documents in a seeded, stratified order, so every look is a small version of the whole pool (reading stops there)
    pool_windows: Optional[int] = 4096
    batch_size: int = 4
    gen_prompts: int = 4  # greedy-generation agreement: number of prompts (0 = off)
    gen_prompt_len: int = 32
    gen_tokens: int = 32
    attribution: bool = False  # also evaluate the fake-quant model to split quantization vs engine loss
    speed: bool = True  # on a GPU: decode / prefill speed and memory against the unquantized model (paired rounds)
    numerics: bool = True  # re-evaluate the first look's windows with last-bit perturbations: machine-dependent digits


# ------------------------------------------------------------------------------------------ precision
@dataclass
class PrecisionConfig:
    """Base of every precision schema (quantlab.precisions); the chosen group option decides the subclass."""


@dataclass
class KvCacheConfig:
    """The KV cache format of the run (quantlab.precisions.KV_FORMATS)."""
    dtype: str = "none"  # none | fp8


# --------------------------------------------------------------------------------------------- engine
@dataclass
class EngineConfig:
    """Build limits every engine has; engine schemas (quantlab.engines.registry) add their own options."""

    max_input_len: Optional[int] = None  # null = the model's max positions
    max_seq_len: Optional[int] = None
    max_batch_size: int = 64


# --------------------------------------------------------------------------------------------- search
@dataclass
class SearchConfig:
    """+search=cheapest: the cheapest per-layer formats that pass the gate on the exported checkpoint
    (quantlab.search). Every candidate is exported and evaluated by the run's engine with the run's gate; the
    thresholds are the gate's base thresholds for every candidate (gate.per_precision does not apply: one bar)."""

    formats: List[str] = field(default_factory=lambda: ["int4_awq", "fp8", "none"])  # per-layer choices
    int4_block_sizes: List[int] = field(default_factory=list)  # more group sizes for int4 layers, e.g. [32]
    kv_cache: List[str] = field(default_factory=lambda: ["none"])  # KV formats tried on the winner (none | fp8)
    cost: str = "bits"  # bits: stored bits per weight, scales included | aq_bits: AutoQuantize's count (no scales)
    # | latency: measured engine=torch latency of a prefill (quantlab.search.latency)
    max_evaluations: int = 6  # full gate evaluations of exported checkpoints, uniform comparisons included
    sensitivity: str = "autoquantize"  # autoquantize: gradient scores | measured: one forward per group and format
    score_samples: Optional[int] = None  # calibration windows scored for sensitivity (null: all of calib)
    resolution_bits: float = 0.05  # stop when the cheapest pass and the dearest fail are this close
    latency_batch: int = 1  # cost=latency: sequences per timed forward pass
    latency_tokens: Optional[int] = None  # cost=latency: tokens per sequence (null: eval.seq_len)
    latency_repeats: int = 10  # cost=latency: paired rounds per look (more looks, up to 4, while undecided)
    min_speedup: float = 0.02  # cost=latency: a format must beat the unquantized model by this share to count


# ----------------------------------------------------------------------------------------------- root
STAGES = ("prepare", "data", "quantize", "export", "build", "evaluate")  # stop_after cuts the run after one


@dataclass
class Config:
    """The whole run: model, precision, KV cache, data, engine, gate, cache and what to stop after (Hydra's root
    node)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = MISSING  # a config group: precision=fp8 (or +precision=fp8)
    kv_cache: KvCacheConfig = field(default_factory=KvCacheConfig)
    calib: CalibConfig = field(default_factory=CalibConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = MISSING  # a config group: engine=torch (default)
    gate: GateConfig = field(default_factory=GateConfig)
    cache_dir: Optional[str] = None  # default: $QUANTLAB_CACHE or ~/.cache/quantlab
    stop_after: Optional[str] = None  # one of STAGES, to end the run early
    run_checkpoint: str = "hardlink"  # RUN/checkpoint: hardlink (copy across filesystems), copy, or symlink
    # stop: an error finding of the checkpoint audit ends the run before evaluation (exit 1); evaluate: evaluated
    # anyway (what the broken export does, for a diagnosis or a timing run), the verdict FAIL whatever the gate says
    audit_errors: str = "stop"
    quiet: bool = False
    search: Optional[SearchConfig] = None  # +search=cheapest: find the cheapest configuration that passes
