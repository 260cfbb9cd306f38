"""Checkpoint audit on the default model (SmolLM2-135M-Instruct): detection table, false alarms, wall time, memory.

1. The default fp8 export, exactly as `python -m quantlab +precision=fp8 stop_after=export` makes it (run once,
   from a scratch directory, into the bench's cache), audited with and without the logits canary: wall time in a
   fresh `python -m quantlab.audit` process (interpreter start and imports included), peak RSS of that process, and
   the audit's own time in-process (what the pipeline's audit step costs; imports are paid already there).
2. False alarms: healthy exports of every precision (fp8, int8_sq, int4_awq, w4a8_awq, nvfp4), with and without FP8
   KV, made by quantlab's pipeline (calibration reduced to --calib-samples x --calib-len tokens to keep the sweep
   short), audited with the canary: error findings counted (target 0).
3. Detection table: every fault class of tests/test_audit.py's FAULTS applied to a copy of the matching healthy
   export of the default model, audited with the canary, with --no-canary, and (file- and tensor-level faults)
   without the reference: detected when the fault's check reports an error naming every module the fault damaged
   (target: all).

The healthy-export statistics the bounds rest on are bench/audit_healthy.py's.

    HF_HUB_OFFLINE=1 python bench/audit_bench.py [--cache /tmp/auditbench_cache] [--repeats 2]
    # the detection table alone, on healthy exports made already (a subset of faults, without the canary column):
    HF_HUB_OFFLINE=1 python bench/audit_bench.py --exports exports.json --reference MODEL_DIR --no-canary-column \
        [--faults name,name] --out result.md

Prints the tables and writes them to bench/results/audit.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRECISIONS = ("fp8", "int8_sq", "int4_awq", "w4a8_awq", "nvfp4")


def default_export(cache: Path, scratch: Path) -> tuple[Path, Path]:
    """(checkpoint, reference) of the default fp8 export, made once by the CLI as a user would."""
    run_dir = scratch / "default_fp8"
    if not (run_dir / "run.json").is_file():
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "QUANTLAB_CACHE": str(cache)}
        cmd = [sys.executable, "-m", "quantlab", "+precision=fp8", "stop_after=export", f"hydra.run.dir={run_dir}"]
        print(f"$ QUANTLAB_CACHE={cache} {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=scratch, env=env, check=True, capture_output=True, text=True)
    record = json.loads((run_dir / "run.json").read_text())
    return (run_dir / "checkpoint").resolve(), Path(record["artifacts"]["prepare"]["path"])


def cli_audit(checkpoint: Path, reference: Path, canary: bool, out_json: Path) -> dict:
    """One `python -m quantlab.audit` process: exit code, wall seconds, peak RSS (MiB), the report."""
    cmd = [sys.executable, "-m", "quantlab.audit", str(checkpoint), "--reference", str(reference), "--json",
           str(out_json), "--device", "cpu"] + ([] if canary else ["--no-canary"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, _, usage = os.wait4(proc.pid, 0)
    wall = time.time() - start
    proc.communicate()
    report = json.loads(out_json.read_text())
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "report": report}


def healthy_exports(cache: Path, scratch: Path, samples: int, seq_len: int) -> dict[tuple[str, str], Path]:
    from quantlab import api

    out = {}
    for precision in PRECISIONS:
        for kv in ("none", "fp8"):
            run_dir = scratch / f"healthy_{precision}_{kv}"
            if not (run_dir / "checkpoint").exists():
                start = time.time()
                result = api.run([f"+precision={precision}", f"kv_cache={kv}", f"cache_dir={cache}",
                                  "stop_after=export", f"calib.num_samples={samples}", f"calib.seq_len={seq_len}",
                                  "calib.batch_size=4"], run_dir)
                if result.exit_code != 0:
                    raise SystemExit(f"export {precision} kv={kv} failed with exit {result.exit_code}")
                print(f"  exported {precision} kv={kv} in {time.time() - start:.0f} s", flush=True)
            out[(precision, kv)] = (run_dir / "checkpoint").resolve()
    return out


def detection_table(emit, healthy: dict, reference: Path, scratch: Path, names: str = "",
                    with_canary: bool = True) -> None:
    """Every fault (or those named) on a copy of the matching healthy export: detected with the canary, with
    --no-canary, and (file- and tensor-level faults) without the reference."""
    from test_audit import FAULTS, damage, detection

    from quantlab.audit import audit

    faults = [f for f in FAULTS if not names or f.name in names.split(",")]
    faults = [f for f in faults if f.base in healthy]
    emit("## Detection table (each fault on a copy of a healthy default-model export)")
    emit()
    emit("Detected = an error of the fault's own check naming every module it damaged. Columns: with the reference "
         "and the canary; with the reference, `--no-canary`; with neither (file- and tensor-level faults only).")
    emit()
    emit("| fault | real bug | base export | check | with canary | --no-canary | no reference | finding | audit (s) |")
    emit("|---|---|---|---|---|---|---|---|---|")
    hits = {"canary": 0, "no_canary": 0, "no_reference": 0}
    yes = {True: "yes", False: "NO", None: "-"}
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        for fault in faults:
            out = Path(tmp) / fault.name
            damaged = damage(fault, healthy[fault.base], reference, out)
            quick_report = audit(out, reference, canary=False)
            quick = detection(quick_report, fault, damaged)
            full = detection(audit(out, reference), fault, damaged) if with_canary else None
            alone = detection(audit(out, None, canary=False), fault, damaged) if not fault.reference else None
            hits["canary"] += full is not None
            hits["no_canary"] += quick is not None
            hits["no_reference"] += alone is not None
            shown = quick or full
            what = (shown.message[:110] + ("..." if len(shown.message) > 110 else "")) if shown else \
                "; ".join(f"[{f.check}] {f.message[:60]}" for f in quick_report.errors) or "no error"
            emit(f"| {fault.name} | {fault.bug} | {fault.base[0]} kv={fault.base[1]} | {fault.check} | "
                 f"{yes[full is not None] if with_canary else '-'} | {yes[quick is not None]} | "
                 f"{'-' if fault.reference else yes[alone is not None]} | {what.replace('|', '/')} | "
                 f"{quick_report.timings['total']:.1f} |")
            shutil.rmtree(out, ignore_errors=True)
    file_level = sum(1 for f in faults if not f.reference)
    emit(f"\n**Detected: {hits['canary'] if with_canary else '-'}/{len(faults)} with the canary, "
         f"{hits['no_canary']}/{len(faults)} with `--no-canary`, {hits['no_reference']}/{file_level} file- and "
         "tensor-level faults without the reference** (target: all).")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default="/tmp/auditbench_cache")
    ap.add_argument("--scratch", default="/tmp/auditbench_runs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=256)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "audit.md"))
    ap.add_argument("--faults", default="", help="comma-separated fault names of the detection table (default: all)")
    ap.add_argument("--no-canary-column", action="store_true", help="detection table without the canary's column")
    ap.add_argument("--exports", default="", help="detection table only, on these healthy exports: a JSON file "
                    "{\"PRECISION:KV\": CHECKPOINT, ...} (with --reference)")
    ap.add_argument("--reference", default="", help="the reference of --exports")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO / "tests"))
    cache, scratch = Path(args.cache), Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def emit(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    import torch

    from quantlab.audit import audit

    torch.set_num_threads(os.cpu_count() or 1)
    if args.exports:
        named = json.loads(Path(args.exports).read_text())
        healthy = {tuple(k.split(":")): Path(v) for k, v in named.items()}
        emit(f"# Checkpoint audit faults on given exports ({time.strftime('%Y-%m-%d')}, load "
             f"{os.getloadavg()[0]:.1f})")
        emit()
        detection_table(emit, healthy, Path(args.reference), scratch, args.faults, not args.no_canary_column)
        _write(lines, Path(args.out))
        return
    emit(f"# Checkpoint audit on the default model ({time.strftime('%Y-%m-%d')})")
    emit()
    emit(f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared: the load average is given with each "
         f"timing), torch {torch.__version__}, float32 on CPU. "
         f"Command: `HF_HUB_OFFLINE=1 python bench/audit_bench.py --repeats {args.repeats} --calib-samples "
         f"{args.calib_samples} --calib-len {args.calib_len}`.")
    emit()

    # ---- 1. wall time and memory on the default fp8 export
    checkpoint, reference = default_export(cache, scratch)
    emit("## Wall time and memory, default fp8 export")
    emit()
    emit(f"checkpoint `{checkpoint}` (`python -m quantlab +precision=fp8 stop_after=export`), reference "
         f"`{reference}` (the prepare artifact).")
    emit()
    emit("| audit | run | CLI process wall (s) | CLI peak RSS (MiB) | in-process audit() (s) | findings (e/w/i) | "
         "load avg (1 min) |")
    emit("|---|---|---|---|---|---|---|")
    audit(checkpoint, reference, canary=False)  # warm: imports and page cache, as in a pipeline
    for canary in (False, True):
        for i in range(args.repeats):
            cli = cli_audit(checkpoint, reference, canary, scratch / "timing.json")
            start = time.time()
            report = audit(checkpoint, reference, canary=canary)
            inproc = time.time() - start
            s = cli["report"]["summary"]
            emit(f"| {'with canary' if canary else 'no canary'} | {i + 1} | {cli['wall_s']:.1f} | "
                 f"{cli['peak_rss_mib']:.0f} | {inproc:.1f} | {s['error']}/{s['warning']}/{s['info']} | "
                 f"{os.getloadavg()[0]:.1f} |")
        emit(f"\nin-process timings of the last run ({'with' if canary else 'without'} canary): "
             + ", ".join(f"{k} {v:.2f} s" for k, v in report.timings.items()))
        if canary:
            c = report.canary
            emit(f"canary: top-1 {c['top1']:.3f}, KL {c['kl_mean']:.4f}, ppl ratio {c['ppl_ratio']:.3f} over "
                 f"{c['positions']} positions")
        emit()

    # ---- 2. false alarms on healthy exports of every precision
    emit(f"## False alarms: healthy exports of every precision (calibration {args.calib_samples} x "
         f"{args.calib_len} tokens)")
    emit()
    healthy = healthy_exports(cache, scratch, args.calib_samples, args.calib_len)
    healthy[("fp8", "none")] = checkpoint  # the default export itself (full calibration)
    emit("| precision | kv cache | errors | warnings | weight SQNR min-max (dB) | cosine min | gain | canary top-1 | "
         "canary KL | audit (s) |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    false_alarms = 0
    for (precision, kv), ckpt in healthy.items():
        report = audit(ckpt, reference)
        rows = report.layers
        false_alarms += len(report.errors)
        c = report.canary or {}
        emit(f"| {precision} | {kv} | {len(report.errors)} | {len(report.warnings)} | "
             f"{min(r['sqnr_db'] for r in rows):.1f}-{max(r['sqnr_db'] for r in rows):.1f} | "
             f"{min(r['cosine'] for r in rows):.4f} | {min(r['gain'] for r in rows):.3f}-"
             f"{max(r['gain'] for r in rows):.3f} | {c.get('top1', float('nan')):.3f} | "
             f"{c.get('kl_mean') or float('nan'):.4f} | {report.timings['total']:.1f} |")
        for f in report.errors + report.warnings:
            emit(f"|  | {f.severity}: [{f.check}] {f.message[:160]} | | | | | | | | |")
    emit(f"\n**False alarms (error findings on healthy exports): {false_alarms}** (target 0), "
         f"{len(healthy)} exports.")
    emit()

    # ---- 3. detection table
    detection_table(emit, healthy, reference, scratch, args.faults, not args.no_canary_column)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    emit(f"\nBench process peak RSS {peak:.0f} MiB.")
    _write(lines, Path(args.out))


def _write(lines: list[str], out_md: Path) -> None:
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {out_md}")


if __name__ == "__main__":
    main()
