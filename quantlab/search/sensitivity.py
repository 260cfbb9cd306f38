"""Sensitivity: ModelOpt AutoQuantize over the allowed per-layer formats. It calibrates every format once on the
run's calibration set and scores each (layer group, format): the Fisher/Taylor estimate of the loss increase when
that group alone takes that format (search.sensitivity=measured: the measured NLL increase instead). The scores are
a cached artifact (scores.json); the calibrated model stays in memory, owned by one Sensitivity object, and gives
every candidate's export (its formats switched per group, exported as a unified HF checkpoint and checked against the
searched model before it counts).
"""
from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path

from quantlab.artifacts import write_json_atomic
from quantlab.config import Config, KvCacheConfig
from quantlab.env import versions
from quantlab.precisions import PRECISION_SCHEMAS, PRECISIONS, kv_format
from quantlab.search.frontier import Candidate, Choice, Group, choice_by_name

log = logging.getLogger("quantlab")

SEARCH_VERSION = 2  # part of the sensitivity and export keys
EXPORT_CHECK_TOKENS = 128  # calibration tokens an export's self-check runs


class Sensitivity:
    """AutoQuantize over the allowed formats: the scores (a cached artifact) and, once calibrated by this object,
    the calibrated model whose per-group formats can be switched for export.

    The calibrated model belongs to this object alone (a search's SearchRun holds one): nothing is kept per process.
    Another Sensitivity, of a second search in the same process or a later process, finds the scores in the cache
    and calibrates again the first time it needs the model (ensure_model: same data, same seeds, same result); a
    caller that wants to reuse a calibrated model passes this object on (bench/search_bench.py does).

    Args:
        cfg: the search's config (calibration batch size, search.score_samples, search.sensitivity).
        ctx: the run context (artifact store, device, dtype).
        r: the executor holding the prepared model and the calibration data (steps prepare, data:calib).
        choices: the per-layer options (quantlab.search.checks.choices_for).
    """

    def __init__(self, cfg: Config, ctx, r, choices: list[Choice]):
        self.cfg, self.ctx, self.r, self.choices = cfg, ctx, r, choices
        self.model = None
        self.groups: list[Group] = []  # the layer groups with their scores, known once the scores are loaded
        self.fixed_params = 0  # lm_head parameters (kept at 16 bits), known once the scores are loaded
        self.fixed_modules: list[str] = []  # the modules of fixed_params
        self.state: dict | None = None  # AutoQuantize's search state (candidate_stats: its own re-solve needs it)
        self.batches: list = []
        self.recipes: dict[str, object] = {}  # choice name -> AutoQuantize's QuantRecipe

    def key(self) -> str:
        """The sensitivity artifact's key: model, calibration data, formats, scoring windows, device, versions."""
        s = self.cfg.search
        return self.ctx.store.key("search", model=self.r.fingerprint("prepare"), calib=self.r.fingerprint("data:calib"),
                                  choices=[c.name for c in self.choices], score_samples=s.score_samples,
                                  sensitivity=s.sensitivity,
                                  batch_size=self.cfg.calib.batch_size, device=self.ctx.device.type,
                                  dtype=str(self.ctx.dtype), versions=versions(), version=SEARCH_VERSION)

    def load(self) -> tuple[list[Group], int, dict]:
        """(groups, lm_head parameters kept at 16 bits, scores.json) from the cache, or AutoQuantize run now."""
        art, built = self.ctx.store.get_or_build("search", self.key(), self._build,
                                                 {"choices": [c.name for c in self.choices]},
                                                 describe="sensitivity (AutoQuantize scores)")
        doc = json.loads((art.path / "scores.json").read_text())
        groups = [Group(g["leader"], g["modules"], g["params"], g["scores"]) for g in doc["groups"]]
        self.groups, self.fixed_params, self.fixed_modules = groups, doc["fixed_params"], doc["fixed_modules"]
        return groups, doc["fixed_params"], doc

    def _formats(self) -> list[dict]:
        from quantlab.precisions import modelopt_config

        out = []
        for c in self.choices:
            if c.precision is None:
                continue
            mcfg = modelopt_config(PRECISION_SCHEMAS[c.precision](), KvCacheConfig(), c.block)
            mcfg["quant_cfg"] = [e for e in mcfg["quant_cfg"] if e.get("parent_class") != "nn.LayerNorm"]
            mcfg["effective_bits"] = c.aq_bits()
            out.append(mcfg)
        return out

    def calibrate(self) -> dict:
        """Run AutoQuantize (calibration of every format + gradient scores); keeps the model for exports."""
        import modelopt.torch.quantization as mtq
        import torch

        from quantlab.models import load_model

        ref, calib = self.r.value("prepare"), self.r.value("data:calib")
        model = load_model(ref, self.ctx.device, self.ctx.dtype, self.cfg.model.device_map)
        if not model.config.architectures:
            model.config.architectures = [type(model).__name__]
        first = model.get_input_embeddings().weight.device
        batches = [b.to(first) for b in torch.split(calib.tokens, self.cfg.calib.batch_size)]
        n_score = self.cfg.search.score_samples or calib.num_windows
        score_batches = max(1, math.ceil(min(n_score, calib.num_windows) / self.cfg.calib.batch_size))

        def forward(m, batch):
            return m(batch, use_cache=False)

        def loss(output, batch):
            logits = output.logits[:, :-1].float()
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

        start = time.time()
        log.info("search: AutoQuantize calibrates %s and scores every layer group on %d x %d tokens",
                 ", ".join(c.name for c in self.choices if c.precision), min(n_score, calib.num_windows), calib.seq_len)
        formats = self._formats()
        # AWQ formats calibrate on num_calib_steps // 4 batches: 4x the batch count calibrates them on all of calib
        model, state = mtq.auto_quantize(model, constraints={"effective_bits": 16.0}, quantization_formats=formats,
                                         data_loader=batches, forward_step=forward, loss_func=loss,
                                         disabled_layers=["*lm_head*"], num_calib_steps=4 * len(batches),
                                         num_score_steps=score_batches, verbose=False)
        # AutoQuantize leaves each scored module's cached output differences (tokens x out_features per format) on
        # the module after scoring: gigabytes on a real model (measured: 24 GB on SmolLM2 with 16 x 256 tokens,
        # OOM), and copied by every deepcopy for export. Drop them: the scores are already summed.
        for module in model.modules():
            if "output_diff_dict" in module.__dict__:
                del module.output_diff_dict
        if hasattr(model, "gradient_checkpointing_disable"):
            model.gradient_checkpointing_disable()
        model.requires_grad_(False)
        model.eval()
        self.model, self.batches, self.state = model, batches, state
        names = [c.name for c in self.choices if c.precision is not None]
        groups, fixed, fixed_modules = [], 0, []
        for leader, st in state["candidate_stats"].items():
            members = list(st["module_names"])
            params = sum(model.get_submodule(m).weight.numel() for m in members)
            if st.get("is_fixed") or len(st["formats"]) == 1:
                fixed += params
                fixed_modules += members
                continue
            scores = {}
            for recipe, score in zip(st["formats"], st["scores"], strict=True):
                name = self._name_of(recipe, names)
                scores[name] = float(score)
                self.recipes[name] = recipe
            groups.append({"leader": leader, "modules": members, "params": params, "scores": scores})
        doc = {"groups": groups, "fixed_params": fixed, "fixed_modules": fixed_modules,
               "score_windows": min(n_score, calib.num_windows), "score_batches": score_batches,
               "calib_windows": calib.num_windows, "seq_len": calib.seq_len, "method": "gradient"}
        if self.cfg.search.sensitivity == "measured":
            doc.update(self._measure(groups, batches[:score_batches]))
        doc["seconds"] = round(time.time() - start, 1)
        return doc

    def _measure(self, groups: list[dict], batches) -> dict:
        """search.sensitivity=measured: each group alone at each format (every other group unquantized) on the
        scoring windows, the increase of mean NLL over the unquantized model, measured on AutoQuantize's calibrated
        fake-quant model: what the ppl-ratio check sees, without the Taylor approximation, at one forward pass per
        (group, format). The gradient scores are kept beside it (autoquantize_scores) with their rank correlation."""
        from modelopt.torch.opt.utils import get_hparam
        from scipy import stats as sps

        model = self.model
        start = time.time()
        for g in groups:
            get_hparam(model, g["leader"]).active = self.recipes["none"]  # AutoQuantize always offers NONE
        ref = mean_nll(model, batches)
        names = [n for n in self.recipes if n != "none"]
        log.info("search: measuring %d layer groups x %d formats (one forward pass of the scoring windows each)",
                 len(groups), len(names))
        for g in groups:
            hp = get_hparam(model, g["leader"])
            off = hp.active
            g["autoquantize_scores"] = dict(g["scores"])
            for name in names:
                hp.active = self.recipes[name]
                g["scores"][name] = mean_nll(model, batches) - ref
            hp.active = off
        rho = {n: float(sps.spearmanr([g["autoquantize_scores"][n] for g in groups],
                                      [g["scores"][n] for g in groups])[0]) for n in names}
        log.info("search: measured sensitivity in %.0f s; Spearman rank correlation with AutoQuantize's scores: %s",
                 time.time() - start, ", ".join(f"{n} {r:.2f}" for n, r in rho.items()))
        return {"method": "measured", "measure_seconds": round(time.time() - start, 1),
                "spearman_vs_autoquantize": rho}

    def autoquantize_pick(self, effective_bits: float) -> dict[str, str]:
        """AutoQuantize's own choice at an effective-bits budget (its LP over its scores and costs), as an
        assignment of our groups: the baseline the search is measured against (bench/search_bench.py)."""
        from modelopt.torch.quantization.algorithms import _resolve_best_recipe

        self.ensure_model()
        best = _resolve_best_recipe(self.state, {"effective_bits": effective_bits})
        names = {recipe: name for name, recipe in self.recipes.items()}
        return {leader: names[recipe] for leader, recipe in best.items() if recipe in names}

    def _name_of(self, recipe, names: list[str]) -> str:
        text = str(recipe)
        if text.startswith("NONE"):
            return "none"
        index = int(text.split("CUSTOM_")[1].split("(")[0])  # AutoQuantize names the i-th custom format CUSTOM_i
        return names[index]

    def _build(self, out: Path) -> dict:
        doc = self.calibrate()
        write_json_atomic(out / "scores.json", doc)
        return {"groups": len(doc["groups"]), "seconds": doc["seconds"]}

    def ensure_model(self) -> None:
        """The calibrated AutoQuantize model: this object's, else calibrated again (deterministic: same data, same
        result; the scores stay the cached ones)."""
        if self.model is None:
            log.info("search: a new candidate needs the calibrated model: running AutoQuantize again (same data, "
                     "same result)")
            self.calibrate()

    def export(self, cand: Candidate, kv: str, out: Path) -> dict:
        """Switch every group to its format, add the KV quantizers if asked, and export a unified checkpoint into
        out, checked against the searched model (_check_export).

        Returns:
            The export's manifest info (quantlab.stages.export.write's, with the candidate's label).
        """
        groups = self.groups
        import modelopt.torch.quantization as mtq
        import torch
        from modelopt.torch.opt.utils import get_hparam

        from quantlab.stages.export import write

        self.ensure_model()
        for g in groups:
            get_hparam(self.model, g.leader).active = self.recipes[cand.assignment[g.leader]]
        model = copy.deepcopy(self.model)  # the export folds scales into weights: keep the searched model intact
        # AutoQuantize keeps AWQ's weight-side scales on each recipe's weight quantizer (so recipes can share the
        # weights) and folds them into the weights only for the recipe it picks itself. Fold them for ours, or the
        # export writes unscaled int4 weights next to input scales folded into the norms (measured: 9% logit error).
        from modelopt.torch.quantization.algorithms import QuantRecipe

        QuantRecipe.fold_pqs_to_weights(model)
        if kv == "fp8":
            entries = [e for e in copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]) if e.get("quantizer_name") != "*"]
            mtq.set_quantizer_by_cfg(model, entries)

            def loop(m):
                with torch.no_grad():
                    for b in self.batches:
                        m(b, use_cache=False)

            with mtq.set_quantizer_by_cfg_context(model, [{"quantizer_name": "*", "enable": False}, *entries]):
                mtq.calibrate(model, algorithm="max", forward_loop=loop)
        used = {cand.assignment[g.leader] for g in groups} - {"none"}
        algo = "MIXED_PRECISION"
        if len(used) == 1:
            only = choice_by_name(self.choices, used.pop())
            algo = PRECISIONS[only.precision].quant_algo
        tokens, expected, floor = self._as_exported_logits(model)
        info = write(model, self.r.value("prepare").path, out, algo, kv_format(KvCacheConfig(kv)).quant_algo)
        del model
        self._check_export(out, tokens, expected, floor)
        write_json_atomic(out / "quantlab_search.json", {"assignment": cand.assignment, "kv_cache": kv,
                                                         "bits": cand.bits, "aq_bits": cand.aq_bits})
        return {**info, "label": cand.label}
    def _as_exported_logits(self, model):
        """Logits of the fake-quant model with the transformations export applies, on one calibration row, and
        the same model's own spread under rounding-sized input noise (the floor of any engine that is not
        bit-identical: per-tensor activation rounding makes some real models move 5-7% of their top-1 under 1e-6
        noise)."""
        import torch
        from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

        from quantlab import modelopt_compat
        from quantlab.engines.fakequant import JITTER

        twin = copy.deepcopy(model)
        tokens = self.batches[0][:1, :EXPORT_CHECK_TOKENS]
        with torch.no_grad(), modelopt_compat.fused_experts_resmooth():
            requantize_resmooth_fused_llm_layers(twin)
            logits = twin(tokens, use_cache=False).logits.float()
            emb = twin.get_input_embeddings()
            scale = max(JITTER, torch.finfo(emb.weight.dtype).eps)
            gen = torch.Generator(device=emb.weight.device).manual_seed(0)

            def jitter(_module, _args, out):  # a forward hook's signature
                noise = torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float32)
                return out * (1 + scale * noise).to(out.dtype)

            handle = emb.register_forward_hook(jitter)
            try:
                noisy = twin(tokens, use_cache=False).logits.float()
            finally:
                handle.remove()
        del twin
        return tokens, logits, _agreement(noisy, logits)

    def _check_export(self, out: Path, tokens, expected, floor: tuple[float, float]) -> None:
        """The engine on the written checkpoint must reproduce the searched model as exported within the model's
        own noise floor: a mixed export that drifted from what was scored is a bug of ours (exit 3), never a
        candidate."""
        import torch

        from quantlab.engines.torch_engine import load_exported

        engine, _ = load_exported(out, self.ctx.device, self.ctx.dtype)
        with torch.no_grad():
            got = engine(tokens.to(next(engine.parameters()).device), use_cache=False).logits.float().cpu()
        del engine
        agree, rel = _agreement(got, expected.cpu())
        floor_agree, floor_rel = floor
        if agree < floor_agree - 0.05 or rel > max(1e-3, 4 * floor_rel):
            raise RuntimeError(f"search export {out} does not reproduce the searched model as exported "
                               f"(top-1 agreement {agree:.4f}, relative logit error {rel:.2e}; the model's own "
                               f"floor under rounding-sized noise: {floor_agree:.4f}, {floor_rel:.2e})")
        log.info("export check %s: top-1 agreement %.4f, relative logit error %.1e (floor %.4f, %.1e)", out.name,
                 agree, rel, floor_agree, floor_rel)


def mean_nll(model, batches) -> float:
    """Mean next-token NLL of a causal LM over token batches [B, T] (every predicted position weighs the same)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(b, use_cache=False).logits[:, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             b[:, 1:].reshape(-1), reduction="sum"))
            count += b[:, 1:].numel()
    return total / count


def _agreement(a, b) -> tuple[float, float]:
    """(top-1 agreement, relative logit error) of logits a against b."""
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    return agree, rel
