"""The run, top to bottom: check the request, execute the run graph's steps, gate, report.

The shape of the run (which steps, what each needs, how each is keyed) is declared in quantlab.graph; this module
only interprets it and writes the run directory.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from quantlab import costs, preflight, progress, rundir
from quantlab.artifacts import ArtifactStore
from quantlab.config import Config
from quantlab.engines.registry import check_kernel_names
from quantlab.env import git_commit, resolve_device, resolve_dtype, versions
from quantlab.errors import EXIT_GATE_FAILED, EXIT_OK, QuantlabError
from quantlab.gate import checks as gate_checks
from quantlab.graph import Executor, steps_for, targets
from quantlab.rundir import RunResult, finish, set_aside_previous
from quantlab.stages import build, evaluate
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")


def context(cfg: Config) -> RunContext:
    """Config checks, the store and the device: everything decided before any model is touched."""
    preflight.check_config(cfg)
    kernels = getattr(cfg.engine, "kernels", None)
    if kernels is not None:  # engine.kernels (also a list changed after the config was built) and the environment
        check_kernel_names(kernels.disabled, "engine.kernels.disabled")
        kernels.resolved()
    store = ArtifactStore(cfg.cache_dir)
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    preflight.check_device(cfg, device)
    return RunContext(cfg, store, device, dtype)


def run_pipeline(cfg: Config, run_dir: Path, config_snapshot: dict, argv: list[str]) -> RunResult:
    """Run one configuration into run_dir: every check before compute, the steps the run needs, the checkpoint's
    audit, the gate and the reports. Bad input raises QuantlabError (exit 2) before anything is computed."""
    start = time.time()
    preflight.check_config(cfg)  # bad config: exit 2 before anything in run_dir is moved or written
    run_dir.mkdir(parents=True, exist_ok=True)
    set_aside_previous(run_dir)
    record: dict = {"run": _what_runs(cfg), "argv": argv, "config": config_snapshot, "versions": versions(),
                    "git_commit": git_commit()}
    rundir.start(run_dir, record)  # a run stopped by bad input, a crash or Ctrl-C still says what it was
    with progress.run_logging(run_dir) as runlog:
        record["log"] = str(runlog.path)
        try:
            ctx = context(cfg)
            record["device"] = ctx.device.describe()
            log.info("quantlab %s kv=%s engine=%s on %s (%s, %s), cache %s", ctx.precision.name, cfg.kv_cache.dtype,
                     ctx.engine.name, ctx.device.name, ctx.device.arch, str(ctx.dtype).removeprefix("torch."),
                     ctx.store.root)
            run = _Run(ctx, run_dir, record, start, config_snapshot, argv)
            run.runlog = runlog
            try:
                return run.execute()
            finally:
                record["stage_seconds"] = run.executor.seconds
        except BaseException as exc:
            rundir.stopped(run_dir, exc)  # run.json says why (bad input, a bug, Ctrl-C); the caller reports it
            raise


def _what_runs(cfg: Config) -> dict:
    """run.json's "run" section from the typed config, before anything is computed (the model's name is set once
    it is resolved; until then its path, or the embedded file)."""
    from quantlab.engines.registry import engine_of
    from quantlab.precisions import precision_of

    model = cfg.model.path or (cfg.model.embedded.file if cfg.model.embedded else None)
    return rundir.what_ran(precision_of(cfg.precision).name, cfg.kv_cache.dtype, engine_of(cfg.engine).name, model)


class _Run:
    """One configuration being run: the executor of its steps, run.json's record and the provenance of its
    documents."""

    def __init__(self, ctx: RunContext, run_dir: Path, record: dict, start: float, snapshot: dict, argv: list[str]):
        self.ctx, self.cfg, self.run_dir, self.record, self.start = ctx, ctx.cfg, run_dir, record, start
        self.snapshot, self.argv = snapshot, argv
        self.steps = [self.reported(s) for s in steps_for(ctx)]
        self.executor = Executor(ctx, self.steps)
        self.provenance: dict = {}
        self.audit_failed: str | None = None  # audit_errors=evaluate and the audit found an error: why it FAILs
        self.data_warnings: list[str] = []  # what the evaluation text makes of the verdict (calibration overlap)
        self.runlog: progress.RunLog | None = None
        self._history: list[dict] | None = None
        self.planned: dict[str, dict] = {}  # step -> the seconds predicted as its build started, and from what
        self._speed: dict | None = None  # this machine's speed (quantlab.prior), measured once per process
        self.steps_by_name = {s.name: s for s in self.steps}

    def reported(self, step: Step) -> Step:
        """The step with its build reported by quantlab.progress (label, ETA from earlier builds or the cost model)
        and what libraries print while it builds or loads sent to the run's log."""
        def build(out, r, _build=step.build):
            expected, basis, priced = self.expected(step, r)
            self.planned[step.name] = {"planned_s": None if expected is None else round(expected, 2),
                                       "basis": basis or "nothing predicts it (no earlier build, no cost model)",
                                       **priced}
            with progress.library_output(), progress.task(step.describe or step.name, expected=expected,
                                                          basis=basis, separate=True):
                value = _build(out, r)
            if expected is not None:
                self.planned[step.name].update(self.read_priced(step, r, value, "priced_reference" in priced))
            return value

        def load(art, r, built, _load=step.load):
            with progress.library_output():
                return _load(art, r, built)

        return dataclasses.replace(step, build=build if step.build is not None else None, load=load)

    def expected(self, step: Step, r, tokens: int | None = None,
                 with_reference: bool | None = None) -> tuple[float | None, str, dict]:
        """A step's a-priori seconds (quantlab.costs over the cost records of earlier builds), where it comes from,
        and for a figure of the cost model alone what it priced (run.json's plan: "priced", and "priced_reference"
        for an evaluation that also builds the reference's outputs), so a plan can be refitted from run.json;
        (None, "", {}) when nothing predicts it. tokens: an evaluation's at that many tokens instead of a passing
        run's, the reference's included when with_reference (else when it is not cached)."""
        if step.work is None:
            return None, "", {}
        try:
            if self._history is None:
                self._history = costs.history(self.ctx.store)
                self._speed = costs.machine_speed(self.ctx.store.root, self.ctx.device, self.ctx.dtype)
            work = step.work(r) if tokens is None else step.work(r, tokens=tokens)
            priced = {"priced": _priced(work)}
            est = costs.estimate(self._history, step.directory, work, speed=self._speed)
            if with_reference is None:
                with_reference = step.name == f"evaluate:{self.ctx.engine.name}" and not self._reference_cached(r)
            if est.known and with_reference:
                reference = self.steps_by_name["reference"]  # the evaluation builds the reference's outputs lazily
                ref_work = reference.work(r) if tokens is None else reference.work(r, tokens=tokens)
                if _priced(ref_work):
                    priced["priced_reference"] = _priced(ref_work)
                ref = costs.estimate(self._history, reference.directory, ref_work, speed=self._speed)
                est = costs.Estimate(est.seconds + ref.seconds, est.basis, est.rough or ref.rough) if ref.known \
                    else costs.Estimate(None, ref.basis)
        except Exception:  # noqa: BLE001 - an estimate is advice; never fail a step over it
            return None, "", {}
        if not est.known:
            return None, "", {}
        if est.apriori:
            return est.seconds, "a-priori, from the model's size and this machine's speed", priced
        return est.seconds, ("from other builds and the cost model" if est.rough
                             else "from earlier builds on this machine"), {}

    def read_priced(self, step: Step, r, value, with_reference: bool) -> dict:
        """For an evaluation that read other windows than the plan priced (a gate decided early, or read on to the
        cap): the same estimate at the windows it read, which is what its time is compared with ({} otherwise).
        The plan prices a passing run's windows before it can know where the gate stops."""
        design = getattr(value, "design", None)
        if design is None or not getattr(design, "looks", None):
            return {}
        try:
            windows = int(design.looks[value.look])
            tokens = windows * self.cfg.eval.seq_len
            if tokens == step.work(r).get("size"):
                return {}
            seconds, _, _ = self.expected(step, r, tokens=tokens, with_reference=with_reference)
        except Exception:  # noqa: BLE001 - advice only, as expected()
            return {}
        return {} if seconds is None else {"windows_read": windows, "planned_read_s": round(seconds, 2)}

    def _reference_cached(self, r) -> bool:
        """Whether the reference's first block of outputs is in the store (else the evaluation computes it)."""
        outputs = r.value("reference")
        return self.ctx.store.load("reference", outputs.block_key(0), verify=False) is not None

    def execute(self) -> RunResult:
        ref = self.inputs()
        if self.executor.has("audit"):  # seconds, before any evaluation; an error stops the run (exit 1)
            report = self.executor.value("audit")
            self.record["audit"] = audit_record(report)
            for finding in report.errors + report.warnings:  # one line each, whether audited now or reused
                (log.error if finding.severity == "error" else log.warning)(
                    "audit: %s [%s] %s", finding.severity, finding.check, finding.message)
            if not report.passed and self.cfg.audit_errors == "stop":
                return self.audit_stopped(report, ref)
            if not report.passed:  # audit_errors=evaluate: what the broken export does, never a PASS
                first = report.errors[0]
                self.audit_failed = (f"the checkpoint audit found {len(report.errors)} error(s), first "
                                     f"[{first.check}] {first.message}: FAIL whatever the gate says "
                                     f"(audit_errors=evaluate evaluated it anyway)")
                log.warning("warning: %s", self.audit_failed)
        run = self.executor
        run.run(targets(self.steps))  # the graph's targets (each builds what it needs, once)
        self.record["artifacts"] = _artifacts(run)
        if "export" in run.values:
            self.place_checkpoint()
        if self.cfg.stop_after:
            what = f"stopped after {self.cfg.stop_after}"
            if self.cfg.stop_after == "export":
                what = f"exported {run.values['export'].info['quant_algo']} checkpoint"
            return self.finish(EXIT_OK, what)
        return self.gate_and_report(ref)

    def inputs(self):
        """The model and data, and every check that needs them, before any compute."""
        ctx, cfg, run, record = self.ctx, self.cfg, self.executor, self.record
        ref = run.value("prepare")
        record["model"] = ref.describe()
        record["run"]["model"] = ref.name
        rundir.start(self.run_dir, record)
        recipe = preflight.check_inputs(run)
        limits = build.limits(run)
        limits.check(cfg.eval.batch_size, cfg.eval.seq_len)
        if cfg.eval.gen_prompts and cfg.eval.gen_tokens:
            limits.check(min(cfg.eval.gen_prompts, cfg.eval.batch_size), cfg.eval.gen_prompt_len, cfg.eval.gen_tokens)
        record["engine"] = {"name": ctx.engine.name, "limits": limits.describe()}
        if getattr(cfg.engine, "kernels", None) is not None:  # the switches in force (the env override included)
            record["engine"]["kernels"] = cfg.engine.kernels.resolved()
        calib, evalset = run.value("data:calib"), run.value("data:eval")
        record["data"] = {"calib": {"fingerprint": calib.fingerprint, **calib.info},
                          "eval": {"fingerprint": evalset.fingerprint, **evalset.info}}
        if any(s.name == f"evaluate:{ctx.engine.name}" for s in self.steps) and cfg.stop_after is None:
            # a gate this text cannot pass: exit 2 now, before calibration (the data stage has tokenized it)
            for line in gate_checks.check_evaluation_text(cfg.gate, ctx.precision.name, evalset,
                                                          cfg.eval.max_windows):
                log.warning("warning: %s", line)
        if ctx.engine.runs != "model" and not ctx.external_checkpoint:  # made elsewhere: not our calibration
            self.data_warnings = _calibration_overlap(cfg, calib, evalset, record)
        record["conventions"] = conventions_record(calib, evalset)
        for line in record["conventions"]["warnings"]:
            log.warning("warning: %s", line)
        self.data_warnings = record["conventions"]["warnings"] + self.data_warnings
        self.provenance = {"model_fingerprint": ref.fingerprint, "eval_fingerprint": evalset.fingerprint,
                           "calib_fingerprint": calib.fingerprint, "versions": versions(), "git_commit": git_commit(),
                           "device": ctx.device.describe(), "dtype": str(ctx.dtype).removeprefix("torch."),
                           "config": self.snapshot, "argv": self.argv}
        if cfg.gate.baseline:  # refuse a mismatched baseline before any compute
            gate_checks.load_baseline(cfg.gate.baseline, self.provenance)
        if recipe is not None:
            record["recipe"] = recipe
        return ref

    def place_checkpoint(self) -> None:
        """RUN/checkpoint: the export this run judged, inside the run directory (rundir.place_checkpoint)."""
        how = rundir.place_checkpoint(self.run_dir / "checkpoint", self.executor.values["export"].path,
                                      self.cfg.run_checkpoint)
        self.record["checkpoint"] = {"path": str(self.run_dir / "checkpoint"), "placed": how}

    def audit_stopped(self, report, ref) -> RunResult:
        """The checkpoint's audit found an error: its reports, nothing evaluated, exit 1."""
        from quantlab.report.audit import write_audit_reports

        self.record["artifacts"] = _artifacts(self.executor)
        self.place_checkpoint()
        write_audit_reports(self.run_dir, report, ref.name, self.ctx.precision.name, self.cfg.kv_cache.dtype)
        first = report.errors[0]
        return self.finish(EXIT_GATE_FAILED, f"the checkpoint audit found {len(report.errors)} error(s), first "
                                             f"[{first.check}] {first.message}; nothing was evaluated (details in "
                                             f"{self.run_dir / 'report.md'})")

    def gate_and_report(self, ref) -> RunResult:
        """The gate's verdict on the evaluation and every report of it."""
        from quantlab.report import documents
        from quantlab.report.render import write_run_reports

        ctx, cfg, run = self.ctx, self.cfg, self.executor
        results = {name: run.value(f"evaluate:{name}") for name in ctx.candidates()}
        result = results[ctx.engine.name]
        attribution = evaluate.attribution(results, ctx.engine.name) if len(results) > 1 else None
        thresholds = gate_checks.thresholds_for(cfg.gate, ctx.precision.name, cfg.eval.seq_len)
        verdict = gate_checks.verdict(cfg.gate, thresholds, result.checks, result.design, result.look,
                                      result.windows, result.metrics, self.provenance)
        if self.audit_failed:
            verdict["passed"] = False
            verdict["audit_failed"] = self.audit_failed
        verdict["evidence"] = weak_evidence(verdict, self.calibration_tokens(), result.checks)
        verdict["warnings"] = ([self.audit_failed] if self.audit_failed else []) + (
            verdict["evidence"] + self.data_warnings + result.warnings + verdict["warnings"]
            + within_numerics(result.checks, result.numerics))
        doc = documents.metrics_document(self.run_info(ref, result), result, verdict, self.provenance, attribution)
        run.values["reference"].close()
        doc["speed"] = self.speed()
        layers = run.values["audit"].layers if "audit" in run.values else []
        doc["weight_error"] = write_run_reports(self.run_dir, doc, result.kl_values, layers)
        documents.write_metrics(self.run_dir, doc)
        documents.write_junit(self.run_dir, doc)
        print(documents.console_table(doc))
        code = EXIT_OK if verdict["passed"] else EXIT_GATE_FAILED
        m = result.metrics
        weak = f" on weak evidence ({'; '.join(e.split(':')[0] for e in verdict['evidence'])})" \
            if verdict["evidence"] else ""
        moved = documents.machine_dependent(doc)
        digits = ("; machine-dependent: " + ", ".join(f"{documents.PRINTED[k][0]} ±{v:.1g}" for k, v in moved.items())
                  if moved else "")
        what = (f"{ctx.precision.name} kv={cfg.kv_cache.dtype} on {ref.name}: "
                f"{'PASS' if verdict['passed'] else 'FAIL'}{weak} (top-1 {m['top1_agreement']['value']:.3f}, ppl "
                f"ratio {m['ppl_ratio']['value']:.3f}, KL {m['kl_mean']['value']:.4f}{digits})")
        return self.finish(code, what, doc)

    def calibration_tokens(self) -> int | None:
        """Tokens this run calibrated on (None: it calibrated nothing, e.g. a checkpoint made elsewhere)."""
        if self.ctx.engine.runs == "model" or self.ctx.external_checkpoint or not self.executor.has("quantize"):
            return None
        calib = self.executor.value("data:calib")
        return int(calib.num_windows * calib.seq_len)

    def speed(self) -> dict:
        """metrics.json's speed section: on a GPU, the checkpoint's decode / prefill speed and memory against the
        unquantized model in paired rounds (quantlab.engines.speed); elsewhere why it was not measured."""
        from quantlab.engines import decode
        from quantlab.engines import speed as speed_check
        from quantlab.engines.registry import ENGINES
        from quantlab.stages.build import build_engine

        ctx, cfg = self.ctx, self.cfg
        if not cfg.eval.speed:
            return speed_check.not_measured("eval.speed=false")
        if ctx.device.type != "cuda":
            return speed_check.not_measured(
                "speed is measured on GPUs only: on a CPU FP8 is emulated and INT4 is dequantized at load, so "
                "timings here say nothing about serving speed")
        if ctx.engine.name not in ("torch", "reference"):
            return speed_check.not_measured(f"engine={ctx.engine.name} has no cached decode path in quantlab")
        engines = []
        try:
            engines.append(build_engine(ctx.engine, self.executor))
            engines.append(build_engine(ENGINES["reference"], self.executor))
            result = speed_check.measure(engines[0], engines[1], ctx.device)
        except decode.Unsupported as why:
            result = speed_check.not_measured(f"the cached decode does not run this model: {why}")
        finally:
            for engine in engines:
                engine.close()
        log.info("%s", speed_check.describe(result))
        return result

    def run_info(self, ref, result) -> dict:
        """metrics.json's "run" section: what ran, on which tokens, and what was spent."""
        ctx, cfg, run, record = self.ctx, self.cfg, self.executor, self.record
        evalset = run.value("data:eval")
        used = result.design.looks[result.look]
        return {"precision": ctx.precision.name, "kv_cache": cfg.kv_cache.dtype, "engine": ctx.engine.name,
                "model": ref.name, "recipe": record.get("recipe"), "run_dir": str(self.run_dir),
                "eval": {"windows": used, "windows_available": evalset.num_windows, "cap": result.design.cap,
                         "seq_len": evalset.seq_len, "source": evalset.info["source"],
                         "tokens": used * evalset.seq_len,
                         "prefix": (record.get("conventions") or {}).get("eval"),
                         "kl": "exact over the full vocabulary (reference logits recomputed from its cached final "
                               "hidden states)"},
                "checkpoint": record["artifacts"].get("export"), "family": ref.family,
                "experts": _expert_coverage(record["artifacts"].get("quantize")),
                "audit": record.get("audit"),
                "reference_forward_batches": run.values["reference"].forward_batches,
                "candidate_forward_batches": result.forward_batches,
                "kernels": record["engine"].get("kernels")}  # engine.kernels in force (torch engine), else None

    def finish(self, code: int, what: str, doc: dict | None = None) -> RunResult:
        run = self.executor
        said = self.runlog.warnings.summary(self.runlog.path) if self.runlog else None
        if said:
            log.info("%s", said)
            self.record["library_warnings"] = dict(self.runlog.warnings.counts)
        self.record["stage_seconds"] = run.seconds
        self.record["plan"] = plan_vs_actual(self.planned, run.seconds)
        if self._speed:
            self.record["plan"]["machine_speed"] = self._speed
        self.record["events"] = [{"stage": s, "key": k, "action": a} for s, k, a in run.store.events]
        return finish(self.run_dir, self.record, self.start, code, what, doc)


def _priced(work) -> dict | None:
    """What an a-priori estimate prices (quantlab.prior.seconds' arguments): the work units, device and variant."""
    if not isinstance(work, dict) or not work.get("units"):
        return None
    return {"units": work["units"], "device": work.get("device"), "variant": work.get("variant")}


def plan_vs_actual(planned: dict[str, dict], seconds: dict[str, float]) -> dict:
    """run.json's "plan": for every step this run built, the seconds predicted as it started (the figure the plan
    and the progress line showed) beside the seconds it took, and the relative error; the totals over the steps
    that had a prediction. Steps read from the cache are not in it (the plan says "cached" for them). An evaluation
    that read other windows than the plan priced (a gate that failed early) is compared with the same estimate at the
    windows it read (planned_read_s; error_shown: against the figure shown)."""
    steps, planned_total, actual_total = {}, 0.0, 0.0
    shown_total = 0.0
    for name, p in planned.items():
        actual = seconds.get(name)
        row = {**p, "actual_s": actual, "error": None}
        if p["planned_s"] and actual is not None:
            like = p.get("planned_read_s") or p["planned_s"]  # the same estimate for the work it did
            row["error"] = round(actual / like - 1, 3)
            if "planned_read_s" in p:
                row["error_shown"] = round(actual / p["planned_s"] - 1, 3)
            planned_total += like
            shown_total += p["planned_s"]
            actual_total += actual
        steps[name] = row
    out = {"steps": steps, "planned_s": round(planned_total, 2), "actual_s": round(actual_total, 2),
           "error": round(actual_total / planned_total - 1, 3) if planned_total else None}
    if abs(shown_total - planned_total) > 1e-9:
        out["shown_s"] = round(shown_total, 2)  # what the plan showed, priced at a passing run's windows
    return out


BLIND_SHARE_WEAK = 0.10  # a verdict blind to faults in more than this share of the text is weak evidence
CALIB_TOKENS_WEAK = 8192  # fewer calibration tokens (ModelOpt's examples use 512 x 512 = 262k) is weak evidence
DOCUMENTS_WEAK = 5  # fewer documents among the windows: intervals over 1-3 degrees of freedom


def conventions_record(calib, evalset) -> dict:
    """run.json's conventions: the prefix each role's windows start with, why, and a warning per explicit choice the
    model would not expect (quantlab.conventions)."""
    out, warnings = {}, []
    for role, tokens in (("calib", calib), ("eval", evalset)):
        prefix = getattr(tokens, "prefix", None)
        if prefix is None:
            continue
        out[role] = prefix.describe()
        if prefix.warning and prefix.warning not in warnings:
            warnings.append(prefix.warning)
    out["warnings"] = warnings
    return out


def weak_evidence(verdict: dict, calib_tokens: int | None, checks) -> list[str]:
    """What makes a verdict weak though every check decided: few windows (a blind share over BLIND_SHARE_WEAK), few
    documents, a tiny calibration. Each a warning in the verdict box, metrics.json gate.evidence, and the exit line
    (its words up to the colon)."""
    design, out = verdict.get("design") or {}, []
    blind, used = design.get("blind_share"), design.get("windows_used")
    if blind is not None and blind > BLIND_SHARE_WEAK:
        out.append(f"{used} evaluation windows, {blind:.0%} blind share: a fault confined to less than {blind:.0%} of "
                   "the text is absent from all of them with probability above alpha, so this verdict says nothing "
                   "about it (evaluate more text: eval.max_windows, eval.path)")
    docs = max((c.clusters or 0 for c in checks), default=0)
    if 0 < docs < DOCUMENTS_WEAK:
        out.append(f"{docs} documents: the intervals have documents as clusters, so they rest on {docs} independent "
                   "units (evaluate text with more documents)")
    if calib_tokens is not None and calib_tokens < CALIB_TOKENS_WEAK:
        out.append(f"{calib_tokens} calibration tokens: scales calibrated on so little text may not hold on other "
                   "text (raise calib.num_samples / calib.seq_len; ModelOpt's examples use 512 x 512)")
    return out


def within_numerics(checks, numerics: dict | None) -> list[str]:
    """Checks whose margin is within the spread another machine's arithmetic gives their metric: their verdict may
    differ there (evaluate.numerics_noise)."""
    spreads = ((numerics or {}).get("metrics") or {}) if (numerics or {}).get("measured") else {}
    out = []
    for c in checks:
        spread = (spreads.get(c.metric) or {}).get("spread")
        if not spread or c.bucket is not None or len(c.ci) != 2:
            continue
        edge = c.ci[1] if c.op == "<=" else c.ci[0]  # the interval's end the decision compares with the threshold
        if abs(edge - c.threshold) < spread:
            out.append(f"{c.name}: its interval ends {abs(edge - c.threshold):.2g} from the threshold, within the "
                       f"spread another machine's arithmetic gives {c.metric} (±{spread:.2g}): the verdict of this "
                       "check may differ on another CPU or GPU")
    return out


# share of evaluation tokens in runs the calibration windows also hold that is said (with any copied document):
# texts of one kind share boilerplate (the default pydoc split, whose topics never overlap, shares 1.6% in runs of
# 32 tokens: "See also" lists, grammar lines), while a copied file or record set shares most of its tokens
OVERLAP_WARN = 0.05


def _calibration_overlap(cfg: Config, calib, evalset, record: dict) -> list[str]:
    """Evaluation text the calibration saw makes every verdict optimistic: measured as copied token runs
    (quantlab.stages.data.overlap), recorded in run.json, a warning for the console and the reports, or exit 2
    before any evaluation under gate.refuse_calibration_overlap (gate=strict)."""
    from quantlab.stages.data import overlap

    found = overlap(calib, evalset)
    record["data"]["overlap"] = {k: v for k, v in found.items() if k != "windows"} | {"windows": len(found["windows"])}
    copied = found["copied_documents"]
    if not found["same_source"] and found["share"] < OVERLAP_WARN and not copied:
        return []
    what = ("the evaluation text is the calibration text" if found["same_source"] else
            "the evaluation text repeats text the calibration saw")
    docs = (f"; documents read by calibration too: {', '.join(d['document'] for d in copied[:5])}"
            + (f" and {len(copied) - 5} more" if len(copied) > 5 else "")) if copied else ""
    text = (f"{what}: {found['share']:.1%} of the evaluation tokens ({len(found['windows'])} of "
            f"{found['eval_windows']} windows) lie in runs of {found['ngram']} tokens that calibration windows "
            f"also hold{docs}, so the verdict is optimistic")
    fix = "evaluate on text calibration did not see (eval.path / eval.dataset apart from calib.*)"
    if cfg.gate.refuse_calibration_overlap:
        raise QuantlabError(text, fix=fix + ", or set gate.refuse_calibration_overlap=false to accept it")
    log.warning("quantlab: %s (fix: %s)", text, fix)
    return [f"{text}. Fix: {fix}."]


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


def audit_record(report) -> dict:
    """What run.json and metrics.json keep of the audit: verdict, counts, the error and warning findings, and the
    info finding naming the equivalence transforms it accepted (quantlab.audit.equivalence)."""
    from quantlab.audit.equivalence import named_in_run

    return {"passed": report.passed, "counts": report.summary(), "seconds": report.timings.get("total"),
            "canary": report.canary, "findings": [f.to_dict() for f in report.findings
                                                  if f.severity != "info" or named_in_run(f)]}
