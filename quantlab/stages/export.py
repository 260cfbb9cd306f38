"""export: the unified HF checkpoint ModelOpt writes (hf_quant_config.json + safetensors) = what ships.

The tokenizer is saved beside it so the directory is self-contained for an engine build.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from quantlab.artifacts import Artifact, ArtifactStore, fingerprint_files, fingerprint_of
from quantlab.env import versions
from quantlab.errors import QuantlabError
from quantlab.stages.prepare import TOKENIZER_FILES, ModelRef

log = logging.getLogger("quantlab")


def key(store: ArtifactStore, quantize_key: str) -> str:
    return store.key("export", quantize=quantize_key, versions=versions())


def read_quant_config(ckpt: Path) -> dict:
    cfg_file = ckpt / "hf_quant_config.json"
    return json.loads(cfg_file.read_text())["quantization"] if cfg_file.is_file() else {}


def run(store: ArtifactStore, ekey: str, get_model, ref: ModelRef, expect_algo: str, expect_kv: str | None,
        cost: dict | None = None) -> Artifact:
    """get_model() returns the calibrated fake-quant model; it is called only when the export is not cached."""

    def build(out: Path) -> dict:
        import torch
        from modelopt.torch.export import export_hf_checkpoint

        start = time.time()
        model = get_model()
        upstream = time.time() - start
        if not model.config.architectures:
            model.config.architectures = [type(model).__name__]
        log.info("export: writing the unified HF checkpoint")
        with torch.no_grad():
            export_hf_checkpoint(model, export_dir=str(out))
        for name in TOKENIZER_FILES:
            if (ref.path / name).is_file():
                shutil.copy2(ref.path / name, out / name)
        quant = read_quant_config(out)
        if quant.get("quant_algo") != expect_algo or quant.get("kv_cache_quant_algo") != expect_kv:
            raise RuntimeError(f"ModelOpt exported quant_algo={quant.get('quant_algo')} kv={quant.get('kv_cache_quant_algo')}, "
                               f"expected {expect_algo} / {expect_kv}")
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        return {"quant_algo": quant["quant_algo"], "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
                "group_size": quant.get("group_size"), "safetensors_bytes": size,
                "upstream_seconds": round(upstream, 3)}

    return store.get_or_build("export", ekey, build, {"model": ref.fingerprint, "versions": versions()},
                              describe="export", cost=cost)


def external(path: str, expect_algo: str, expect_kv: str | None) -> Artifact:
    """A checkpoint exported elsewhere (engine.checkpoint=...), checked against the requested recipe."""
    ckpt = Path(path).expanduser()
    if not (ckpt / "hf_quant_config.json").is_file():
        raise QuantlabError(f"engine.checkpoint {ckpt} has no hf_quant_config.json, so it is not a ModelOpt export",
                            fix="point engine.checkpoint at the directory export_hf_checkpoint() wrote")
    try:
        quant = read_quant_config(ckpt)
    except (ValueError, KeyError) as exc:
        raise QuantlabError(f"{ckpt}/hf_quant_config.json is unreadable ({exc})") from None
    if quant.get("quant_algo") != expect_algo or quant.get("kv_cache_quant_algo") != expect_kv:
        raise QuantlabError(f"engine.checkpoint {ckpt} is {quant.get('quant_algo')} / kv {quant.get('kv_cache_quant_algo')}, "
                            f"the run asks for {expect_algo} / kv {expect_kv}",
                            fix="choose the matching +precision= and kv_cache=")
    files = fingerprint_files(ckpt, [p for p in ckpt.iterdir() if p.is_file()])
    info = {"quant_algo": quant["quant_algo"], "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
            "group_size": quant.get("group_size"), "external": True,
            "safetensors_bytes": sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))}
    return Artifact("export", "external", ckpt, {"fingerprint": fingerprint_of(files), "files": files, "info": info})
