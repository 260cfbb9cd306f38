"""Sweep summary: one row per run (stopped runs included, with their reason), the ship candidate, and quality vs
size with the Pareto front; where a run measured speed (on a GPU: metrics.json's speed section), its decode speedup
over the unquantized model, the fastest passing run and quality vs decode speed.

Written by a Hydra callback when a multirun ends, and rebuildable from any run directories (made on any machine)
with `python -m quantlab.summary DIR [DIR ...]`. Each row says what ran from what the run recorded: run.json's "run"
section (written before anything is computed), else metrics.json's, else the recipe, else the config groups Hydra
recorded for the job (a job stopped before quantlab wrote anything). A damaged record is named in the row's notes
and on stderr; the other files of the run, and the other runs, are still read.
"""
from __future__ import annotations

import logging
from pathlib import Path

from hydra.experimental.callback import Callback

from quantlab.artifacts import write_json_atomic, write_text_atomic
from quantlab.errors import EXIT_BAD_INPUT, EXIT_GATE_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK
from quantlab.gate.checks import decided_intervals
from quantlab.report.plots import pareto, pareto_front, speed_pareto
from quantlab.report.render import environment
from quantlab.rundir import RUN_JSON, STATUS, read_record

log = logging.getLogger("quantlab")
WHAT = ("precision", "kv_cache", "engine", "model")  # what every row names
STOPPED = {EXIT_BAD_INPUT: "BAD INPUT", EXIT_INTERNAL: "ERROR", EXIT_INTERRUPTED: "INTERRUPTED"}


def _number(value) -> bool:
    """A JSON number (bool is an int to Python, not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir())


def exit_codes(sweep_dir: Path) -> list[int]:
    """Exit code of every job of a sweep, read from each job's status.json (jobs may have run in other processes:
    joblib, submitit); a job that left none, or a damaged one, crashed before writing it."""
    codes = []
    for job in _job_dirs(sweep_dir):
        status, _ = read_record(job / STATUS)
        try:
            codes.append(int(status["exit_code"]))
        except (TypeError, KeyError, ValueError):
            codes.append(EXIT_INTERNAL)
    return codes


def _is_run(path: Path) -> bool:
    return any((path / name).is_file() for name in (RUN_JSON, STATUS)) or (path / ".hydra").is_dir()


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories among paths and their immediate children: those with run.json or status.json, and Hydra job
    directories (a job stopped before quantlab wrote anything still is a row)."""
    runs = []
    for p in paths:
        if _is_run(p):
            runs.append(p)
        elif p.is_dir():
            runs += sorted(c for c in p.iterdir() if c.is_dir() and _is_run(c))
    return runs


def _hydra_choices(run_dir: Path) -> dict:
    """The config groups Hydra recorded for a job (.hydra/hydra.yaml): what it was asked to run."""
    path = run_dir / ".hydra" / "hydra.yaml"
    if not path.is_file():
        return {}
    import yaml

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        choices = doc["hydra"]["runtime"]["choices"]
        return {k: str(v) for k, v in choices.items()} if isinstance(choices, dict) else {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        log.warning("%s is damaged; the run's row may not name what it ran", path)
        return {}


def _what_ran(run_dir: Path, record: dict, doc: dict) -> dict:
    """precision, kv_cache, engine, model: from the first record that has each."""
    recipe = record.get("recipe") or {}
    recorded = [record.get("run") or {}, doc.get("run") or {},
                {"precision": (recipe.get("precision") or {}).get("name"), "kv_cache": recipe.get("kv_cache"),
                 "engine": (record.get("engine") or {}).get("name"), "model": (record.get("model") or {}).get("name")}]
    choices = _hydra_choices(run_dir) if any(not all(r.get(k) for r in recorded) for k in WHAT) else {}
    recorded.append({k: choices.get(k) for k in ("precision", "kv_cache", "engine")})
    out = {}
    for key in WHAT:
        value = next((r[key] for r in recorded if isinstance(r, dict) and r.get(key)), None)
        out[key] = str(value) if value is not None else ("?" if key != "model" else None)
    export = (record.get("artifacts") or {}).get("export")
    if out["precision"] == "external" and isinstance(export, dict) and export.get("path"):
        # a checkpoint made elsewhere (engine.checkpoint=): named by its directory and format, not "external"
        out["precision"] = f"{Path(str(export['path'])).name} ({export.get('format') or 'checkpoint'})"
    return out


def _checkpoint(record: dict) -> dict:
    """Bits per weight and the tool that made the checkpoint, where its record says (every export since 2026-12-02;
    other tools' checkpoints name their tool)."""
    export = (record.get("artifacts") or {}).get("export")
    export = export if isinstance(export, dict) else {}
    bits = export.get("bits_per_weight")
    return {"bits_per_weight": bits if _number(bits) else None,
            "tool": export.get("tool") if isinstance(export.get("tool"), str) else None}


def _flips(doc: dict) -> dict | None:
    """Top-1 flips against the reference (right -> wrong, wrong -> right) from the behaviour panel."""
    flips = (doc.get("behaviour") or {}).get("flips") if isinstance(doc.get("behaviour"), dict) else None
    if not isinstance(flips, dict):
        return None
    return {"worse": flips.get("ref_right_cand_wrong"), "better": flips.get("ref_wrong_cand_right")}


def _first_line(text) -> str:
    return str(text or "").strip().splitlines()[0] if str(text or "").strip() else ""


def _verdict(run_dir: Path, record: dict, status: dict, doc: dict) -> tuple[str, str | None, list[str]]:
    """(verdict, the reason a run stopped or failed, failed checks)."""
    if doc.get("gate"):
        failed = [c.get("name", "?") for c in doc["gate"].get("checks", []) if not c.get("passed")]
        passed = doc["gate"].get("passed")
        return ("PASS" if passed else "FAIL"), (None if passed else "gate: " + "; ".join(failed)), failed
    audit = record.get("audit") or {}
    if audit.get("passed") is False:
        errors = [f for f in audit.get("findings", []) if f.get("severity") == "error"]
        reason = "; ".join(f"[{f.get('check')}] {f.get('message')}" for f in errors[:2])
        failed = [f"audit.{f.get('check')}" for f in errors]
        return "AUDIT FAIL", f"checkpoint audit: {reason}; nothing evaluated", failed
    code = record.get("exit_code", status.get("exit_code"))
    code = status.get("exit_code", code) if code is None else code
    error = record.get("error") or status.get("error")
    if code in STOPPED:
        reason = _first_line(error) or "no reason recorded"
        if code == EXIT_INTERNAL and (run_dir / "traceback.txt").is_file():
            reason += f" (traceback: {run_dir / 'traceback.txt'})"
        elif code == EXIT_BAD_INPUT and "fix:" in str(error or ""):
            reason += "; fix: " + str(error).split("fix:", 1)[1].strip()
        return STOPPED[code], reason, []
    if code is None:
        return "INCOMPLETE", "no exit code recorded: the run is still going, or its process was killed", []
    stop_after = ((record.get("config") or {}).get("stop_after"))
    if code == EXIT_OK:
        return "NOT EVALUATED", (f"stop_after={stop_after}" if stop_after else "no metrics.json"), []
    if code == EXIT_GATE_FAILED:
        return "FAIL", _first_line(error) or "exit 1 without metrics.json", []
    return "ERROR", f"exit code {code}", []


def _size(record: dict) -> tuple[int | None, float | None]:
    artifacts = record.get("artifacts") or {}
    size = (artifacts.get("export") or {}).get("safetensors_bytes")
    ref_path = Path((artifacts.get("prepare") or {}).get("path") or "/nonexistent")
    ref_bytes = sum(p.stat().st_size for p in ref_path.glob("*.safetensors")) if ref_path.is_dir() else None
    size = size if isinstance(size, (int, float)) and size > 0 else None
    return size, (size / ref_bytes if size and ref_bytes else None)


def _metric(doc: dict, name: str, field: str = "value"):
    """A metric's value (or interval) from metrics.json; None when absent or not a number (a hand-edited file)."""
    metrics = doc.get("metrics") if isinstance(doc.get("metrics"), dict) else {}
    entry = metrics.get(name) if isinstance(metrics.get(name), dict) else {}
    value = entry.get(field)
    if isinstance(value, list):
        return value if all(_number(v) for v in value) else None
    return value if _number(value) else None


def _decode_speedup(entry) -> dict | None:
    """One batch size's decode speedup over the unquantized model, {batch, value, ci}; None when any of them is
    missing or not a number (a hand-edited file)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("decode_speedup"), dict):
        return None
    batch, value, ci = entry.get("batch"), entry["decode_speedup"].get("value"), entry["decode_speedup"].get("ci")
    if not (isinstance(batch, int) and _number(batch) and _number(value) and isinstance(ci, list) and len(ci) == 2
            and all(_number(v) for v in ci)):
        return None
    return {"batch": batch, "value": value, "ci": [ci[0], ci[1]]}


def _speed(doc: dict) -> tuple[dict, str | None]:
    """The row's speed from metrics.json's speed section (quantlab.engines.speed), and a note when that section
    cannot be read. speed_b1 / speed_bmax: the decode speedup over the unquantized model ({batch, value, ci}) at
    batch 1 and at the largest batch measured (None: not measured; speed_bmax also when batch 1 is the largest);
    speed_device: the GPU; speed_reason: why speed was not measured (None when it was, or when the run recorded no
    speed section: a run stopped before evaluating, or one older than the section)."""
    out = {"speed_b1": None, "speed_bmax": None, "speed_device": None, "speed_reason": None}
    speed = doc.get("speed")
    if speed is None:
        return out, None
    if not isinstance(speed, dict):
        return out, "metrics.json's speed section is damaged"
    if speed.get("measured") is not True:
        out["speed_reason"] = _first_line(speed.get("reason")) or "no reason recorded"
        return out, None
    batches = speed.get("batches")
    entries = [_decode_speedup(b) for b in batches] if isinstance(batches, list) else []
    if not entries or None in entries:
        return out, "metrics.json's speed section is damaged"
    by_batch = {e["batch"]: e for e in entries}
    out["speed_b1"] = by_batch.get(1)
    out["speed_bmax"] = by_batch[max(by_batch)] if max(by_batch) != 1 else None
    out["speed_device"] = str(speed["device"]) if speed.get("device") else None
    return out, None


# the artifact-store directories a step's artifacts go to, where they are not the part of its name before ":"
# (quantlab.graph.steps_for; run.json's events name directories, its stage_seconds name steps): a candidate's
# evaluation also makes the reference's blocks and the engine it evaluates (inside its own seconds)
STEP_STORES = {"evaluate": ("evaluate", "reference", "engine"), "build": ("engine",)}


def _wall(record: dict) -> dict:
    """The run's wall time split into computed and reused seconds, from run.json: stage_seconds (each step's own
    seconds) and events (each artifact the run read from the store, "reused", or made, "built", by the store's
    directory). A step is a cache hit when every event of its directories says "reused": its seconds (loading what
    an earlier run made) are reused_s, its name is in reused_steps. computed_s is the rest of the wall time: the
    other steps, and what no step times (setup, gate, reports). A step with no event (a local model) and a step whose
    directory saw a build (of this step or another of that directory) count as computed, so reused_s never says more
    than the cache served. computed_s and reused_s are None (no steps) where run.json has no such record (a run
    stopped before it wrote them, or one older than them)."""
    wall, seconds, events = record.get("wall_time_s"), record.get("stage_seconds"), record.get("events")
    out = {"wall_time_s": wall if _number(wall) else None, "computed_s": None, "reused_s": None,
           "reused_steps": [], "steps": 0}
    if out["wall_time_s"] is None or not isinstance(seconds, dict) or not isinstance(events, list):
        return out
    actions: dict[str, set] = {}
    for event in events:
        if isinstance(event, dict):
            actions.setdefault(str(event.get("stage")), set()).add(event.get("action"))
    timed = {name: s for name, s in seconds.items() if _number(s)}
    for name in timed:
        base = name.split(":", 1)[0]
        seen = set().union(*(actions.get(d, set()) for d in STEP_STORES.get(base, (base,))))
        if seen == {"reused"}:
            out["reused_steps"].append(name)
    reused = min(round(float(sum(timed[n] for n in out["reused_steps"])), 2), wall)
    out.update(computed_s=round(wall - reused, 2), reused_s=reused, steps=len(timed))
    return out


def _row(run_dir: Path) -> dict:
    notes = []
    files = {}
    for name in (RUN_JSON, STATUS, "metrics.json"):
        obj, problem = read_record(run_dir / name)
        files[name] = obj or {}
        if problem and problem != "missing":
            notes.append(f"{name} is {problem}")
    record, status, doc = files[RUN_JSON], files[STATUS], files["metrics.json"]
    row = {"run_dir": str(run_dir.resolve()), "name": run_dir.name, **_what_ran(run_dir, record, doc)}
    row["label"] = f"{row['precision']} · kv {row['kv_cache']} · {row['engine']}"
    row["size_bytes"], row["size_vs_reference"] = _size(record)
    row.update(_wall(record))
    row["verdict"], row["reason"], row["failed"] = _verdict(run_dir, record, status, doc)
    row["exit_code"] = record.get("exit_code", status.get("exit_code"))
    gate = doc["gate"] if isinstance(doc.get("gate"), dict) else {}
    row.update(top1_agreement=_metric(doc, "top1_agreement"), ppl_ratio=_metric(doc, "ppl_ratio"),
               ppl_ratio_ci=(decided_intervals(gate.get("checks")).get("ppl_ratio")
                             or _metric(doc, "ppl_ratio", "ci95")),
               kl_mean=_metric(doc, "kl_mean"), flips=_flips(doc), **_checkpoint(record), pareto=False,
               notes=notes, stopped=row["verdict"] in (*STOPPED.values(), "AUDIT FAIL", "INCOMPLETE"))
    row.update(_identity(run_dir, record, doc))
    speed, problem = _speed(doc)
    row.update(speed)
    if problem:
        notes.append(problem)
        log.warning("%s: its speed section is damaged; the row shows no speed", run_dir / "metrics.json")
    return row


QUANTLAB_ENGINES = ("torch", "fakequant", "trtllm")  # engines that run quantlab's own path on the checkpoint
CHECKPOINT_FILES = (".gguf", ".safetensors")


def _identity(run_dir: Path, record: dict, doc: dict) -> dict:
    """What the attribution pairs runs by: the evaluation tokens' fingerprint and the paths of the checkpoint the
    run judged (a served run: engine.serve_checkpoint; other engines: the checkpoint in the run dir and its source).
    Their files are read only where a summary holds a served run (attribution)."""
    data = record.get("data") if isinstance(record.get("data"), dict) else {}
    evalset = data.get("eval") if isinstance(data.get("eval"), dict) else {}
    engine_cfg = ((record.get("config") or {}).get("engine") or {}) if isinstance(record.get("config"), dict) else {}
    paths = []
    if isinstance(engine_cfg, dict) and engine_cfg.get("serve_checkpoint"):
        paths.append(str(engine_cfg["serve_checkpoint"]))
    if (run_dir / "checkpoint").exists():
        paths.append(str(run_dir.resolve() / "checkpoint"))
    source = ((doc.get("run") or {}).get("checkpoint") or {}) if isinstance(doc.get("run"), dict) else {}
    if isinstance(source, dict) and source.get("path"):
        paths.append(str(source["path"]))
    gate = doc.get("gate") if isinstance(doc.get("gate"), dict) else {}
    checks = [c.get("name") for c in gate.get("checks") or [] if isinstance(c, dict) and c.get("name")]
    return {"eval_data": evalset.get("fingerprint"), "checkpoint_paths": paths, "gate_checks": sorted(checks)}


def _files_of(paths: list[str]) -> set[str]:
    """A content key of every weights file at these paths (a file, or the weights files of a directory): its size
    and the SHA-256 of its first and last MiB (the header and the last tensors), so that a copy, a hard link and
    its source are one file while reading only 2 MiB of each."""
    import hashlib

    out = set()
    for p in paths:
        path = Path(p)
        try:
            files = [path] if path.is_file() else [f for f in path.iterdir() if f.suffix in CHECKPOINT_FILES]
            for f in files:
                size = f.stat().st_size
                with f.open("rb") as fh:
                    digest = hashlib.sha256(fh.read(2**20))
                    fh.seek(max(0, size - 2**20))
                    digest.update(fh.read(2**20))
                out.add(f"{size}:{digest.hexdigest()[:16]}")
        except OSError:
            continue
    return out


ATTRIBUTION = {
    ("PASS", "PASS"): ("agree", "both pass: the server computes what quantlab's engine judged"),
    ("PASS", "FAIL"): ("the serving stack", "quantlab's engine passes this checkpoint on the same tokens and the "
                       "server does not: its kernels, KV cache, context or RoPE settings, or tokenizer"),
    ("FAIL", "FAIL"): ("the export", "quantlab's engine fails it too: the checkpoint itself is off"),
    ("FAIL", "PASS"): ("check the deployment", "the server passes where quantlab's engine fails: make sure it serves "
                       "this checkpoint (quantlab's numerics may also be stricter than the server's)"),
}


def attribution(rows: list[dict]) -> list[dict]:
    """Where it went wrong: each served run beside the run of quantlab's own engine on the same model, the same
    evaluation tokens and (where both record it) the same checkpoint file, else the same precision; both against
    the same reference, attributed by the two verdicts when both were gated by the same checks. A served run
    without such a partner is listed with the reason."""
    out, files = [], {}

    def files_of(row: dict) -> set[str]:
        if row["run_dir"] not in files:
            files[row["run_dir"]] = _files_of(row["checkpoint_paths"])
        return files[row["run_dir"]]

    for served in (r for r in rows if r["engine"] == "served"):
        same = [r for r in rows if r["engine"] in QUANTLAB_ENGINES and r["model"] == served["model"]
                and r.get("eval_data") and r.get("eval_data") == served.get("eval_data")]
        by_file = [r for r in same if files_of(r) & files_of(served)]
        partners, how = (by_file, "the same checkpoint file") if by_file else (
            [r for r in same if r["precision"] == served["precision"]], "the same precision")
        entry = {"served": served, "quantlab": None, "paired_by": None, "attributed": None, "says": None}
        if len(partners) != 1:
            entry["says"] = ("no run of quantlab's engine on the same evaluation tokens and checkpoint" if not partners
                             else f"{len(partners)} runs of quantlab's engine match ({how}): not attributed")
        elif partners[0]["gate_checks"] != served["gate_checks"]:  # verdicts of different gates say nothing paired
            q = partners[0]
            entry.update(quantlab=q, paired_by=how, attributed="not attributable")
            entry["says"] = (f"gated by different checks (quantlab's engine: {'; '.join(q['gate_checks']) or 'none'}; "
                             f"served: {'; '.join(served['gate_checks']) or 'none'}): give both runs the same "
                             "+precision or gate.thresholds, or compare the metrics")
        else:
            q = partners[0]
            entry.update(quantlab=q, paired_by=how)
            entry["attributed"], entry["says"] = ATTRIBUTION.get(
                (q["verdict"], served["verdict"]),
                ("not attributable", f"verdicts {q['verdict']} (quantlab's engine) and {served['verdict']} (served)"))
        out.append(entry)
    return out


def recommend(rows: list[dict]) -> dict | None:
    """Smallest passing checkpoint on the Pareto front; ties go to the lower perplexity ratio. Stopped runs and runs
    without a size or perplexity ratio are never candidates."""
    passing = [r for r in rows if r["verdict"] == "PASS" and r.get("size_bytes") and r.get("ppl_ratio") is not None]
    if not passing:
        return None
    front = pareto_front([(r["size_bytes"], r["ppl_ratio"]) for r in passing])
    return min((passing[i] for i in front), key=lambda r: (r["size_bytes"], r["ppl_ratio"]))


SPEED_SAYS = {"faster": "faster than the unquantized model (its whole interval is above 1)",
              "slower": "slower than the unquantized model (its whole interval is below 1)",
              "no measurable difference": "no measurable difference from the unquantized model (its interval "
                                          "includes 1)"}


def speed_verdict(ci: list[float]) -> str:
    """What a speedup's interval says: "faster" only when its lower end is above 1, "slower" when its upper end is
    below 1, else "no measurable difference"."""
    lo, hi = ci
    if lo > 1.0:
        return "faster"
    if hi < 1.0:
        return "slower"
    return "no measurable difference"


def fastest(rows: list[dict]) -> dict | None:
    """The passing run with the highest decode speedup over the unquantized model at batch 1 (the median of its
    paired rounds), with what its interval says ({row, verdict, says}); None when no passing run measured speed at
    batch 1. Reported beside the ship candidate, never combined with quality or size into one score."""
    measured = [r for r in rows if r["verdict"] == "PASS" and r.get("speed_b1")]
    if not measured:
        return None
    row = max(measured, key=lambda r: r["speed_b1"]["value"])
    verdict = speed_verdict(row["speed_b1"]["ci"])
    return {"row": row, "verdict": verdict, "says": SPEED_SAYS[verdict]}


def speed_not_measured(rows: list[dict]) -> list[tuple[str, int]]:
    """Each reason runs gave for not measuring speed, with how many runs gave it (shown once in the summary)."""
    counts: dict[str, int] = {}
    for r in rows:
        if r.get("speed_reason"):
            counts[r["speed_reason"]] = counts.get(r["speed_reason"], 0) + 1
    return sorted(counts.items())


def summary_rows(run_dirs: list[Path]) -> list[dict]:
    """One row per run directory (every key present in every row), sorted by size, stopped runs last."""
    rows = [_row(d) for d in run_dirs]
    rows.sort(key=lambda r: (r["size_bytes"] is None, r["size_bytes"] or 0, r["label"], r["name"]))
    evaluated = [r for r in rows if r.get("size_bytes") and r.get("ppl_ratio") is not None]
    front = pareto_front([(r["size_bytes"], r["ppl_ratio"]) for r in evaluated])
    for i, r in enumerate(evaluated):
        r["pareto"] = i in front
    return rows


def write_summary(out_dir: Path, run_dirs: list[Path], rows: list[dict] | None = None) -> tuple[Path, Path]:
    """summary.md, summary.html and summary.json of run directories: one row per run, the recommendation, the plot
    (rows: summary_rows(run_dirs), when the caller has them already)."""
    rows = summary_rows(run_dirs) if rows is None else rows
    models = sorted({r["model"] for r in rows if r["model"]})
    ctx = {"rows": rows, "best": recommend(rows), "plot": pareto(rows), "out_dir": str(out_dir),
           "stopped": [r for r in rows if r["stopped"]], "models": models,
           "damaged": [(r["name"], n) for r in rows for n in r["notes"]],
           "fastest": fastest(rows), "speed_plot": speed_pareto(rows), "speed_not_measured": speed_not_measured(rows),
           "attribution": attribution(rows),
           "speed_devices": sorted({r["speed_device"] for r in rows if r["speed_device"]})}
    env = environment()
    out_dir.mkdir(parents=True, exist_ok=True)
    md, html = out_dir / "summary.md", out_dir / "summary.html"
    write_text_atomic(md, env.get_template("summary.md.j2").render(ctx))
    write_text_atomic(html, env.get_template("summary.html.j2").render(ctx))
    write_json_atomic(out_dir / "summary.json", rows)
    return md, html


def headline(rows: list[dict]) -> str:
    """The summary's one line for the console: the ship candidate (precision, KV cache, engine) or none, and where
    speed was measured the fastest passing run at batch 1 and what its interval says."""
    best = recommend(rows)
    stopped = sum(r["stopped"] for r in rows)
    tail = f"; {stopped} stopped before a verdict" if stopped else ""
    quick = fastest(rows)
    if quick:
        r, (lo, hi) = quick["row"], quick["row"]["speed_b1"]["ci"]
        tail += (f"; fastest passing at batch 1: {r['precision']}, KV cache {r['kv_cache']}, engine {r['engine']} "
                 f"({r['name']}: decode x{r['speed_b1']['value']:.3f} [{lo:.3f}, {hi:.3f}] the unquantized model, "
                 f"{quick['verdict']})")
    if best is None:
        return f"no run passed its gates{tail}"
    return (f"ship candidate {best['precision']}, KV cache {best['kv_cache']}, engine {best['engine']} "
            f"({best['name']}: {best['size_bytes'] / 2**20:.1f} MiB, ppl ratio {best['ppl_ratio']:.3f}){tail}")


class SweepSummary(Callback):
    """Hydra callback: after a multirun, summarize every run of the sweep (the CLI reads the jobs' exit codes)."""

    def on_multirun_end(self, config, **_kwargs) -> None:
        """Write the sweep's summary once every job has ended."""
        sweep_dir = Path(config.hydra.sweep.dir)
        runs = find_runs([sweep_dir]) if sweep_dir.is_dir() else []
        if runs:
            rows = summary_rows(runs)
            _md, html = write_summary(sweep_dir, runs, rows)
            print(f"quantlab: sweep summary of {len(runs)} runs: {headline(rows)} -> {html}")
