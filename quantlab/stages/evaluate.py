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

from quantlab import metrics
from quantlab.artifacts import Artifact, ArtifactStore
from quantlab.config import EvalConfig
from quantlab.env import versions
from quantlab.errors import QuantlabError
from quantlab.stages.data import TokenSet

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
def reference_key(store: ArtifactStore, model_fp: str, evalset: TokenSet, cfg: EvalConfig, device, dtype) -> str:
    return store.key("reference", model=model_fp, data=evalset.fingerprint, dtype=str(dtype), device=device.type,
                     metrics=metrics.FORMULA_VERSION,
                     topk=cfg.topk, gen=[cfg.gen_prompts, cfg.gen_prompt_len, cfg.gen_tokens], versions=versions())


def reference(store: ArtifactStore, rkey: str, evalset: TokenSet, cfg: EvalConfig, make_engine,
              cost: dict | None = None) -> Artifact:
    """make_engine() -> the reference engine; called only when the outputs are not cached."""

    def build(out: Path) -> dict:
        import torch
        from safetensors.torch import save_file

        engine = make_engine()
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

    return store.get_or_build("reference", rkey, build, {"data": evalset.fingerprint, "versions": versions()},
                              describe="reference outputs", cost=cost)


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


def candidate_engines(cfg) -> list[str]:
    """The engine under test, plus the fake-quant variants that eval.attribution compares it with."""
    names = [cfg.engine.name]
    if cfg.eval.attribution and cfg.engine.name not in ("fakequant", "reference"):
        names += ["fakequant", "fakequant_exported", "fakequant_jitter"]
    return names


def candidate_identity(name: str, engine_cfg, model_fp: str, qkey: str, checkpoint_fp) -> str:
    """What a candidate's outputs depend on: the exported checkpoint for engines (checkpoint_fp() gives its
    fingerprint, asked only for them), the calibrated state for fake-quant variants, the model itself for the
    reference control run."""
    if name in ("torch", "trtllm"):
        return f"{checkpoint_fp()}:{engine_cfg.trtllm_backend if name == 'trtllm' else ''}"
    if name == "reference":
        return model_fp
    return qkey


def evaluation_key(store: ArtifactStore, engine: str, candidate: str, rkey: str, cfg: EvalConfig, limits: dict,
                   device, dtype) -> str:
    """Identity of one candidate's evaluation. batch_size is left out: results do not depend on it (tested)."""
    settings = {k: v for k, v in vars(cfg).items() if k not in ("batch_size", "attribution")}
    return store.key("evaluate", engine=engine, candidate=candidate, reference=rkey, eval=settings, limits=limits,
                     metrics=metrics.FORMULA_VERSION,
                     device=device.arch, dtype=str(dtype), versions=versions())


def evaluate_cached(store: ArtifactStore, key: str, make_engine, ref_art: Artifact, evalset: TokenSet,
                    cfg: EvalConfig, tokenizer=None, cost: dict | None = None) -> tuple[EvalResult, bool]:
    """(result, computed_now): a rerun on the same candidate and data reads the stored result."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    computed = {}

    def build(out: Path) -> dict:
        engine = make_engine()
        result = compare(engine, ref_art, evalset, cfg, tokenizer)
        engine.close()
        doc = {k: getattr(result, k) for k in ("engine", "metrics", "windows", "positions", "generation",
                                                 "forward_batches", "seconds")}
        (out / RESULT_JSON).write_text(json.dumps(doc))
        save_file({"kl_values": torch.from_numpy(result.kl_values.copy()),
                   "argmax": torch.from_numpy(result.argmax.copy())}, str(out / RESULT_ARRAYS))
        computed["result"] = result
        return {"engine": result.engine, "forward_batches": result.forward_batches, "seconds": result.seconds}

    art = store.get_or_build("evaluate", key, build, {"data": evalset.fingerprint, "versions": versions()},
                             describe="candidate evaluation", cost=cost)
    if "result" in computed:
        return computed["result"], True
    doc = json.loads((art.path / RESULT_JSON).read_text())
    arrays = load_file(str(art.path / RESULT_ARRAYS))
    return EvalResult(doc["engine"], doc["metrics"], doc["windows"], doc["positions"], arrays["kl_values"].numpy(),
                      doc["generation"], arrays["argmax"].numpy(), doc["forward_batches"], doc["seconds"]), False
