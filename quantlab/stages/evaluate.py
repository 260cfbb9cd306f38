"""evaluate: reference (HF, unquantized) vs candidate on the same windows, streamed batch by batch.

The reference's per-position outputs (target NLL, argmax, top-k log-probs) are an artifact keyed by
(model, eval data, dtype, device type, top-k, generation settings): computed once, reused by every precision
of a sweep. Nothing of size [all tokens x vocab] is ever held: one batch of logits at a time.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantlab import costs, metrics
from quantlab.artifacts import Artifact, ArtifactStore, Built
from quantlab.config import EvalConfig
from quantlab.engines.registry import ENGINES, EngineSpec
from quantlab.env import versions
from quantlab.errors import QuantlabError
from quantlab.stages.data import TokenSet
from quantlab.step import RunContext, Step, limits_for

log = logging.getLogger("quantlab")
REF_FILE = "reference.safetensors"


@dataclass
class EvalResult:
    engine: str
    metrics: dict
    windows: dict  # per-window arrays (lists) for CIs, plots and baseline comparison
    positions: dict  # per-position means along the window (plots)
    kl_values: np.ndarray = field(repr=False)  # every predicted position's KL (distribution plot)
    generation: dict | None = None
    argmax: np.ndarray | None = field(default=None, repr=False)  # [windows, positions] candidate predictions
    forward_batches: int = 0
    seconds: float = 0.0
    computed_now: bool = False  # evaluated in this run (not read from the store)


def _oom_guard(fn, batch_size: int):
    import torch

    try:
        return fn()
    except torch.OutOfMemoryError:
        raise QuantlabError(f"out of memory evaluating a batch of {batch_size} windows",
                            fix=f"lower eval.batch_size to {max(1, batch_size // 2)}") from None
    except RuntimeError as exc:
        if "out of memory" in str(exc).lower() or "can't allocate memory" in str(exc).lower():
            raise QuantlabError(f"out of memory evaluating a batch of {batch_size} windows",
                                fix=f"lower eval.batch_size to {max(1, batch_size // 2)}") from None
        raise


def _prompts(evalset: TokenSet, cfg: EvalConfig):
    n = min(cfg.gen_prompts, evalset.num_windows)
    return evalset.tokens[:n, : cfg.gen_prompt_len] if n and cfg.gen_tokens else None


# --------------------------------------------------------------------------------------- reference
def reference_key(store: ArtifactStore, model_fp: str, data_fp: str, cfg: EvalConfig, device, dtype) -> str:
    return store.key("reference", model=model_fp, data=data_fp, dtype=str(dtype), device=device.type,
                     metrics=metrics.FORMULA_VERSION,
                     topk=cfg.topk, gen=[cfg.gen_prompts, cfg.gen_prompt_len, cfg.gen_tokens], versions=versions())


def write_reference(out: Path, engine, evalset: TokenSet, cfg: EvalConfig) -> dict:
    """The reference engine's per-position outputs over every window (reference.safetensors in out)."""
    import torch
    from safetensors.torch import save_file

    w, t = evalset.num_windows, evalset.seq_len - 1
    k = cfg.topk
    arrays = {"nll": torch.empty(w, t), "argmax": torch.empty(w, t, dtype=torch.int32),
              "topk_lp": torch.empty(w, t, k), "topk_idx": torch.empty(w, t, k, dtype=torch.int32)}
    start = time.time()
    for lo in range(0, w, cfg.batch_size):
        batch = evalset.tokens[lo: lo + cfg.batch_size]
        logits = _oom_guard(lambda: engine.logits(batch), cfg.batch_size)
        stats = metrics.PositionStats(logits, batch[:, 1:].to(logits.device))
        top_lp, top_idx = stats.topk(k)
        hi = lo + batch.shape[0]
        arrays["nll"][lo:hi], arrays["argmax"][lo:hi] = stats.nll.cpu(), stats.argmax.cpu().int()
        arrays["topk_lp"][lo:hi], arrays["topk_idx"][lo:hi] = top_lp.cpu(), top_idx.cpu().int()
        del logits, stats
        log.info("  reference windows %d/%d (%.1f s)", hi, w, time.time() - start)
    prompts = _prompts(evalset, cfg)
    if prompts is not None:
        arrays["gen"] = engine.greedy(prompts, cfg.gen_tokens).cpu()
    save_file({k_: v.contiguous() for k_, v in arrays.items()}, str(out / REF_FILE))
    info = {"forward_batches": engine.forward_batches, "seconds": round(time.time() - start, 2)}
    engine.close()
    return info


# ---------------------------------------------------------------------------------------- candidate
def compare(engine, ref_art: Artifact, evalset: TokenSet, cfg: EvalConfig, tokenizer=None) -> EvalResult:
    from safetensors import safe_open

    w, t = evalset.num_windows, evalset.seq_len - 1
    sums = {k: np.zeros(w) for k in ("nll_ref", "nll_cand", "agree", "kl")}
    sums["n_pred"] = np.full(w, t)
    agree_pos, kl_pos = np.zeros((w, t), dtype=np.float32), np.zeros((w, t), dtype=np.float32)
    cand_argmax = np.zeros((w, t), dtype=np.int32)
    start = time.time()
    tail_total = 0.0
    with safe_open(str(ref_art.path / REF_FILE), "pt") as ref:
        for lo in range(0, w, cfg.batch_size):
            batch = evalset.tokens[lo: lo + cfg.batch_size]
            hi = lo + batch.shape[0]
            logits = _oom_guard(lambda: engine.logits(batch), cfg.batch_size)
            dev = logits.device
            stats = metrics.PositionStats(logits, batch[:, 1:].to(dev))
            nll, am = stats.nll, stats.argmax
            r_nll = ref.get_slice("nll")[lo:hi].to(dev)
            r_am = ref.get_slice("argmax")[lo:hi].to(dev)
            r_lp = ref.get_slice("topk_lp")[lo:hi].to(dev)
            r_idx = ref.get_slice("topk_idx")[lo:hi].to(dev)
            kl = metrics.topk_kl(r_lp, stats.at(r_idx))
            agree = (am == r_am.long()).float()
            tail_total += float((1.0 - r_lp.double().exp().sum(-1)).clamp_min(0).sum())
            sums["nll_ref"][lo:hi] = r_nll.double().sum(-1).cpu().numpy()
            sums["nll_cand"][lo:hi] = nll.double().sum(-1).cpu().numpy()
            sums["agree"][lo:hi] = agree.sum(-1).cpu().numpy()
            sums["kl"][lo:hi] = kl.double().sum(-1).cpu().numpy()
            agree_pos[lo:hi], kl_pos[lo:hi] = agree.cpu().numpy(), kl.cpu().numpy()
            cand_argmax[lo:hi] = am.cpu().numpy()
            del logits, stats
            log.info("  %s windows %d/%d (%.1f s)", engine.name, hi, w, time.time() - start)
        gen = None
        prompts = _prompts(evalset, cfg)
        if prompts is not None and "gen" in ref.keys():
            ref_gen = ref.get_tensor("gen")
            cand_gen = engine.greedy(prompts, cfg.gen_tokens).cpu()
            gen = _generation_record(prompts, ref_gen, cand_gen, cfg.gen_tokens, tokenizer)
    result = metrics.summarize(sums, kl_pos.ravel(), gen, tail_total / (w * t))
    windows = {"n_pred": int(t), "nll_reference": (sums["nll_ref"] / t).tolist(),
               "nll_candidate": (sums["nll_cand"] / t).tolist(), "top1_agreement": (sums["agree"] / t).tolist(),
               "kl_mean": (sums["kl"] / t).tolist()}
    positions = {"top1_agreement": agree_pos.mean(0).tolist(), "kl_mean": kl_pos.mean(0).tolist()}
    return EvalResult(engine.name, result, windows, positions, kl_pos.ravel(), gen, cand_argmax,
                      engine.forward_batches, round(time.time() - start, 2))


def _generation_record(prompts, ref_gen, cand_gen, n: int, tokenizer) -> dict:
    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) if tokenizer is not None else " ".join(map(str, ids))

    rows = []
    for p, r, c in zip(prompts.tolist(), ref_gen.tolist(), cand_gen.tolist()):
        d = metrics.first_divergence(r, c)
        rows.append({"prompt": text(p), "reference": text(r), "candidate": text(c), "first_divergence": d,
                     "reference_common": text(r[:d]), "reference_rest": text(r[d:]), "candidate_rest": text(c[d:])})
    return {"new_tokens": n, "first_divergence": [row["first_divergence"] for row in rows], "samples": rows}


# ------------------------------------------------------------------------------------- cached result
RESULT_JSON, RESULT_ARRAYS = "result.json", "result.safetensors"


def evaluation_key(store: ArtifactStore, engine: str, candidate: str, rkey: str, cfg: EvalConfig, limits: dict,
                   device, dtype) -> str:
    """Identity of one candidate's evaluation. batch_size is left out: results do not depend on it (tested)."""
    settings = {k: v for k, v in vars(cfg).items() if k not in ("batch_size", "attribution")}
    return store.key("evaluate", engine=engine, candidate=candidate, reference=rkey, eval=settings, limits=limits,
                     metrics=metrics.FORMULA_VERSION,
                     device=device.arch, dtype=str(dtype), versions=versions())


def write_result(out: Path, result: EvalResult) -> dict:
    import json

    import torch
    from safetensors.torch import save_file

    doc = {k: getattr(result, k) for k in ("engine", "metrics", "windows", "positions", "generation",
                                             "forward_batches", "seconds")}
    (out / RESULT_JSON).write_text(json.dumps(doc))
    save_file({"kl_values": torch.from_numpy(result.kl_values.copy()),
               "argmax": torch.from_numpy(result.argmax.copy())}, str(out / RESULT_ARRAYS))
    return {"engine": result.engine, "forward_batches": result.forward_batches, "seconds": result.seconds}


def read_result(art: Artifact) -> EvalResult:
    import json

    from safetensors.torch import load_file

    doc = json.loads((art.path / RESULT_JSON).read_text())
    arrays = load_file(str(art.path / RESULT_ARRAYS))
    return EvalResult(doc["engine"], doc["metrics"], doc["windows"], doc["positions"], arrays["kl_values"].numpy(),
                      doc["generation"], arrays["argmax"].numpy(), doc["forward_batches"], doc["seconds"])


# ------------------------------------------------------------------------------------------ attribution
def attribution(results: dict, engine: str) -> dict:
    """Split the loss three ways: quantization itself (HF -> fake-quant), export (fake-quant -> fake-quant with
    the transformations export applies), engine numerics (as exported -> the engine running the checkpoint)."""
    chain = ["fakequant", "fakequant_exported", engine]
    steps = {"quantization": (None, "fakequant"), "export": ("fakequant", "fakequant_exported"),
             "engine": ("fakequant_exported", engine)}

    def loss(name, metric):  # how much worse than the reference, in the metric's own units
        value = results[name].metrics[metric]["value"]
        return metrics.METRICS[metric].loss(value)

    out = {}
    for metric in ("dnll_mean", "top1_agreement", "kl_mean"):
        out[metric] = {name: results[name].metrics[metric]["value"] for name in chain}
        for step_name, (a, b) in steps.items():
            out[metric][step_name] = loss(b, metric) - (loss(a, metric) if a else 0.0)

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


# ------------------------------------------------------------------------------------------- the steps
def limits(r):
    ctx = r.ctx
    if "limits" not in ctx.memo:
        ctx.memo["limits"] = limits_for(ctx.cfg, r.value("prepare").max_positions)
    return ctx.memo["limits"]


def _eval_tokens(r) -> int:
    evalset = r.value("data:eval")
    return evalset.num_windows * evalset.seq_len


def reference_step(ctx: RunContext) -> Step:
    cfg = ctx.cfg

    def key_of(r) -> str:
        return reference_key(ctx.store, r.fingerprint("prepare"), r.fingerprint("data:eval"), cfg.eval, ctx.device,
                             ctx.dtype)

    return Step("reference", "evaluate", key_of, lambda art, r, built: art,
                lambda out, r: write_reference(out, build_engine(ENGINES["reference"], r), r.value("data:eval"), cfg.eval),
                needs=("prepare", "data:eval"), store_stage="reference",
                work=lambda r: costs.work(costs.device_label(ctx.device), "reference", r.value("prepare").num_params,
                                          _eval_tokens(r)),
                manifest=lambda r: {"data": r.fingerprint("data:eval"), "versions": versions()},
                describe="reference outputs")


RUNS_NEEDS = {"checkpoint": "export", "calibrated": "quantize", "model": "prepare"}


def build_engine(spec: EngineSpec, r):
    """Build an engine from what the run has (the registry says what it runs)."""
    from quantlab.graph import EngineInputsView

    return spec.builder()(r.ctx.cfg.engine, EngineInputsView(r), limits(r))


def engine_build_step(ctx: RunContext) -> Step:
    """stop_after=build: build the engine under test (its build records are stored) and stop."""
    spec = ctx.engine

    def build(out, r) -> dict:
        engine = build_engine(spec, r)
        engine.close()
        return {"engine": spec.name}

    return Step(f"build:{spec.name}", "build", lambda r: None, lambda art, r, built: built,
                build, needs=(RUNS_NEEDS[spec.runs], "prepare"))


def candidate_identity(spec: EngineSpec, r) -> str:
    """What a candidate's outputs depend on: the exported checkpoint for engines that run it (plus the engine's
    own output-changing options), the calibrated state for fake-quant rungs, the model for the reference."""
    if spec.runs == "checkpoint":
        extra = spec.identity(r.ctx.cfg.engine) if spec.name == r.ctx.engine.name else {}
        return f"{r.fingerprint('export')}:{''.join(str(v) for v in extra.values())}"
    if spec.runs == "model":
        return r.fingerprint("prepare")
    return r.key("quantize")


def candidate_step(ctx: RunContext, spec: EngineSpec) -> Step:
    cfg = ctx.cfg

    def key_of(r) -> str:
        return evaluation_key(ctx.store, spec.name, candidate_identity(spec, r), r.key("reference"), cfg.eval,
                              limits(r).describe(), ctx.device, ctx.dtype)

    def build(out: Path, r) -> Built:
        from quantlab.models import load_tokenizer

        evalset = r.value("data:eval")
        log.info("evaluate: %s vs reference on %d windows x %d tokens", spec.name, evalset.num_windows, evalset.seq_len)
        engine = build_engine(spec, r)
        result = compare(engine, r.value("reference"), evalset, cfg.eval, load_tokenizer(r.value("prepare")))
        engine.close()
        return Built(write_result(out, result), result)

    def load(art: Artifact, r, built: Built | None) -> EvalResult:
        result = built.value if built is not None else read_result(art)
        result.computed_now = built is not None
        return result

    def work(r) -> dict:
        from quantlab.stages.quantize import recipe_label

        return costs.work(costs.device_label(ctx.device), f"{spec.name}:{recipe_label(ctx)}",
                          r.value("prepare").num_params, _eval_tokens(r))

    return Step(f"evaluate:{spec.name}", "evaluate", key_of, load, build,
                needs=("reference", "data:eval", "prepare", RUNS_NEEDS[spec.runs]), work=work,
                manifest=lambda r: {"data": r.fingerprint("data:eval"), "versions": versions()},
                describe="candidate evaluation")
