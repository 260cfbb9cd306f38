"""The run, top to bottom: preflight, prepare, data, quantize, export, build, evaluate, gate, report."""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

from quantlab import costs, preflight
from quantlab.artifacts import ArtifactStore, write_json_atomic
from quantlab.config import Config
from quantlab.env import git_commit, resolve_device, resolve_dtype, versions
from quantlab.errors import EXIT_GATE_FAILED, EXIT_OK
from quantlab.precisions import describe, kv_quant_algo, modelopt_config, spec_for
from quantlab.stages import build, data, evaluate, export, gate, prepare, quantize, report

log = logging.getLogger("quantlab")


class Timer:
    def __init__(self):
        self.stages: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        start = time.time()
        try:
            yield
        finally:
            self.stages[name] = round(self.stages.get(name, 0.0) + time.time() - start, 3)


def run_pipeline(cfg: Config, run_dir: Path, config_snapshot: dict, argv: list[str]) -> int:
    start = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    timer = Timer()
    record: dict = {"argv": argv, "config": config_snapshot, "versions": versions(), "git_commit": git_commit()}

    # ---- preflight: everything checkable before a forward pass
    with timer.stage("preflight"):
        preflight.check_config(cfg)
        store = ArtifactStore(cfg.cache_dir)
        device = resolve_device(cfg.model.device)
        dtype = resolve_dtype(cfg.model.dtype, device)
        preflight.check_device(cfg, device)
    record["device"] = device.describe()
    log.info("quantlab %s kv=%s engine=%s on %s (%s, %s), cache %s", cfg.precision.name, cfg.kv_cache.dtype,
             cfg.engine.name, device.name, device.arch, str(dtype).removeprefix("torch."), store.root)

    with timer.stage("prepare"):
        ref = prepare.run(cfg.model, store)
        preflight.check_lengths(cfg, ref.max_positions)
        block = preflight.check_block_size(cfg, ref.path, ref.preferred_awq_block, ref.trust_remote_code)
        limits = build.limits_for(cfg.engine, ref.max_positions)
        limits.check(cfg.eval.batch_size, cfg.eval.seq_len)
        if cfg.eval.gen_prompts and cfg.eval.gen_tokens:
            limits.check(min(cfg.eval.gen_prompts, cfg.eval.batch_size), cfg.eval.gen_prompt_len, cfg.eval.gen_tokens)
        tokenizer = prepare.load_tokenizer(ref)
    record["model"] = ref.describe()
    record["engine"] = {"name": cfg.engine.name, "limits": limits.describe()}

    with timer.stage("data"):
        calib = data.run(cfg.calib, "calib", ref.fingerprint, tokenizer, store)
        evalset = data.run(cfg.eval, "eval", ref.fingerprint, tokenizer, store)
    record["data"] = {"calib": {"fingerprint": calib.fingerprint, **calib.info},
                      "eval": {"fingerprint": evalset.fingerprint, **evalset.info}}
    provenance = {"model_fingerprint": ref.fingerprint, "eval_fingerprint": evalset.fingerprint,
                  "calib_fingerprint": calib.fingerprint, "versions": versions(), "git_commit": git_commit(),
                  "device": device.describe(), "dtype": str(dtype).removeprefix("torch."), "config": config_snapshot,
                  "argv": argv}
    if cfg.gate.baseline:
        gate.load_baseline(cfg.gate.baseline, provenance)  # refuse a mismatched baseline before any compute
    if cfg.stop_after in ("prepare", "data"):
        return _finish(record, run_dir, timer, store, start, EXIT_OK, f"stopped after {cfg.stop_after}")

    # ---- quantize + export (cached; the export alone is enough for a rerun)
    spec = spec_for(cfg.precision)
    req = quantize.QuantizeRequest(describe(cfg.precision, cfg.kv_cache, block),
                                   modelopt_config(cfg.precision, cfg.kv_cache, block), cfg.calib.batch_size)
    qkey = quantize.key(store, ref, calib, req, device, dtype)
    calib_tokens, eval_tokens = calib.num_windows * calib.seq_len, evalset.num_windows * evalset.seq_len
    work = costs.run_work(cfg, device, ref.num_params, calib_tokens, eval_tokens)
    ekey = export.key(store, qkey)
    record["recipe"] = req.recipe
    record["artifacts"] = {"prepare": {"path": str(ref.path), "fingerprint": ref.fingerprint}}
    live: dict = {}

    def quantized(fresh_copy: bool = False):
        """The calibrated fake-quant model: calibrated here, or restored from the cached state."""
        with timer.stage("quantize"):
            qart, model = quantize.run(store, qkey, ref, calib, req, device, dtype, cfg.model.device_map,
                                       cost=work["quantize"])
        record["artifacts"]["quantize"] = {"path": str(qart.path), "fingerprint": qart.fingerprint, **qart.info}
        if model is not None and not fresh_copy:
            return model
        return quantize.restore(qart, ref, device, dtype, cfg.model.device_map)

    def checkpoint():
        if "ckpt" not in live:
            with timer.stage("export"):
                ckpt = store.load("export", ekey) if not cfg.engine.checkpoint else \
                    export.external(cfg.engine.checkpoint, spec.quant_algo, kv_quant_algo(cfg.kv_cache))
                if ckpt is None:
                    ckpt = export.run(store, ekey, quantized, ref, spec.quant_algo, kv_quant_algo(cfg.kv_cache),
                                      cost=work["export"])
                else:
                    store.events.append(("export", ekey, "reused"))
                    log.info("export: reusing %s (no calibration needed)", ckpt.path)
            record["artifacts"]["export"] = {"path": str(ckpt.path), "fingerprint": ckpt.fingerprint, **ckpt.info}
            _link(run_dir / "checkpoint", ckpt.path)
            live["ckpt"] = ckpt
        return live["ckpt"]

    if cfg.stop_after == "quantize":
        quantized()
        return _finish(record, run_dir, timer, store, start, EXIT_OK, "stopped after quantize")
    if cfg.engine.name != "reference":
        checkpoint()
    if cfg.stop_after == "export":
        return _finish(record, run_dir, timer, store, start, EXIT_OK, f"exported {live['ckpt'].info['quant_algo']} checkpoint")

    # ---- reference outputs (once per model x data x seq_len), then the candidate engine(s)
    ctx = build.BuildContext(ref, device, dtype, cfg.model.device_map, lambda: quantized(fresh_copy=True), checkpoint, store)
    with timer.stage("reference"):
        rkey = evaluate.reference_key(store, ref.fingerprint, evalset, cfg.eval, device, dtype)
        ref_art = evaluate.reference(store, rkey, evalset, cfg.eval,
                                     lambda: build.build("reference", cfg.engine, ctx, limits), cost=work["reference"])
    record["artifacts"]["reference"] = {"path": str(ref_art.path), **ref_art.info}
    if cfg.stop_after == "build":
        with timer.stage(f"build:{cfg.engine.name}"):
            build.build(cfg.engine.name, cfg.engine, ctx, limits).close()
        return _finish(record, run_dir, timer, store, start, EXIT_OK, f"built the {cfg.engine.name} engine")

    results, evaluated_now = {}, {}
    for name in evaluate.candidate_engines(cfg):
        with timer.stage(f"evaluate:{name}"):
            candidate = evaluate.candidate_identity(name, cfg.engine, ref.fingerprint, qkey,
                                                    lambda: checkpoint().fingerprint)
            key = evaluate.evaluation_key(store, name, candidate, rkey, cfg.eval, limits.describe(), device, dtype)
            log.info("evaluate: %s vs reference on %d windows x %d tokens", name, evalset.num_windows, evalset.seq_len)
            results[name], evaluated_now[name] = evaluate.evaluate_cached(
                store, key, lambda name=name: build.build(name, cfg.engine, ctx, limits), ref_art, evalset, cfg.eval,
                tokenizer, cost=costs.run_work(cfg, device, ref.num_params, calib_tokens, eval_tokens, name)["evaluate"])
    result = results[cfg.engine.name]
    attribution = _attribution(results, cfg.engine.name) if len(results) > 1 else None

    # ---- gate + report
    with timer.stage("gate"):
        verdict = gate.run(cfg.gate, cfg.precision.name, result.metrics, result.windows, provenance)
    run_info = {"precision": cfg.precision.name, "kv_cache": cfg.kv_cache.dtype, "engine": cfg.engine.name,
                "model": ref.name, "recipe": req.recipe, "run_dir": str(run_dir),
                "eval": {"windows": evalset.num_windows, "seq_len": evalset.seq_len, "source": evalset.info["source"],
                         "topk": cfg.eval.topk},
                "checkpoint": record["artifacts"].get("export"),
                "reference_forward_batches": ref_art.info.get("forward_batches", 0)
                if ("reference", rkey, "built") in store.events else 0,
                "candidate_forward_batches": result.forward_batches if evaluated_now[cfg.engine.name] else 0}
    doc = report.metrics_document(run_info, result, verdict, provenance, attribution)
    with timer.stage("report"):
        from quantlab.report import write_run_reports

        ckpt_path = live["ckpt"].path if "ckpt" in live else None
        doc["weight_error"] = write_run_reports(run_dir, doc, result.kl_values, ckpt_path, ref.path)
        report.write_metrics(run_dir, doc)
        report.write_junit(run_dir, doc)
    print(report.console_table(doc))
    code = EXIT_OK if verdict["passed"] else EXIT_GATE_FAILED
    m = result.metrics
    what = (f"{cfg.precision.name} kv={cfg.kv_cache.dtype} on {ref.name}: {'PASS' if verdict['passed'] else 'FAIL'} "
            f"(top-1 {m['top1_agreement']['value']:.3f}, ppl ratio {m['ppl_ratio']['value']:.3f}, "
            f"KL {m['kl_mean']['value']:.4f})")
    return _finish(record, run_dir, timer, store, start, code, what)


def _attribution(results: dict, engine: str) -> dict:
    """Split the loss three ways: quantization itself (HF -> fake-quant), export (fake-quant -> fake-quant with
    the transformations export applies), engine numerics (as exported -> the engine running the checkpoint)."""
    chain = ["fakequant", "fakequant_exported", engine]
    steps = {"quantization": (None, "fakequant"), "export": ("fakequant", "fakequant_exported"),
             "engine": ("fakequant_exported", engine)}

    def loss(name, metric):  # how much worse than the reference, in the metric's own units
        value = results[name].metrics[metric]["value"]
        return 1.0 - value if metric == "top1_agreement" else value

    out = {}
    for metric in ("dnll_mean", "top1_agreement", "kl_mean"):
        out[metric] = {name: results[name].metrics[metric]["value"] for name in chain}
        for step, (a, b) in steps.items():
            out[metric][step] = loss(b, metric) - (loss(a, metric) if a else 0.0)

    def agree(a, b):
        return float((results[a].argmax == results[b].argmax).mean())

    return {"engine": engine, "metrics": out,
            "engine_vs_fakequant_top1": agree(engine, "fakequant"),
            "engine_vs_exported_top1": agree(engine, "fakequant_exported"),
            "exported_jitter_floor_top1": agree("fakequant_exported", "fakequant_jitter"),
            "note": "losses vs the reference (top-1 as disagreement 1 - agreement): quantization = fake-quant; "
                    "export = fake-quant after export's re-smoothing minus fake-quant; engine = the engine minus that. "
                    "exported_jitter_floor_top1 = the as-exported model vs itself under input noise of rounding size "
                    "(relative max(1e-6, the compute dtype's eps)): "
                    "the best agreement any implementation that is not bit-identical can reach on this model"}


def _link(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _finish(record: dict, run_dir: Path, timer: Timer, store: ArtifactStore, start: float, code: int, what: str) -> int:
    record["stage_seconds"] = timer.stages
    record["events"] = [{"stage": s, "key": k, "action": a} for s, k, a in store.events]
    record["wall_time_s"] = round(time.time() - start, 2)
    record["exit_code"] = code
    write_json_atomic(run_dir / "run.json", record)
    print(f"quantlab: {what} in {record['wall_time_s']:.1f} s -> {run_dir}")
    return code
