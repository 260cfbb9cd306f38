"""The run, top to bottom: check the request, execute the run graph's steps, gate, report.

The shape of the run (which steps, what each needs, how each is keyed) is declared in quantlab.graph; this module
only interprets it and writes the run directory.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from quantlab import preflight
from quantlab.artifacts import ArtifactStore, write_json_atomic
from quantlab.config import Config
from quantlab.env import git_commit, resolve_device, resolve_dtype, versions
from quantlab.errors import EXIT_GATE_FAILED, EXIT_OK
from quantlab.gate import checks as gate_checks
from quantlab.graph import Executor, steps_for, targets
from quantlab.stages import build, evaluate
from quantlab.step import RunContext

log = logging.getLogger("quantlab")
REPORT_FILES = ("metrics.json", "report.md", "report.html", "junit.xml", "run.json", "checkpoint", "traceback.txt",
                "audit.json")


def context(cfg: Config) -> RunContext:
    """Config checks, the store and the device: everything decided before any model is touched."""
    preflight.check_config(cfg)
    store = ArtifactStore(cfg.cache_dir)
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    preflight.check_device(cfg, device)
    return RunContext(cfg, store, device, dtype)


def set_aside_previous(run_dir: Path) -> None:
    """A rerun into the directory of an earlier run (a fixed hydra.run.dir in CI) must not leave that run's
    verdict beside its own: earlier reports move to previous/<time>/, nothing is deleted."""
    old = [run_dir / n for n in REPORT_FILES if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if not old:
        return
    dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir(parents=True)
    for path in old:
        shutil.move(str(path), str(dest / path.name))
    log.info("moved the reports of an earlier run in %s to %s", run_dir, dest)


def run_pipeline(cfg: Config, run_dir: Path, config_snapshot: dict, argv: list[str]) -> int:
    start = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    set_aside_previous(run_dir)
    record: dict = {"argv": argv, "config": config_snapshot, "versions": versions(), "git_commit": git_commit()}
    ctx = context(cfg)
    record["device"] = ctx.device.describe()
    log.info("quantlab %s kv=%s engine=%s on %s (%s, %s), cache %s", ctx.precision.name, cfg.kv_cache.dtype,
             ctx.engine.name, ctx.device.name, ctx.device.arch, str(ctx.dtype).removeprefix("torch."), ctx.store.root)
    steps = steps_for(ctx)
    run = Executor(ctx, steps)
    try:
        return _execute(ctx, run, steps, record, run_dir, config_snapshot, argv, start)
    finally:
        record["stage_seconds"] = run.seconds


def _execute(ctx: RunContext, run: Executor, steps, record: dict, run_dir: Path, snapshot: dict, argv: list[str],
             start: float) -> int:
    cfg = ctx.cfg
    # ---- inputs, and every check that needs them, before any compute
    ref = run.value("prepare")
    record["model"] = ref.describe()
    preflight.check_family(cfg, ref, ctx)
    preflight.check_lengths(cfg, ref.max_positions)
    limits = build.limits(run)
    limits.check(cfg.eval.batch_size, cfg.eval.seq_len)
    if cfg.eval.gen_prompts and cfg.eval.gen_tokens:
        limits.check(min(cfg.eval.gen_prompts, cfg.eval.batch_size), cfg.eval.gen_prompt_len, cfg.eval.gen_tokens)
    record["engine"] = {"name": ctx.engine.name, "limits": limits.describe()}
    calib, evalset = run.value("data:calib"), run.value("data:eval")
    record["data"] = {"calib": {"fingerprint": calib.fingerprint, **calib.info},
                      "eval": {"fingerprint": evalset.fingerprint, **evalset.info}}
    provenance = {"model_fingerprint": ref.fingerprint, "eval_fingerprint": evalset.fingerprint,
                  "calib_fingerprint": calib.fingerprint, "versions": versions(), "git_commit": git_commit(),
                  "device": ctx.device.describe(), "dtype": str(ctx.dtype).removeprefix("torch."), "config": snapshot,
                  "argv": argv}
    if cfg.gate.baseline:
        gate_checks.load_baseline(cfg.gate.baseline, provenance)  # refuse a mismatched baseline before any compute
    if run.has("quantize"):
        from quantlab.stages.quantize import request

        record["recipe"] = request(run).recipe  # an impossible block size fails here, before calibration

    # ---- the checkpoint's audit: seconds, before any evaluation; an error stops the run (exit 1)
    if run.has("audit"):
        report = run.value("audit")
        record["audit"] = audit_record(report)
        if not report.passed:
            record["artifacts"] = _artifacts(run)
            _link(run_dir / "checkpoint", run.values["export"].path)
            write_audit_reports(run_dir, report, ref.name, ctx.precision.name, cfg.kv_cache.dtype)
            first = report.errors[0]
            return _finish(record, run_dir, run, start, EXIT_GATE_FAILED,
                           f"the checkpoint audit found {len(report.errors)} error(s), first [{first.check}] "
                           f"{first.message}; nothing was evaluated (details in {run_dir / 'report.md'})")

    # ---- the graph's targets (each builds what it needs, once)
    run.run(targets(steps))
    record["artifacts"] = _artifacts(run)
    if "export" in run.values:
        _link(run_dir / "checkpoint", run.values["export"].path)
    if cfg.stop_after:
        what = f"stopped after {cfg.stop_after}"
        if cfg.stop_after == "export":
            what = f"exported {run.values['export'].info['quant_algo']} checkpoint"
        return _finish(record, run_dir, run, start, EXIT_OK, what)

    # ---- gate + report
    results = {name: run.value(f"evaluate:{name}") for name in ctx.candidates()}
    result = results[ctx.engine.name]
    attribution = evaluate.attribution(results, ctx.engine.name) if len(results) > 1 else None
    thresholds = gate_checks.thresholds_for(cfg.gate, ctx.precision.name, cfg.eval.seq_len)
    verdict = gate_checks.verdict(cfg.gate, thresholds, result.checks, result.design, result.look, result.windows,
                           result.metrics, provenance)
    used = result.design.looks[result.look]
    run_info = {"precision": ctx.precision.name, "kv_cache": cfg.kv_cache.dtype, "engine": ctx.engine.name,
                "model": ref.name, "recipe": record.get("recipe"), "run_dir": str(run_dir),
                "eval": {"windows": used, "windows_available": evalset.num_windows, "cap": result.design.cap,
                         "seq_len": evalset.seq_len, "source": evalset.info["source"],
                         "tokens": used * evalset.seq_len, "kl": "exact over the full vocabulary (reference logits "
                                                                "recomputed from its cached final hidden states)"},
                "checkpoint": record["artifacts"].get("export"), "family": ref.family,
                "experts": _expert_coverage(record["artifacts"].get("quantize")),
                "audit": record.get("audit"),
                "reference_forward_batches": run.values["reference"].forward_batches,
                "candidate_forward_batches": result.forward_batches}
    from quantlab.report import documents
    from quantlab.report.render import write_run_reports

    doc = documents.metrics_document(run_info, result, verdict, provenance, attribution)
    run.values["reference"].close()
    ckpt = run.values["export"].path if "export" in run.values else None
    doc["weight_error"] = write_run_reports(run_dir, doc, result.kl_values, ckpt, ref.path)
    documents.write_metrics(run_dir, doc)
    documents.write_junit(run_dir, doc)
    print(documents.console_table(doc))
    code = EXIT_OK if verdict["passed"] else EXIT_GATE_FAILED
    m = result.metrics
    what = (f"{ctx.precision.name} kv={cfg.kv_cache.dtype} on {ref.name}: {'PASS' if verdict['passed'] else 'FAIL'} "
            f"(top-1 {m['top1_agreement']['value']:.3f}, ppl ratio {m['ppl_ratio']['value']:.3f}, "
            f"KL {m['kl_mean']['value']:.4f})")
    return _finish(record, run_dir, run, start, code, what)


def _expert_coverage(quantize: dict | None) -> dict | None:
    """Per-expert calibration token counts of an MoE model (None for dense models or a reused export)."""
    if not quantize or not quantize.get("expert_tokens"):
        return None
    return {"tokens": quantize["expert_tokens"], "below_min_tokens": quantize.get("experts_below_min_tokens", {})}


def _artifacts(run: Executor) -> dict:
    out = {}
    for name in ("prepare", "quantize", "export"):
        if name not in run.values:
            continue
        value, art = run.values[name], run.artifacts.get(name)
        entry = {"path": str(getattr(art, "path", None) or value.path), "fingerprint": run.fingerprint(name)}
        entry.update(art.info if art is not None else getattr(value, "info", {}) or {})
        out[name] = entry
    return out


def _link(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def audit_record(report) -> dict:
    """What run.json and metrics.json keep of the audit: verdict, counts, the error and warning findings."""
    return {"passed": report.passed, "counts": report.summary(), "seconds": report.timings.get("total"),
            "canary": report.canary, "findings": [f.to_dict() for f in report.findings if f.severity != "info"]}


def write_audit_reports(run_dir: Path, report, model: str, precision: str, kv: str) -> None:
    """A run stopped by its checkpoint's audit: audit.json, report.md / report.html with the findings, and a
    junit.xml with one failing test case per error (a CI reads the same verdict as the exit code)."""
    import xml.etree.ElementTree as ET

    from quantlab.artifacts import write_text_atomic
    from quantlab.report.render import environment

    write_json_atomic(run_dir / "audit.json", report.to_dict())
    ctx = {"report": report.to_dict(), "model": model, "precision": precision, "kv": kv,
           "errors": [f.to_dict() for f in report.errors], "warnings": [f.to_dict() for f in report.warnings]}
    env = environment()
    write_text_atomic(run_dir / "report.md", env.get_template("audit.md.j2").render(ctx))
    write_text_atomic(run_dir / "report.html", env.get_template("audit.html.j2").render(ctx))
    name = f"quantlab.{precision}.kv-{kv}.audit"
    suite = ET.Element("testsuite", name=name, tests=str(len(report.errors)), failures=str(len(report.errors)),
                       errors="0")
    for f in report.errors:
        case = ET.SubElement(suite, "testcase", classname=name, name=f"audit.{f.check}")
        failure = ET.SubElement(case, "failure", message=f.message, type="audit")
        failure.text = f"modules: {', '.join(f.modules)}\n{f.cause}"
    root = ET.Element("testsuites")
    root.append(suite)
    write_text_atomic(run_dir / "junit.xml", ET.tostring(root, encoding="unicode", xml_declaration=True))


def _finish(record: dict, run_dir: Path, run: Executor, start: float, code: int, what: str) -> int:
    record["stage_seconds"] = run.seconds
    record["events"] = [{"stage": s, "key": k, "action": a} for s, k, a in run.store.events]
    record["wall_time_s"] = round(time.time() - start, 2)
    record["exit_code"] = code
    write_json_atomic(run_dir / "run.json", record)
    print(f"quantlab: {what} in {record['wall_time_s']:.1f} s -> {run_dir}")
    return code
