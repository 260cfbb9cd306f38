"""The audit of one checkpoint: open it (refusing what cannot be audited at all), then each family of checks over
one AuditState, in order, each timed."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from quantlab import progress
from quantlab.audit import activations, coverage, declarations, head, index, metadata, scales, weights
from quantlab.audit import canary as canary_checks
from quantlab.audit import tensors as tensor_checks
from quantlab.audit import tokenizer as tokenizer_checks
from quantlab.audit.probe import run_probe
from quantlab.audit.report import CHECKS, INFO, SEVERITIES, AuditReport
from quantlab.audit.state import AuditState, read_json
from quantlab.checkpoint import CheckpointTensors, QuantConfig, read_quant_config
from quantlab.errors import QuantlabError
from quantlab.models import ModelRef


def _reference(reference) -> Any:
    """A ModelRef for the reference: given, or built from a directory with prepare's checks (a causal LM,
    unquantized, safetensors matching config.json, a tokenizer that loads)."""
    if reference is None or isinstance(reference, ModelRef):
        return reference
    path = Path(reference).expanduser()
    if not path.exists():
        raise QuantlabError(f"reference {path} does not exist",
                            fix="pass --reference the directory of the unquantized HF model the export was made from")
    return ModelRef.from_path(path)


def open_checkpoint(checkpoint: str | Path) -> tuple[Path, QuantConfig, dict, CheckpointTensors]:
    """(directory, hf_quant_config.json, config.json, tensors) of an export, or QuantlabError naming what makes it
    unusable: no such directory, no hf_quant_config.json or config.json, damaged JSON or safetensors headers, no
    safetensors file at all. The tensors are those vLLM / SGLang load (the index's shards that exist, each tensor
    from its first file); where loaders differ is the index check's finding, not a refusal. Nothing heavy is
    imported: bad input is refused in well under a second."""
    return _open(checkpoint)[:4]


def _open(checkpoint: str | Path) -> tuple[Path, QuantConfig, dict, CheckpointTensors, index.LoaderViews]:
    ckpt = Path(checkpoint).expanduser()
    if not ckpt.is_dir() and not (ckpt.is_file() and ckpt.suffix == ".gguf"):
        raise QuantlabError(f"checkpoint {ckpt} is not a directory" if ckpt.exists() else
                            f"checkpoint {ckpt} does not exist",
                            fix="pass the directory export_hf_checkpoint() wrote (hf_quant_config.json + safetensors)")
    from quantlab.audit.foreign import open_foreign

    foreign = open_foreign(ckpt)  # another tool's format (quantlab.formats); None for a ModelOpt export
    if foreign is not None:
        return ckpt, foreign.quant, foreign.config, foreign.tensors, None
    quant = read_quant_config(ckpt, required=True)
    config = read_json(ckpt / "config.json", "config")
    if config is None:
        raise QuantlabError(f"{ckpt} has no config.json, so no engine can build its model",
                            fix="point at the directory export_hf_checkpoint() wrote (it writes config.json)")
    views = index.loader_views(ckpt)
    return ckpt, quant, config, CheckpointTensors(ckpt, views.served, first_wins=True), views


def audit(checkpoint: str | Path, reference=None, canary: bool = True, *, canary_windows: int = 2,
          canary_tokens: int = 128, device=None, dtype=None, prefix_token="auto") -> AuditReport:
    """Audit an exported checkpoint (a directory with hf_quant_config.json, config.json and safetensors) against
    its unquantized reference (a directory or a quantlab ModelRef; None skips the checks that need it). The
    canary (needs the reference) runs on `device` (default: cuda if present, else cpu) in `dtype` (default: the
    device's: float32 on CPU; `device` may be a quantlab Device or a spec such as "cpu"); its windows start with
    prefix_token (auto: what the model expects, quantlab.conventions; bos | eos | none). Raises QuantlabError when
    the input cannot be audited at all."""
    from quantlab.env import resolve_device, resolve_dtype

    start, cpu_start = time.time(), time.process_time()
    if canary_windows < 1 or canary_tokens < 2:
        raise QuantlabError(f"a canary of {canary_windows} window(s) x {canary_tokens} token(s) is empty",
                            fix="use at least 1 window of 2 tokens, or turn the canary off")
    from quantlab.audit import foreign

    path = Path(checkpoint).expanduser()
    opened = foreign.open_foreign(path) if path.exists() else None  # another tool's format (quantlab.formats)
    if opened is None:
        ckpt, quant, config, tensors, views = _open(checkpoint)
    else:
        ckpt, quant, config, tensors, views = opened.path, opened.quant, opened.config, opened.tensors, None
    ref = _reference(reference)
    device = resolve_device(device or "auto") if device is None or isinstance(device, str) else device
    dtype = dtype or resolve_dtype("auto", device)
    timings: dict[str, float] = {"setup": 0.0}
    if opened is not None:  # another tool's format: its own checks where its tensors differ (quantlab.audit.foreign)
        run = foreign.ForeignAuditState(opened, ref, device, dtype)
        run.prefix_token = prefix_token
        steps = foreign.steps()
    else:
        run = AuditState(ckpt, quant, config, tensors, ref, device, dtype, views)
        run.prefix_token = prefix_token
        steps = [("index", index.check_index), ("declarations", declarations.check_declarations),
                 ("metadata", metadata.check_metadata), ("tokenizer", tokenizer_checks.check_tokenizer),
                 ("coverage", coverage.check_coverage), ("head", head.check_head), ("scales", scales.check_scales),
                 ("kv_cache", scales.check_kv_cache)]
        if ref is not None:  # one short reference forward: activations, norm -> Linear relation, the canary's logits
            steps.append(("probe", lambda a: setattr(a, "probe", run_probe(  # on the canary's windows: one forward
                a, canary_windows, canary_tokens, activations.input_specs(a), activations.kv_specs(a)))))
        steps += [("format_weights", weights.check_layers), ("activations", activations.check_activations),
                  ("tensors", tensor_checks.check_tensors)]
    timings["setup"] = round(time.time() - start, 3)
    cpu = {"setup": round(time.process_time() - cpu_start, 3)}
    if canary and ref is not None:
        steps.append(("canary", lambda a: canary_checks.check_canary(a, canary_windows, canary_tokens)))
    elif canary:
        run.skipped.append("canary: needs the reference model (--reference)")
    else:
        run.skipped.append("canary: turned off")
    for i, (name, fn) in enumerate(steps, 1):
        progress.note(f"{name} ({i}/{len(steps)})")
        t0, c0 = time.time(), time.process_time()
        fn(run)
        timings[name] = round(time.time() - t0, 3)
        cpu[name] = round(time.process_time() - c0, 3)
    if ref is None:
        run.add(INFO, "weights", [], "no reference model given: dequantized weights, dropped tensors against the "
                "reference, tokenizer / config changes and the logits canary were not checked",
                "pass --reference MODEL_DIR (the unquantized model the export was made from) to check them")
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings = sorted(run.findings, key=lambda f: (order[f.severity], CHECKS.index(f.check)))
    timings["total"] = round(time.time() - start, 3)
    cpu["total"] = round(time.process_time() - cpu_start, 3)
    return AuditReport(str(ckpt), str(ref.path) if ref else None, quant.quant_algo, quant.kv_cache_quant_algo,
                       findings, timings, run.layers, run.activations, run.canary, run.skipped, cpu)
