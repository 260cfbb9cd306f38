"""Engine registry: each engine's config schema beside the facts about it.

`runs` says what an engine executes, and so what identifies its outputs:
- "checkpoint": the exported files (torch, trtllm): keyed by the checkpoint's fingerprint, built from its path;
- "calibrated": ModelOpt's fake-quant model (fakequant and the attribution rungs): keyed by the calibrated state;
- "model": the unquantized model itself (reference, a control run).
`supports(quant_algo)` and `available()` answer preflight's questions; `build` is imported only when an engine is
built. Adding an engine is one schema, one EngineSpec and one YAML in conf/engine/.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from quantlab.config import EngineConfig
from quantlab.registry import Registry

RUNS = ("checkpoint", "calibrated", "model")


# ---------------------------------------------------------------------------------------------- schemas
@dataclass
class KernelsConfig:
    """engine.kernels: quantlab's own kernels and the decode path's switches. `disabled` names kernels of
    quantlab.engines.kernels.names.KERNELS (or `all`: the torch reference numerics); `pdl`: programmatic dependent
    launch on compute capability 9.0+; `compile_edges`: the decode step's final norm, rotary embedding and argmax
    compiled with its layers; `combo_kernels`: inductor's horizontal fusion in the compiled layers. Checked when the
    config is built (a name that is not a kernel is exit 2, before anything is computed)."""

    disabled: list[str] = field(default_factory=list)
    pdl: bool = True
    compile_edges: bool = True
    combo_kernels: bool = True

    def __post_init__(self) -> None:
        check_kernel_names(self.disabled, "engine.kernels.disabled")

    def resolved(self) -> dict:
        """The switches in force: these, plus the names of $QUANTLAB_DISABLED_KERNELS (benches only; said once)."""
        import os

        from quantlab.engines.kernels.names import ENV_DISABLED, LEGACY_ENV
        from quantlab.errors import QuantlabError

        legacy = [n for n in LEGACY_ENV if n in os.environ]
        if legacy:
            raise QuantlabError(f"${legacy[0]} is no longer read: the decode path's switches are engine.kernels.*",
                                fix=f"unset {' '.join(legacy)} and set {', '.join(LEGACY_ENV[n] for n in legacy)} "
                                    "where you want the feature off (docs/engines.md)")
        disabled = list(self.disabled)
        extra = [n.strip() for n in os.environ.get(ENV_DISABLED, "").split(",") if n.strip()]
        if extra:
            check_kernel_names(extra, f"${ENV_DISABLED}")
            if tuple(extra) not in _SAID_ENV:
                _SAID_ENV.add(tuple(extra))
                import logging

                logging.getLogger("quantlab").warning(
                    "$%s=%s adds %s to engine.kernels.disabled (an override for benches: prefer "
                    "engine.kernels.disabled=[...])", ENV_DISABLED, os.environ[ENV_DISABLED], ", ".join(extra))
            disabled += [n for n in extra if n not in disabled]
        return {"disabled": sorted(disabled), "pdl": self.pdl, "compile_edges": self.compile_edges,
                "combo_kernels": self.combo_kernels}

    def is_default(self) -> bool:
        """Whether every switch is at its default (the outputs' identity then names none)."""
        return self.resolved() == KernelsConfig().resolved()


_SAID_ENV: set = set()


def check_kernel_names(names, where: str) -> None:
    """Every name is one of quantlab's kernels or `all` (QuantlabError with a did-you-mean otherwise)."""
    from quantlab.engines.kernels.names import ALL, KERNELS
    from quantlab.errors import QuantlabError
    from quantlab.registry import did_you_mean

    choices = [*KERNELS, ALL]
    for name in names:
        if name not in choices:
            raise QuantlabError(f"{where}: {name!r} is not one of quantlab's kernels{did_you_mean(name, choices)}",
                                fix=f"name kernels among {', '.join(choices)}")


@dataclass
class TorchEngineConfig(EngineConfig):
    """quantlab's engine: the exported checkpoint with deployment numerics (FP8 / INT8 / INT4 GEMMs, FP8 KV)."""

    checkpoint: Optional[str] = None  # evaluate this exported checkpoint instead of quantizing (e.g. from hf_ptq)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)


@dataclass
class FakequantEngineConfig(EngineConfig):
    """ModelOpt's simulated quantization of the calibrated model (what calibration produced, not what ships)."""


@dataclass
class ReferenceEngineConfig(EngineConfig):
    """The unquantized model as its own candidate: a control run that must pass every gate."""


@dataclass
class TrtllmEngineConfig(EngineConfig):
    """TensorRT-LLM's LLM API on the exported checkpoint (where tensorrt_llm imports)."""

    checkpoint: Optional[str] = None
    tensor_parallel_size: int = 1
    trtllm_backend: str = "pytorch"  # pytorch | tensorrt


@dataclass
class ServedEngineConfig(EngineConfig):
    """A running OpenAI-compatible server (llama.cpp's, vLLM, SGLang, trtllm-serve) judged through its API on the
    same tokens (quantlab.engines.served; docs/served.md)."""

    base_url: Optional[str] = None  # http(s)://HOST:PORT of the server (required)
    model: Optional[str] = None  # the model name the server serves (checked against its /v1/models)
    dialect: str = "llama_cpp"  # llama_cpp | vllm | sglang | openai: how prompt log-probs are asked for
    top_logprobs: int = 20  # k alternatives per position (vLLM caps it with --max-logprobs, default 20)
    timeout_s: float = 120.0  # one request
    retries: int = 3  # more tries of a failed request (connection, timeout, 429 / 5xx), with backoff
    concurrency: int = 2  # requests in flight at once
    api_key_env: Optional[str] = None  # NAME of the environment variable holding the API key (never logged)
    revision: Optional[str] = None  # part of the cache key: change it when the server is given another checkpoint
    command: Optional[str] = None  # started by quantlab: a template with {port} (and {checkpoint}); base_url unset
    serve_checkpoint: Optional[str] = None  # what {checkpoint} names (a path: its size and mtime join the cache key)
    startup_timeout_s: float = 300.0  # the started server must answer /v1/models within this
    identity_check: bool = True  # window 1 against llama.cpp's own log-probs of serve_checkpoint (a GGUF), exit 2 off


# ---------------------------------------------------------------------------------------------- entries
def _always() -> str | None:
    return None


def _all_algos(_: str) -> bool:
    return True


def _torch_supports(quant_algo: str) -> bool:
    from quantlab.engines.qlayers import QLAYERS

    # mixed, external (any format of quantlab.formats): every layer's format checked at load
    return quant_algo in QLAYERS or quant_algo in ("MIXED_PRECISION", "EXTERNAL")


def _trtllm_available() -> str | None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        from quantlab.engines.trtllm import INSTALL_HINT

        return "engine=trtllm needs TensorRT-LLM, which is not installed here\n  fix: " + INSTALL_HINT
    return None


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its config schema, what it runs (one of RUNS), the "module:function" that builds it,
    which quant_algos it supports, whether it is available here (None, or why not) and the config options
    that change its outputs."""

    name: str
    schema: type | None  # None: internal, not selectable with engine=NAME
    runs: str  # one of RUNS
    build: str  # "module:function", called as fn(engine_cfg, inputs, limits) -> Engine
    description: str
    supports: Callable[[str], bool] = field(default=_all_algos, compare=False)
    available: Callable[[], str | None] = field(default=_always, compare=False)  # None, or why not (with the fix)
    identity: Callable[[Any], dict] = field(default=lambda cfg: {}, compare=False)  # options that change outputs

    @property
    def public(self) -> bool:
        """Selectable with engine=NAME (it has a config schema); the attribution rungs are not."""
        return self.schema is not None

    def builder(self) -> Callable:
        """The function `build` names, imported now."""
        module, _, fn = self.build.partition(":")
        return getattr(importlib.import_module(module), fn)


ENGINES: Registry[EngineSpec] = Registry("engine", "engine=NAME")
ENGINES.add("torch", EngineSpec("torch", TorchEngineConfig, "checkpoint", "quantlab.engines.torch_engine:build",
                                "the exported checkpoint with deployment numerics", supports=_torch_supports,
                                identity=lambda cfg: {} if cfg.kernels.is_default() else
                                {"kernels": cfg.kernels.resolved()}))
ENGINES.add("trtllm", EngineSpec("trtllm", TrtllmEngineConfig, "checkpoint", "quantlab.engines.trtllm:build",
                                 "TensorRT-LLM's LLM API on the exported checkpoint", available=_trtllm_available,
                                 identity=lambda cfg: {"backend": cfg.trtllm_backend}))
ENGINES.add("served", EngineSpec("served", ServedEngineConfig, "model", "quantlab.engines.served:build",
                                 "a running OpenAI-compatible server, through its API",
                                 identity=lambda cfg: importlib.import_module("quantlab.engines.served").identity(cfg)))
ENGINES.add("fakequant", EngineSpec("fakequant", FakequantEngineConfig, "calibrated",
                                    "quantlab.engines.fakequant:plain", "ModelOpt's fake-quant model as calibrated"))
ENGINES.add("reference", EngineSpec("reference", ReferenceEngineConfig, "model", "quantlab.engines.hf:reference",
                                    "the unquantized model (control run)"))
# attribution rungs (eval.attribution=true): not selectable, evaluated beside the engine under test
ENGINES.add("fakequant_exported", EngineSpec("fakequant_exported", None, "calibrated",
                                             "quantlab.engines.fakequant:as_exported",
                                             "fake-quant after the transformations export applies"))
ENGINES.add("fakequant_jitter", EngineSpec("fakequant_jitter", None, "calibrated",
                                           "quantlab.engines.fakequant:jittered",
                                           "fake-quant as exported under rounding-sized input noise (the floor)"))
ATTRIBUTION_RUNGS = ("fakequant", "fakequant_exported", "fakequant_jitter")
ENGINE_SCHEMAS: dict[str, type] = {name: e.schema for name, e in ENGINES.items() if e.public}


def engine_of(cfg: EngineConfig) -> EngineSpec:
    """The registry entry of an engine config, found by its type."""
    entry = ENGINES.find(lambda e: e.schema is type(cfg))
    if entry is None:
        raise ValueError(f"{type(cfg).__name__} is not a registered engine schema")
    return entry
