"""export: the unified HF checkpoint ModelOpt writes (hf_quant_config.json + safetensors) = what ships.

The tokenizer is saved beside it so the directory is self-contained for an engine build. A checkpoint made
elsewhere (engine.checkpoint=...) takes this step's place, checked against the requested recipe.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from quantlab import costs
from quantlab.artifacts import Artifact, fingerprint_files, fingerprint_of
from quantlab.checkpoint import TOKENIZER_FILES, QuantConfig, read_quant_config
from quantlab.env import versions
from quantlab.errors import QuantlabError
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")


def info_of(quant: QuantConfig, ckpt: Path) -> dict:
    """The export's info: quant_algo, kv_cache_quant_algo, group_size and the bytes of its safetensors files."""
    return {"quant_algo": quant.quant_algo, "kv_cache_quant_algo": quant.kv_cache_quant_algo,
            "group_size": quant.group_size,
            "safetensors_bytes": sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))}


def write(model, ref_path: Path, out: Path, expect_algo: str, expect_kv: str | None) -> dict:
    """export_hf_checkpoint + the tokenizer files; the declared format must be the requested one."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    from quantlab import modelopt_compat

    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]
    adjusted = modelopt_compat.prepare_fused_experts(model) if modelopt_compat.has_fused_experts(model) else []
    log.info("export: writing the unified HF checkpoint")
    with torch.no_grad(), modelopt_compat.fused_experts_resmooth():
        export_hf_checkpoint(model, export_dir=str(out))
    for name in TOKENIZER_FILES:
        if (ref_path / name).is_file():
            shutil.copy2(ref_path / name, out / name)
    quant = read_quant_config(out, required=True)
    if quant.quant_algo != expect_algo or quant.kv_cache_quant_algo != expect_kv:
        raise RuntimeError(f"ModelOpt exported quant_algo={quant.quant_algo} kv={quant.kv_cache_quant_algo}, "
                           f"expected {expect_algo} / {expect_kv}")
    return {**info_of(quant, out), **_weight_bits(out), "experts_without_calibration_tokens": adjusted}


def _weight_bits(out: Path) -> dict:
    """Bits per weight of the export's quantized layers (scales included), counted from its files as for any other
    tool's checkpoint (quantlab.formats.describe), so the sweep summary compares them on one scale."""
    from quantlab.formats import open_checkpoint
    from quantlab.formats.describe import linear_shapes

    opened = open_checkpoint(out)
    return opened.weight_bits(linear_shapes(opened))


def external(path: str, expect_algo: str, expect_kv: str | None) -> Artifact:
    """A checkpoint made elsewhere (engine.checkpoint=...), checked against the requested recipe. expect_algo
    EXTERNAL (precision=external) takes any format quantlab reads (quantlab.formats) and its KV cache from the files
    (expect_kv None) or requires the one asked for; any other precision must match a ModelOpt export's quant_algo."""
    from quantlab.formats import open_checkpoint
    from quantlab.formats.describe import describe

    ckpt = Path(path).expanduser()
    if not ckpt.is_dir() and ckpt.suffix != ".gguf":
        raise QuantlabError(f"engine.checkpoint {ckpt} is not a directory" if ckpt.exists() else
                            f"engine.checkpoint {ckpt} does not exist",
                            fix="point engine.checkpoint at a checkpoint directory (or a .gguf file)")
    opened = open_checkpoint(ckpt)
    quant = opened.quant
    if expect_algo == "EXTERNAL":
        if expect_kv is not None and quant.kv_cache_quant_algo != expect_kv:
            raise QuantlabError(f"engine.checkpoint {ckpt} has KV cache {quant.kv_cache_quant_algo or 'none'}, the "
                                f"run asks for {expect_kv}",
                                fix="leave kv_cache at none with precision=external (the files say the KV cache)")
    elif opened.format != "modelopt":
        raise QuantlabError(f"engine.checkpoint {ckpt} is a {opened.format} checkpoint ({opened.scheme}), not a "
                            f"ModelOpt {expect_algo} export", fix="use precision=external (or leave precision out)")
    elif quant.quant_algo != expect_algo or quant.kv_cache_quant_algo != expect_kv:
        raise QuantlabError(f"engine.checkpoint {ckpt} is {quant.quant_algo} / kv {quant.kv_cache_quant_algo}, "
                            f"the run asks for {expect_algo} / kv {expect_kv}",
                            fix="choose the matching +precision= and kv_cache=")
    root = opened.directory
    members = [ckpt] if ckpt.is_file() else [p for p in ckpt.iterdir() if p.is_file()]
    files = fingerprint_files(root, members)
    info = {**info_of(quant, root), "safetensors_bytes": opened.size_bytes(), **describe(opened), "external": True}
    return Artifact("export", "external", ckpt, {"fingerprint": fingerprint_of(files), "files": files, "info": info})


# ------------------------------------------------------------------------------------------ the steps
def step(ctx: RunContext) -> Step:
    """Export of the calibrated model, keyed by the quantize step's key and the library versions (a cached
    export needs no calibrated state). Its value is the checkpoint Artifact."""
    def build(out: Path, r) -> dict:
        return write(r.value("quantize").take(), r.value("prepare").path, out, ctx.precision.quant_algo, ctx.kv_algo)

    def work(r) -> dict:
        from quantlab import first_run, prior
        from quantlab.stages.quantize import recipe_label

        shape, params, _ = first_run.model(r)
        return costs.work(costs.device_label(ctx.device), recipe_label(ctx), params,
                          units=shape and prior.export(shape, ctx.precision.weight_bits))

    # keyed by the calibration's key, not its files: a cached export needs no calibrated state on disk
    return Step("export", "export", lambda r: ctx.store.key("export", quantize=r.key("quantize"), versions=versions()),
                lambda art, r, built: art, build, needs=("quantize", "prepare"), work=work,
                manifest=lambda r: {"model": r.fingerprint("prepare"), "versions": versions()}, describe="export")


EMBEDDING_HINTS = ("embed_tokens.weight", "wte.weight", "embed_in.weight", "word_embeddings.weight")


def check_pairing(ckpt: Path, ref) -> None:
    """A checkpoint exported from another model must not be compared with this model's reference: config sizes and
    the input embedding (never quantized, never smoothed) must match the reference's exactly, up to the export's
    dtype."""
    import json

    import torch

    from quantlab.checkpoint import read_headers, tensor_index

    theirs = json.loads((ckpt / "config.json").read_text()) if (ckpt / "config.json").is_file() else {}
    for knob in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
                 "num_attention_heads"):
        if knob in theirs and knob in ref.config and theirs[knob] != ref.config[knob]:
            raise QuantlabError(f"engine.checkpoint {ckpt} was exported from another model: its config.json has "
                                f"{knob}={theirs[knob]}, the reference {ref.path} has {ref.config[knob]}",
                                fix="point model.path at the unquantized model the checkpoint was made from")
    exported, original = read_headers(ckpt), read_headers(ref.path)
    name = next((n for n in exported if n.endswith(EMBEDDING_HINTS) and n in original), None)
    if name is None:
        return
    a, b = tensor_index(ckpt)[name].get_tensor(name), tensor_index(ref.path)[name].get_tensor(name)
    if a.shape != b.shape or not torch.equal(a, b.to(a.dtype)):
        diff = ("shape differs" if a.shape != b.shape
                else f"max difference {float((a.float() - b.float()).abs().max()):.3g}")
        raise QuantlabError(f"engine.checkpoint {ckpt} was exported from another model: {name} differs from the "
                            f"reference's ({diff})",
                            fix="point model.path at the unquantized model the checkpoint was made from")


def external_step(ctx: RunContext) -> Step:
    """engine.checkpoint=...: the checkpoint made elsewhere as a source in the export's place. Loading it checks
    it against the requested recipe and the reference model: not a directory (or GGUF file), a layout no format of
    quantlab.formats reads, another quant_algo / kv_cache or another model is exit 2."""
    path = ctx.external_checkpoint

    def load(_art, r, _built) -> Artifact:
        from quantlab.formats import detect

        found = external(path, ctx.precision.quant_algo, ctx.kv_algo)
        entry = detect(found.path)
        if entry.pairing is None:
            check_pairing(found.path, r.value("prepare"))
        else:  # a format without the reference's tensors as they are (GGUF: its own names and types)
            from quantlab.formats import open_checkpoint

            entry.pairing(open_checkpoint(found.path), r.value("prepare"))
        log.info("export: evaluating the checkpoint made elsewhere, %s", found.path)
        return found

    return Step("export", "export", lambda r: r.value("export").fingerprint, load, source="external", cheap=True)
