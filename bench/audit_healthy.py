"""Healthy-export statistics: the distribution of every audit statistic over many healthy exports, the ground the
audit's bounds stand on (quantlab.precisions: AuditBounds; the table in bench/RESULTS.md and docs/audit.md).

A cell is one healthy export: a model (the default SmolLM2-135M, or a tiny trained model of a family of the test
matrix, tests/_builders.py: build_family), a precision, a KV cache format, a calibration size (samples x tokens)
and a calibration seed (calib.seed draws other windows). Each export is made by quantlab's own pipeline up to the
export (the artifact cache keeps it), then audited with the reference and the canary; every statistic the audit
computes is recorded (per-layer weight cosine / SQNR / gain, activation-scale ratios, KV-scale ratios, canary top-1
and KL), with the findings. False alarms = error findings on these healthy exports (target 0).

    # build the exports of a grid (long: run niced, one at a time), then audit them all
    HF_HUB_OFFLINE=1 nice -n 10 python bench/audit_healthy.py build --grid default --out /tmp/af/healthy
    HF_HUB_OFFLINE=1 nice -n 10 python bench/audit_healthy.py build --grid families --out /tmp/af/healthy
    HF_HUB_OFFLINE=1 python bench/audit_healthy.py measure --out /tmp/af/healthy     # -> stats.json
    python bench/audit_healthy.py table --out /tmp/af/healthy [--extra other/stats.json]  # -> healthy.md

Grids: `default` = SmolLM2-135M x {fp8 + FP8 KV, int8_sq, fp8_pc_pt, w4a8_awq, int4_awq (, nvfp4 with --nvfp4)} x
{8 x 256, 32 x 512} x seeds {0, 1, 2}; `families` = every family of tests/conftest.py x {fp8 + FP8 KV, fp8_pc_pt,
int8_sq, int4_awq, w4a8_awq, nvfp4} x {4 x 64 (the test suite's calibration) seeds 0-2, 8 x 256 seeds 0-1, 32 x 256
seed 0}, each family with the precisions quantlab verifies for it (Mixtral / Qwen3-MoE: fp8, int4_awq, nvfp4).
NVFP4 is calibrated on the CPU where the GPU lacks its GEMMs (quantlab refuses it there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_PRECISIONS = (("int8_sq", "none"), ("fp8", "fp8"), ("w4a8_awq", "none"), ("fp8_pc_pt", "none"),
                      ("int4_awq", "none"))
FAMILY_PRECISIONS = (("fp8", "fp8"), ("int8_sq", "none"), ("int4_awq", "none"), ("w4a8_awq", "none"),
                     ("fp8_pc_pt", "none"), ("nvfp4", "none"))


def default_grid(seeds=(0, 1, 2), sizes=((8, 256), (32, 512)), precisions=DEFAULT_PRECISIONS) -> list[dict]:
    """The default model's cells, most informative first (the smallest calibration, then the default)."""
    cells = []
    for samples, seq_len in sizes:
        for precision, kv in precisions:
            for seed in seeds:
                cells.append({"model": "smollm2_135m", "precision": precision, "kv": kv, "samples": samples,
                              "seq_len": seq_len, "seed": seed})
    return cells


# the tiny models' calibrations: the test suite's (tests/conftest.py FAST: 4 x 64) up to their context (256)
FAMILY_SIZES = ((4, 64, (0, 1, 2)), (8, 256, (0, 1)), (32, 256, (0,)))


def family_grid(families: list[str], sizes=FAMILY_SIZES) -> list[dict]:
    """The tiny family models' cells: (samples, tokens, seeds) per calibration size, the precisions quantlab
    verifies for the family (quantlab.families: MoE models take fp8, int4_awq and nvfp4)."""
    from quantlab.families import FAMILIES

    cells = []
    for family in families:
        for samples, seq_len, seeds in sizes:
            for precision, kv in FAMILY_PRECISIONS:
                if precision not in FAMILIES[family].precisions:
                    continue
                for seed in seeds:
                    cells.append({"model": family, "precision": precision, "kv": kv, "samples": samples,
                                  "seq_len": seq_len, "seed": seed})
    return cells


def cell_id(cell: dict) -> str:
    """A file-name-safe id of a cell."""
    return (f"{cell['model']}__{cell['precision']}__kv-{cell['kv']}__{cell['samples']}x{cell['seq_len']}"
            f"__s{cell['seed']}")


def family_model(name: str, root: Path) -> Path:
    """The tiny trained model of a family (tests/_builders.py's build_family), built once under root."""
    sys.path.insert(0, str(REPO / "tests"))
    from _builders import build_family, train_tokenizer

    tok = root / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        train_tokenizer(tok)
    out = root / "models" / name
    if not (out / "config.json").is_file():
        build_family(name, out, tok)
    return out


def _cuda_below_blackwell() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() < (10, 0)


def build_export(cell: dict, cache: Path, models_root: Path, device: str | None = None) -> dict:
    """Make (or find in the cache) one cell's export up to the export step; its checkpoint and reference paths."""
    from quantlab.compose import compose
    from quantlab.graph import Executor, steps_for
    from quantlab.pipeline import context

    overrides = [f"+precision={cell['precision']}", f"kv_cache={cell['kv']}", f"cache_dir={cache}",
                 "stop_after=export", f"calib.num_samples={cell['samples']}", f"calib.seq_len={cell['seq_len']}",
                 f"calib.seed={cell['seed']}", f"calib.batch_size={min(16, cell['samples'])}"]
    if cell["precision"] == "nvfp4" and _cuda_below_blackwell():
        device = "cpu"  # quantlab refuses NVFP4 on GPUs without its GEMMs: ModelOpt calibrates it on the CPU
    if device:
        overrides.append(f"model.device={device}")
    if cell["model"] != "smollm2_135m":
        overrides.append(f"model.path={family_model(cell['model'], models_root)}")
        if "awq" in cell["precision"]:
            overrides.append("precision.block_size=32")
    cfg = compose(overrides)[0]
    ctx = context(cfg)
    run = Executor(ctx, [s for s in steps_for(ctx) if s.name != "audit"])
    start = time.time()
    export = run.value("export")
    return {"checkpoint": str(export.path), "reference": str(run.value("prepare").path),
            "seconds": round(time.time() - start, 1), "overrides": overrides}


def cmd_build(args) -> None:
    """Build every cell of the grid not built yet; cells.json records each one's checkpoint."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    part, parts = (int(x) for x in args.shard.split("/"))
    index_file = out / ("cells.json" if parts == 1 else f"cells-{part}.json")
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    families = args.families.split(",") if args.families else None
    seeds = tuple(int(x) for x in args.seeds.split(","))
    sizes = tuple(tuple(int(v) for v in x.split("x")) for x in args.sizes.split(",")) if args.sizes else None
    if args.grid == "default":
        extra = (("nvfp4", "none"),) if args.nvfp4 else ()
        cells = default_grid(seeds, sizes or ((8, 256), (32, 512)), DEFAULT_PRECISIONS + extra)
    else:
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import _family_configs

        grid = tuple((n, t, seeds) for n, t in sizes) if sizes else FAMILY_SIZES
        cells = family_grid(families or sorted(_family_configs()), grid)
    if args.precisions:
        cells = [c for c in cells if c["precision"] in args.precisions.split(",")]
    cache = Path(args.cache).expanduser()
    for cell in cells[part::parts]:
        cid = cell_id(cell)
        if cid in index and "checkpoint" in index[cid]:
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {cid} ...", flush=True)
        try:
            made = build_export(cell, cache, out, args.device)
        except Exception as exc:  # noqa: BLE001 - a cell that cannot be made is recorded, the grid goes on
            index[cid] = {**cell, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
            traceback.print_exc()
        else:
            index[cid] = {**cell, **made}
            print(f"    {made['seconds']} s -> {made['checkpoint']}", flush=True)
        index_file.write_text(json.dumps(index, indent=1))


def audit_cell(entry: dict, device: str, canary: bool = True) -> dict:
    """Audit one built cell with its reference: every statistic, the findings, the timings."""
    from quantlab.audit import audit

    start = time.time()
    report = audit(entry["checkpoint"], entry["reference"], canary=canary, device=device)
    return {"device": device, "seconds": round(time.time() - start, 2), "timings": report.timings,
            "cpu_timings": report.cpu_timings,
            "layers": [{k: r[k] for k in ("module", "format", "cosine", "sqnr_db", "gain", "column_spread", "fold")}
                       for r in report.layers],
            "activations": [{k: r[k] for k in ("module", "kind", "format", "ratio", "loss_db", "sqnr_db")}
                            for r in report.activations],
            "canary": report.canary,
            "findings": [{"severity": f.severity, "check": f.check, "message": f.message[:300],
                          "modules": f.modules[:6]} for f in report.findings if f.severity != "info"]}


def _measure_one(args: tuple) -> tuple[str, dict]:
    cid, entry, device, threads = args
    import torch

    torch.set_num_threads(threads)
    try:
        return cid, audit_cell(entry, device)
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        return cid, {"device": device, "failed": f"{type(exc).__name__}: {str(exc)[:300]}"}


def cmd_measure(args) -> None:
    """Audit every built cell not audited yet on this device; stats.jsonl gets one line per (cell, device)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    out = Path(args.out)
    index = {}
    for file in sorted(out.glob("cells*.json")):  # cells.json, or the shards' cells-N.json
        index.update(json.loads(file.read_text()))
    stats_file = out / args.stats
    done = set()
    if stats_file.is_file():
        for line in stats_file.read_text().splitlines():
            row = json.loads(line)
            done.add((row["cell"], row["audit"]["device"]))
    todo = [(cid, e, args.device, args.threads) for cid, e in index.items()
            if "checkpoint" in e and (cid, args.device) not in done]
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool, open(stats_file, "a") as f:
        for cid, result in pool.map(_measure_one, todo):
            f.write(json.dumps({"cell": cid, **{k: index[cid][k] for k in ("model", "precision", "kv", "samples",
                                                                           "seq_len", "seed")},
                                "audit": result}) + "\n")
            f.flush()
            errors = [x for x in result.get("findings", []) if x["severity"] == "error"]
            print(f"[{time.strftime('%H:%M:%S')}] {cid} {args.device}: {result.get('seconds')} s, "
                  f"{len(errors)} error(s){' ' + result['failed'] if 'failed' in result else ''}", flush=True)


def cmd_models(args) -> None:
    """Build every family's tiny model once (before parallel builders share them)."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import _family_configs

    for name in sorted(_family_configs()):
        start = time.time()
        family_model(name, Path(args.out))
        print(f"{name}: {time.time() - start:.1f} s", flush=True)


BOUND_PHRASES = ("cover too little", "far larger than the activations", "dequantize", "scaled by a constant factor",
                 "scaled by more than", "match the reference only after", "logits diverge",
                 "further from the reference")


def _quantiles(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"n": 0}

    def q(p: float) -> float:
        return values[min(len(values) - 1, max(0, round(p * (len(values) - 1))))]

    return {"n": len(values), "min": values[0], "p1": q(0.01), "p5": q(0.05), "p50": q(0.5), "p95": q(0.95),
            "p99": q(0.99), "max": values[-1]}


def _statistics(rows: list[dict]) -> dict[str, dict[str, list[float]]]:
    """format -> statistic -> healthy values (per layer, per activation / KV row, per export for the canary)."""
    out: dict[str, dict[str, list[float]]] = {}

    def put(fmt: str, stat: str, value) -> None:
        if value is not None:
            out.setdefault(fmt, {}).setdefault(stat, []).append(value)

    for row in rows:
        a = row["audit"]
        if "failed" in a:
            continue
        for layer in a["layers"]:
            put(layer["format"], "weight_sqnr_db", layer["sqnr_db"])
            put(layer["format"], "weight_cosine", layer["cosine"])
            put(layer["format"], "weight_gain_dev", abs(layer["gain"] - 1))
            put(layer["format"], "weight_column_spread", layer.get("column_spread"))
        for act in a["activations"]:
            fmt = act["format"] if act["kind"] == "input" else f"KV {act['format']}"
            put(fmt, "act_loss_db", _loss(act))
            put(fmt, "act_ratio", act.get("ratio"))
        if a.get("canary"):
            put(PRECISION_ALGO.get(row["precision"], row["precision"]), "canary_top1", a["canary"]["top1"])
            put(PRECISION_ALGO.get(row["precision"], row["precision"]), "canary_kl_mean", a["canary"]["kl_mean"])
    return out


def _loss(act: dict) -> float | None:
    """A row's SQNR loss as the audit defines it now: 0 where the stored scale covers max |x| (rows measured before
    that definition compared with max |x| / qmax there too)."""
    ratio = act.get("ratio")
    return 0.0 if ratio is not None and ratio <= 1 else act.get("loss_db")


def _false_alarms(row: dict) -> list[str]:
    """The cell's error findings under the bounds in the code now: bound checks recomputed from the recorded
    statistics (so bounds can be set after measuring), other errors as recorded."""
    from quantlab.audit.bounds import GAIN_ERROR, activation_bounds, canary_bounds, kv_bounds, weight_bounds

    a = row["audit"]
    if "failed" in a:
        return [f"audit failed: {a['failed']}"]
    out = [f"[{f['check']}] {f['message'][:120]}" for f in a["findings"]
           if f["severity"] == "error" and not any(p in f["message"] for p in BOUND_PHRASES)]
    for layer in a["layers"]:
        b = weight_bounds(layer["format"])
        if (layer["cosine"] < b.cosine_error or layer["sqnr_db"] < b.sqnr_error_db or abs(layer["gain"] - 1) >
                GAIN_ERROR or (layer.get("column_spread") or 0) > b.column_spread_error):
            out.append(f"[weights] {layer['module']} sqnr {layer['sqnr_db']} spread {layer.get('column_spread')}")
    by_format: dict[tuple, list[float]] = {}
    for act in a["activations"]:
        b = kv_bounds(act["format"]) if act["kind"] != "input" else activation_bounds(act["format"])
        loss = _loss(act)
        ratio = act.get("ratio")
        if b is None or loss is None or ratio is None:
            continue
        by_format.setdefault((act["kind"] == "input", act["format"]), []).append(loss)
        if loss > b.clip_error_db or (ratio < 1 and ratio < b.waste_ratio_error):
            out.append(f"[activations] {act['module']} {act['kind']} loss {loss} ratio {ratio}")
    for (is_input, fmt), losses in by_format.items():
        b = activation_bounds(fmt) if is_input else kv_bounds(fmt)
        if statistics.median(losses) > b.clip_median_error_db:
            out.append(f"[activations] median {fmt} loss {statistics.median(losses):.2f}")
    c = a.get("canary")
    if c:
        b = canary_bounds({PRECISION_ALGO.get(row["precision"], row["precision"])})
        if c["top1"] < b.top1_error or (c["kl_mean"] or 1e9) > b.kl_error:
            out.append(f"[canary] top1 {c['top1']:.3f} kl {c['kl_mean']}")
    return out


PRECISION_ALGO = {"fp8": "FP8", "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN", "int8_sq": "W8A8_SQ_PER_CHANNEL",
                  "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ", "nvfp4": "NVFP4"}


def cmd_table(args) -> None:
    """Distributions of every statistic per format and group (default model / families), false alarms under the
    bounds in the code now, as Markdown (healthy.md) and JSON (healthy.json) beside the stats."""
    rows = []
    for file in args.stats:
        rows += [json.loads(line) for line in Path(file).read_text().splitlines() if line.strip()]
    groups = {"default model": [r for r in rows if r["model"] == "smollm2_135m"],
              "tiny families": [r for r in rows if r["model"] != "smollm2_135m"]}
    lines, doc = [], {"cells": len(rows), "groups": {}}
    for group, members in groups.items():
        if not members:
            continue
        stats = _statistics(members)
        alarms = {r["cell"]: _false_alarms(r) for r in members}
        alarms = {k: v for k, v in alarms.items() if v}
        doc["groups"][group] = {"cells": len(members), "false_alarms": alarms,
                                "statistics": {f: {k: _quantiles(v) for k, v in d.items()} for f, d in stats.items()}}
        lines += [f"### {group}: {len(members)} healthy exports, {len(alarms)} with an error finding", "",
                  "| format | statistic | n | min | p1 | p5 | median | p95 | p99 | max |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for fmt in sorted(stats):
            for stat in sorted(stats[fmt]):
                q = _quantiles(stats[fmt][stat])
                lines.append(f"| {fmt} | {stat} | {q['n']} | " + " | ".join(
                    f"{q[k]:.4g}" for k in ("min", "p1", "p5", "p50", "p95", "p99", "max")) + " |")
        lines.append("")
        for cell, found in sorted(alarms.items()):
            lines.append(f"- false alarm {cell}: " + "; ".join(found[:3]))
        lines.append("")
    out = Path(args.out)
    (out / "healthy.md").write_text("\n".join(lines) + "\n")
    (out / "healthy.json").write_text(json.dumps(doc, indent=1))
    print("\n".join(lines))


def cmd_bounds(_args) -> None:
    """Every precision's and KV format's audit bounds, from the registry, as a Markdown table (docs/audit.md)."""
    from quantlab.precisions import KV_FORMATS, PRECISIONS

    print("| precision | weights: cosine / SQNR error (warn) / column spread error (warn) | canary: top-1 error "
          "(warn) / KL error (warn) | activations: clip loss per layer error (warn) and reach ratio / median error / "
          "wasted-range ratio error (warn) |")
    print("|---|---|---|---|")
    for name, p in PRECISIONS.items():
        if p.audit is None:
            print(f"| {name} | each layer by its own format's bounds | the loosest of its formats | per format |")
            continue
        w, c, act = p.audit.weights, p.audit.canary, p.audit.activations
        acts = (f"{act.clip_error_db:g} dB ({act.clip_warn_db:g}) and > {act.clip_ratio_error:g}x / "
                f"{act.clip_median_error_db:g} dB / "
                f"{act.waste_ratio_error:.3g} ({act.waste_ratio_warn:.3g})") if act else "no static scale"
        print(f"| {name} | {w.cosine_error:g} / {w.sqnr_error_db:g} dB ({w.sqnr_warn_db:g}) / "
              f"{w.column_spread_error:g} ({w.column_spread_warn:g}) | {c.top1_error:g} ({c.top1_warn:g}) / "
              f"{c.kl_error:g} ({c.kl_warn:g}) | {acts} |")
    for name, kv in KV_FORMATS.items():
        if kv.audit is not None:
            b = kv.audit
            print(f"| KV cache {name} | - | - | {b.clip_error_db:g} dB ({b.clip_warn_db:g}) and > "
                  f"{b.clip_ratio_error:g}x / "
                  f"{b.clip_median_error_db:g} dB / {b.waste_ratio_error:.3g} ({b.waste_ratio_warn:.3g}) |")


def main() -> None:
    """Command line: models | build | measure | table | bounds."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--grid", choices=("default", "families"), required=True)
    b.add_argument("--families", default="")
    b.add_argument("--precisions", default="")
    b.add_argument("--seeds", default="0,1,2")
    b.add_argument("--device", default="", help="model.device for the calibration (default: quantlab's auto)")
    b.add_argument("--sizes", default="", help="SAMPLESxLEN,...: calibration sizes (default: the grid's)")
    b.add_argument("--nvfp4", action="store_true", help="default grid: nvfp4 too (ModelOpt calibrates it on CUDA)")
    b.add_argument("--shard", default="0/1", help="i/n: build every n-th cell from the i-th (parallel builders)")
    b.add_argument("--out", required=True)
    b.add_argument("--cache", default=os.environ.get("QUANTLAB_CACHE", "~/.cache/quantlab"))
    sub.add_parser("models").add_argument("--out", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--device", default="cpu")
    m.add_argument("--jobs", type=int, default=1)
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--stats", default="stats.jsonl")
    t = sub.add_parser("table")
    t.add_argument("--out", required=True)
    t.add_argument("stats", nargs="+", help="stats.jsonl files of measure")
    sub.add_parser("bounds")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    {"models": cmd_models, "build": cmd_build, "measure": cmd_measure, "table": cmd_table,
     "bounds": cmd_bounds}[args.cmd](args)


if __name__ == "__main__":
    main()
