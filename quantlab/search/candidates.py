"""A candidate made real: exported from the calibrated model (a cached artifact), evaluated like any run (the normal
pipeline with engine.checkpoint, the search's one quality bar), and measured on disk (the bits it stores). What the
pipeline returns (quantlab.rundir.RunResult) becomes a GateResult: metrics.json's document, or, when the checkpoint
audit stopped the evaluation, no document and the audit's errors (the candidate fails, unevaluated).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

from quantlab.artifacts import Built
from quantlab.config import Config, KvCacheConfig
from quantlab.precisions import PRECISION_SCHEMAS, precision_by_algo
from quantlab.rundir import RunResult
from quantlab.search.frontier import Candidate, Evaluation, GateResult, Group
from quantlab.search.sensitivity import SEARCH_VERSION, Sensitivity


def export_candidate(sens: Sensitivity, cand: Candidate, kv: str) -> Path:
    """A candidate's export: a cached artifact keyed by the sensitivity, the assignment and the KV format.

    Args:
        sens: the sensitivity (scores loaded) whose calibrated model is exported.
        cand: the configuration.
        kv: the KV cache format (none | fp8).

    Returns:
        The export's directory (a unified HF checkpoint).
    """
    assignment = {g.leader: cand.assignment[g.leader] for g in sens.groups}
    digest = hashlib.sha256(json.dumps([assignment, kv], sort_keys=True).encode()).hexdigest()[:16]
    store = sens.ctx.store
    key = store.key("export", search=sens.key(), assignment=digest, kv=kv, version=SEARCH_VERSION)
    art, _ = store.get_or_build("export", key, lambda out: Built(sens.export(cand, kv, out)),
                                {"search": sens.key(), "label": cand.label}, describe=f"export {cand.label}")
    return art.path


def evaluate_candidate(cfg: Config, sens: Sensitivity, cand: Candidate, kv: str, run_dir: Path,
                       argv: list[str]) -> Evaluation:
    """Export a candidate (export_candidate) and evaluate the checkpoint like any run, into run_dir/evals/<label>.

    Args:
        cfg: the search's config (its engine, data and gate; search.* is dropped for the evaluation).
        sens: the sensitivity whose calibrated model is exported.
        cand: the configuration.
        kv: the KV cache format (none | fp8).
        run_dir: the search's run directory.
        argv: the search's overrides (for each evaluation's reproduce command).

    Returns:
        The evaluation: its gate result and the bits the export stores, measured.
    """
    path = export_candidate(sens, cand, kv)
    label = cand.label + ("" if kv == "none" else f" kv={kv}")
    result = evaluate_export(cfg, path, kv, run_dir / "evals" / _slug(label), argv)
    bits = round(stored_bits(path, sens.groups, sens.fixed_modules, sens.fixed_params), 4)
    return Evaluation(label, cand, kv, str(path), result, stored_bits=bits)


def evaluate_export(cfg: Config, path: Path, kv: str, run_dir: Path, argv: list[str]) -> GateResult:
    """One full gate evaluation of an exported checkpoint: the normal pipeline with engine.checkpoint, the base
    thresholds for every format (gate.per_precision off: one bar).

    Returns:
        The gate result read from the pipeline's RunResult (gate_result).
    """
    from quantlab.checkpoint import read_quant_config
    from quantlab.pipeline import run_pipeline

    quant = read_quant_config(path, required=True)
    precision = precision_by_algo(quant.quant_algo)
    evaluation = cfg.eval if generations_gated(cfg) else dataclasses.replace(cfg.eval, gen_prompts=0)
    sub = dataclasses.replace(cfg, precision=PRECISION_SCHEMAS[precision.name](),
                              kv_cache=KvCacheConfig(kv), engine=dataclasses.replace(cfg.engine, checkpoint=str(path)),
                              gate=dataclasses.replace(cfg.gate, per_precision={}), search=None, eval=evaluation)
    result = run_pipeline(sub, run_dir.resolve(), dataclasses.asdict(sub), reproduce_argv(argv, path))
    return gate_result(result, run_dir, path)


def gate_result(result: RunResult, run_dir: Path, path: Path) -> GateResult:
    """What the search keeps of an evaluation's RunResult: the exit code and metrics.json's document, or, when the
    checkpoint audit stopped the run (no document, the audit in run.json's record), the audit's errors: the
    candidate fails unevaluated.

    Args:
        result: what run_pipeline returned.
        run_dir: the evaluation's directory as the search names it.
        path: the evaluated export (for the error message).

    Raises:
        RuntimeError: the run left neither a metrics document nor an audit that stopped it (a bug of ours).
    """
    from quantlab.audit import AuditReport, Finding

    if result.doc is not None:
        return GateResult(result.exit_code, str(run_dir), result.doc)
    audit = (result.record or {}).get("audit")
    if audit is None or audit["passed"]:
        raise RuntimeError(f"the evaluation of {path} left no metrics document (exit {result.exit_code})")
    report = AuditReport(str(path), None, None, None, [Finding.from_dict(f) for f in audit["findings"]])
    return GateResult(result.exit_code, str(run_dir), None, [f"[{f.check}] {f.message}" for f in report.errors])


def stored_bits(ckpt: Path, groups: list[Group], fixed_modules: list[str], fixed_params: int = 0) -> float:
    """Bits per weight the checkpoint actually stores for the searched linear layers and lm_head: every tensor of
    those modules (codes, scales, pre-quant scales), unquantized weights counted at 16 bits (the deployment dtype;
    a CPU export writes float32). A head tied to the embeddings is stored once, as the embedding: it counts at 16
    bits here as in the prediction (fixed_params)."""
    from quantlab.checkpoint import tensor_index

    index = tensor_index(ckpt)
    modules = {m for g in groups for m in g.modules} | set(fixed_modules)
    bits = weights = fixed_seen = 0
    for name, handle in index.items():
        owner = name.rsplit(".", 1)[0]
        if owner not in modules:
            continue
        sl = handle.get_slice(name)
        numel = math.prod(sl.get_shape())
        dtype = sl.get_dtype()
        # floating tensors (unquantized weights and every scale) at the deployment dtype's 16 bits: a CPU export
        # writes float32, a GPU one bfloat16, and the count must not depend on where the export ran
        width = {"F32": 16, "F16": 16, "BF16": 16, "F8_E4M3": 8, "U8": 8, "I8": 8}.get(dtype, 32)
        if name.endswith(".weight"):
            weights += numel * (2 if dtype == "U8" else 1)  # int4 codes: two per byte
            if owner in fixed_modules:
                fixed_seen += numel
        bits += numel * width
    missing = max(fixed_params - fixed_seen, 0)  # a tied head, not stored under its own name
    bits += 16 * missing
    weights += missing
    return bits / weights if weights else float("nan")


def generations_gated(cfg: Config) -> bool:
    """Whether a gate threshold uses the greedy generations. When none does, candidates are evaluated without them
    (the verdict does not depend on them; on a CPU they cost ~20 s per evaluation); the winner's reproduce command
    runs them."""
    return any(name.startswith("gen_") for name in cfg.gate.thresholds)


def reproduce_argv(argv: list[str], checkpoint: Path) -> list[str]:
    """The overrides that re-run one evaluation as a normal run: the search's own options and its run directory
    dropped, the checkpoint and its precision named, the one quality bar of the search (per-precision thresholds
    off) kept."""
    from quantlab.checkpoint import read_quant_config

    drop = ("search", "engine.checkpoint=", "gate.per_precision", "precision=", "precision.", "hydra.run.dir=",
            "hydra.sweep.dir=")
    keep = [a for a in argv if not a.lstrip("+~").startswith(drop)]
    precision = precision_by_algo(read_quant_config(checkpoint, required=True).quant_algo).name
    return [*keep, f"precision={precision}", f"engine.checkpoint={checkpoint}", "gate.per_precision={}"]


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
