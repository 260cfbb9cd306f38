"""Hydra wiring: the schemas in the ConfigStore, and composing a typed Config from overrides the way the CLI does.

Precision and engine are config groups whose options extend a schema stored here from the registries
(`_schema_fp8`, `_schema_torch`, ...), so Hydra itself validates every key of the chosen option.
"""
from __future__ import annotations

from typing import Sequence

from quantlab.config import Config, calib_data_dir, conf_dir
from quantlab.engines.registry import ENGINE_SCHEMAS
from quantlab.errors import QuantlabError
from quantlab.precisions import PRECISION_SCHEMAS

_registered = False


def register_configs() -> None:
    """Register schemas and the calib_data/ recipes in Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name, schema in PRECISION_SCHEMAS.items():
        cs.store(group="precision", name=f"_schema_{name}", node=schema)
    for name, schema in ENGINE_SCHEMAS.items():
        cs.store(group="engine", name=f"_schema_{name}", node=schema)
    for recipe in sorted(calib_data_dir().glob("*.yaml")):
        cs.store(group="calib_data", name=recipe.stem, node=OmegaConf.load(recipe))
    _registered = True


def group_options(group: str) -> list[str]:
    """The options a config group offers (YAML files; schemas starting with _ are not options)."""
    if group == "calib_data":
        return sorted(p.stem for p in calib_data_dir().glob("*.yaml"))
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _given(overrides: Sequence[str], key: str) -> str | None:
    for arg in overrides:
        bare = arg.lstrip("+~")
        if bare.startswith(f"{key}="):
            return bare.split("=", 1)[1]
    return None


def implied(overrides: Sequence[str]) -> list[str]:
    """Group choices the command implies when it does not make them: a checkpoint made elsewhere
    (engine.checkpoint=DIR) says its own precision and KV cache format; the search evaluates mixed precision."""
    extra = []
    has_precision = _given(overrides, "precision") is not None
    checkpoint = _given(overrides, "engine.checkpoint")
    if checkpoint and not has_precision and _made_elsewhere(checkpoint):
        extra.append("precision=external")  # another tool's format (or a sweep over checkpoints): read from the files
    elif checkpoint and not has_precision:
        from pathlib import Path

        from quantlab.checkpoint import read_quant_config
        from quantlab.precisions import PRECISIONS

        quant = read_quant_config(Path(checkpoint).expanduser(), required=True)
        entry = PRECISIONS.find(lambda p: p.quant_algo == quant.quant_algo)
        if entry is None:
            raise QuantlabError(f"engine.checkpoint {checkpoint} is {quant.quant_algo}, which no quantlab precision "
                                f"reads", fix=f"precisions: {', '.join(PRECISIONS)}")
        extra.append(f"precision={entry.name}")
        if _given(overrides, "kv_cache") is None:
            extra.append(f"kv_cache={'fp8' if quant.kv_cache_quant_algo == 'FP8' else 'none'}")
    elif _given(overrides, "search") and not has_precision:
        extra.append("precision=mixed")
    return extra


def _made_elsewhere(checkpoint: str) -> bool:
    """Whether engine.checkpoint names something other than one ModelOpt export: a checkpoint of another tool
    (quantlab.formats), or several checkpoints swept with -m (A,B,C). An unknown layout is exit 2 here."""
    from pathlib import Path

    from quantlab.formats import detect

    if "," in checkpoint and not Path(checkpoint).expanduser().exists():
        return True
    return detect(Path(checkpoint).expanduser()).name != "modelopt"


def normalize(overrides: Sequence[str]) -> list[str]:
    """Spellings Hydra would refuse, made what the user meant:
    - `+precision=fp8` (the spelling the docs have always used) selects the group option like `precision=fp8`
      (precision is in the defaults list, so Hydra would refuse a second one);
    - `gate.thresholds.METRIC.max=V` adds or overrides a gate entry (`++`), whether or not the gate file has it."""
    out = []
    for arg in overrides:
        if arg.startswith("+precision=") or arg.startswith("++precision="):
            arg = arg.lstrip("+")
        elif arg.startswith(("gate.thresholds.", "gate.per_precision.")):
            arg = "++" + arg
        out.append(arg)
    return out


def compose(overrides: Sequence[str]) -> tuple[Config, dict]:
    """(typed Config, its plain snapshot) exactly as the CLI composes it, for the Python API and tests."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            dict_cfg = hydra_compose("config", overrides=normalize(list(overrides) + implied(overrides)))
        return OmegaConf.to_object(dict_cfg), OmegaConf.to_container(dict_cfg, resolve=False)
    except (HydraException, OmegaConfBaseException) as exc:
        raise QuantlabError(f"the configuration does not compose: {str(exc).splitlines()[0]}",
                            fix="check the overrides (python -m quantlab --help lists the groups)") from None
