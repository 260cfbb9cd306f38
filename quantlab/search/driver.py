"""+search=cheapest: the cheapest per-layer quantization that passes the gate, proven on the exported checkpoint.

1. Sensitivity. ModelOpt's AutoQuantize (gradient method) calibrates every allowed per-layer format once on the
   run's calibration set and scores each (layer group, format): the Fisher/Taylor estimate of the loss increase
   when that group alone takes that format. search.sensitivity=measured replaces the scores by the measured NLL
   increase of each group alone (bench/RESULTS.md: the gradient scores predict combinations better; they are the
   default). quantlab keeps the scores (search artifact, JSON) and the calibrated
   model (in memory; a later process that needs a new export calibrates again, deterministically).
2. Frontier. Per group, the lower convex hull of (cost, score) over its formats; all upgrades of all groups sorted
   by score saved per bit added to the model (the group's weights times the bits per weight). Prefix k of that
   list is candidate k: from every group at its cheapest format (k = 0) to every group unquantized. Predicted
   score and cost are known for each k without evaluating anything.
3. Verification. A candidate is exported (ModelOpt's unified HF checkpoint, MIXED_PRECISION when formats differ)
   and evaluated like any run: `engine.checkpoint=EXPORT`, the run's engine, data and sequential gate (base
   thresholds for every candidate: one quality bar). The next candidate is placed by interpolating the gate's
   normalized slack against the predicted score to where it crosses 0, between the evaluated candidates nearest
   the pass/fail boundary (with the unquantized model as the anchor: score 0, slack 1), kept in the middle half of
   the bracket of the cheapest pass and the dearest fail (so each evaluation removes at least a quarter of it),
   until they are `resolution_bits` apart or `max_evaluations` are spent.
4. The winner is the cheapest configuration that passed, chain or uniform; KV formats other than the first
   are tried on it last. Every export and every evaluation block is a cached artifact: a rerun, or a search with a
   stricter gate, re-evaluates nothing it has seen.

Costs (SearchConfig.cost) are bits per weight over the linear layers AutoQuantize can quantize (lm_head included at
16 bits, embeddings excluded): `bits` counts what the checkpoint stores (int4 codes plus one scale per group:
4 + scale bits/block; FP8 8 plus per-tensor scales; unquantized 16, the deployment dtype; per-input-channel AWQ
pre-quant scales and per-tensor scales are left out of the prediction and measured on the export, search.json's
stored_bits_measured: under 1% more on the test model); `aq_bits` counts as
AutoQuantize does (4 for any int4 group size, NVFP4 4.5, FP8 8, none 16); `latency` is measured engine=torch
latency of a prefill on this device (quantlab.search.latency: the unquantized model and each uniform format are timed, a
format's cost per weight is its uniform latency change spread over the searched weights; every evaluated candidate
is timed too and the winner is the fastest measured that passes and beats the unquantized model by
search.min_speedup; the resolution stop still counts stored bits).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantlab import preflight
from quantlab.artifacts import Built, write_json_atomic
from quantlab.config import Config, KvCacheConfig
from quantlab.env import versions
from quantlab.errors import EXIT_GATE_FAILED, EXIT_OK, QuantlabError
from quantlab.gate.metrics import METRICS
from quantlab.precisions import PRECISION_SCHEMAS, PRECISIONS, kv_format, precision_by_algo

log = logging.getLogger("quantlab")

SEARCH_VERSION = 2  # part of the sensitivity and export keys
SEARCHABLE = ("int4_awq", "w4a8_awq", "fp8", "nvfp4", "none")  # per-layer formats AutoQuantize calibrates and the
# torch engine runs inside one MIXED_PRECISION checkpoint


# ------------------------------------------------------------------------------------------- choices
@dataclass(frozen=True)
class Choice:
    """One per-layer option: a precision (None: unquantized) with a group size where the format has one."""

    precision: str | None
    block: int | None = None

    @property
    def name(self) -> str:
        """How search.formats and reports name it: int4_awq@64, fp8, none."""
        if self.precision is None:
            return "none"
        return f"{self.precision}@{self.block}" if self.block else self.precision

    def aq_bits(self) -> float:
        """AutoQuantize's count: the value width (NVFP4 4.5), no scales."""
        if self.precision is None:
            return 16.0
        return 4.5 if self.precision == "nvfp4" else float(PRECISIONS[self.precision].weight_bits)

    def bits(self) -> float:
        """Stored bits per weight: the value width plus one scale per block (per-tensor scales: ~0)."""
        if self.precision is None:
            return 16.0
        p = PRECISIONS[self.precision]
        block = self.block or p.fixed_block
        return p.weight_bits + (p.scale_bits / block if block else 0.0)

    def cost(self, kind: str) -> float:
        """Its cost in the unit of search.cost (bits or aq_bits)."""
        return self.bits() if kind == "bits" else self.aq_bits()


def check_search_config(cfg: Config) -> None:
    """Everything about search.* that is known without the model (exit 2 naming the fix)."""
    s = cfg.search
    if not s.formats:
        raise QuantlabError("search.formats is empty: the search has no format to choose from",
                            fix="give search.formats, e.g. [int4_awq,fp8,none]")
    unknown = [f for f in s.formats if f not in SEARCHABLE]
    if unknown:
        raise QuantlabError(f"search.formats {unknown} cannot be searched per layer",
                            fix=f"choose from {', '.join(SEARCHABLE)}")
    if len(set(s.formats)) != len(s.formats):
        raise QuantlabError(f"search.formats {list(s.formats)} lists a format twice", fix="list each format once")
    if [f for f in s.formats if f != "none"] == []:
        raise QuantlabError("search.formats allows no quantized format (only none)",
                            fix="add a format, e.g. search.formats=[int4_awq,fp8,none]")
    if s.cost not in ("bits", "aq_bits", "latency"):
        raise QuantlabError(f"search.cost={s.cost!r} is not a cost", fix="use bits, aq_bits or latency")
    if s.latency_batch < 1:
        raise QuantlabError(f"search.latency_batch={s.latency_batch} must be >= 1", fix="e.g. 1")
    if s.latency_tokens is not None and s.latency_tokens < 1:
        raise QuantlabError(f"search.latency_tokens={s.latency_tokens} must be >= 1 (null: eval.seq_len)",
                            fix="drop it or give a positive count")
    if s.latency_repeats < 3:
        raise QuantlabError(f"search.latency_repeats={s.latency_repeats} is too few for a median and its spread",
                            fix="set search.latency_repeats >= 3 (default 10)")
    if not (0.0 <= s.min_speedup < 1.0):
        raise QuantlabError(f"search.min_speedup={s.min_speedup} must be in [0, 1)", fix="e.g. 0.02 (2%)")
    if s.cost != "latency":
        from quantlab.config import SearchConfig

        default = SearchConfig()
        unused = [f"search.{k}={getattr(s, k)}" for k in ("latency_batch", "latency_tokens", "latency_repeats",
                                                          "min_speedup") if getattr(s, k) != getattr(default, k)]
        if unused:
            raise QuantlabError(f"{', '.join(unused)} only apply to search.cost=latency; this search minimizes "
                                f"{s.cost}", fix="add search.cost=latency, or drop them")
    if s.max_evaluations < 1:
        raise QuantlabError(f"search.max_evaluations={s.max_evaluations} leaves nothing to evaluate",
                            fix="set search.max_evaluations >= 1 (default 6)")
    if not (s.resolution_bits > 0):
        raise QuantlabError(f"search.resolution_bits={s.resolution_bits} must be > 0", fix="e.g. 0.05")
    if s.sensitivity not in ("autoquantize", "measured"):
        raise QuantlabError(f"search.sensitivity={s.sensitivity!r} is not a sensitivity",
                            fix="use autoquantize (gradient scores) or measured (a forward pass per group and format)")
    if s.score_samples is not None and s.score_samples < 1:
        raise QuantlabError(f"search.score_samples={s.score_samples} must be >= 1 (null: every calibration window)",
                            fix="drop it or give a positive count")
    if not s.kv_cache:
        raise QuantlabError("search.kv_cache is empty", fix="give [none], [fp8] or [none,fp8]")
    for kv in s.kv_cache:
        if kv not in ("none", "fp8"):
            raise QuantlabError(f"search.kv_cache has {kv!r}", fix="use none and/or fp8")
    bad = [b for b in s.int4_block_sizes if not isinstance(b, int) or b <= 0]
    if bad:
        raise QuantlabError(f"search.int4_block_sizes {bad} are not positive integers", fix="e.g. [32]")


def choices_for(cfg: Config, in_dims: dict[str, int]) -> list[Choice]:
    """The search's per-layer options for this model's layer widths, checked before any compute."""
    from quantlab.precisions import resolve_block_size

    check_search_config(cfg)
    s = cfg.search
    out = []
    for name in s.formats:
        if name == "none":
            continue
        schema = PRECISION_SCHEMAS[name]
        if PRECISIONS[name].blockwise:
            auto, _ = resolve_block_size(schema(), in_dims)
            blocks = [auto] + [b for b in s.int4_block_sizes if b != auto]
            for b in blocks:
                short = sorted(n for n, d in in_dims.items() if d % b)
                if short:
                    raise QuantlabError(f"search.int4_block_sizes {b} does not divide the input width of "
                                        f"{short[0]} ({in_dims[short[0]]})",
                                        fix=f"drop {b} from search.int4_block_sizes")
            out += [Choice(name, b) for b in blocks]
        else:
            out.append(Choice(name))
    out.append(Choice(None))
    return out


# --------------------------------------------------------------------------------------------- gates
def check_gate_feasible(cfg: Config) -> dict:
    """The gate every candidate is held to (base thresholds). A threshold the unquantized model itself cannot pass
    (its ideal value is on or beyond it) makes the search pointless: exit 2 before calibration."""
    from quantlab.gate import checks as gate_checks

    one_bar = dataclasses.replace(cfg.gate, per_precision={})
    gate_checks.check_gate(one_bar, "mixed", cfg.eval)
    thresholds = gate_checks.thresholds_for(one_bar, "mixed", cfg.eval.seq_len)
    if not thresholds:
        raise QuantlabError("the gate has no thresholds: every configuration would pass, so nothing is searched",
                            fix="use gate=default or give gate.thresholds")
    for metric, th in thresholds.items():
        spec = METRICS.get(metric)
        if spec is None or spec.ideal is None:
            continue
        if th.min is not None and not spec.ideal > th.min:
            raise QuantlabError(f"gate.thresholds.{metric}.min={th.min} cannot be passed even by the unquantized "
                                f"model ({metric} of the reference against itself is {spec.ideal})",
                                fix=f"set {metric}.min below {spec.ideal}")
        if th.max is not None and not spec.ideal < th.max:
            raise QuantlabError(f"gate.thresholds.{metric}.max={th.max} cannot be passed even by the unquantized "
                                f"model ({metric} of the reference against itself is {spec.ideal})",
                                fix=f"set {metric}.max above {spec.ideal}")
    return {k: dataclasses.asdict(v) for k, v in thresholds.items()}


def slack(doc: dict) -> float:
    """The gate's closest call, normalized: min over checks of (confidence bound to threshold) / (ideal to
    threshold). 1 = the unquantized model; 0 = on the threshold; negative = fails by that share."""
    worst = math.inf
    for c in doc["gate"]["checks"]:
        spec = METRICS.get(c.get("metric") or "")
        ci, th = c.get("ci"), c.get("threshold")
        if spec is None or spec.ideal is None or not ci or th is None:
            continue
        span = abs(spec.ideal - th) or 1.0
        bound = ci[0] if c.get("op") == ">=" else ci[1]
        s = (bound - th) / span if c.get("op") == ">=" else (th - bound) / span
        worst = min(worst, s)
    return worst if worst < math.inf else (1.0 if doc["gate"]["passed"] else -1.0)


# ---------------------------------------------------------------------------------------- frontier
@dataclass
class Group:
    """A layer group AutoQuantize gives one format (q/k/v together, gate/up together, each other Linear alone)."""
    leader: str  # AutoQuantize's hparam name (first member + ".quant_recipe")
    modules: list[str]
    params: int
    scores: dict[str, float]  # choice name -> AutoQuantize score (0 for none)


@dataclass
class Candidate:
    """One configuration: a format per group, its two costs and its predicted score."""
    label: str
    assignment: dict[str, str]  # group leader -> choice name
    bits: float
    aq_bits: float
    predicted: float  # sum of the groups' scores
    k: int | None = None  # position on the frontier (None: a uniform comparison off it)
    latency_ms: float | None = None  # predicted engine latency (search.cost=latency only)


def totals(groups: list[Group], choices: dict[str, Choice], assignment: dict[str, str], fixed_params: int) -> tuple:
    """(bits, aq_bits, predicted score) of an assignment; fixed_params (lm_head) count at 16 bits."""
    n = sum(g.params for g in groups) + fixed_params
    bits = (sum(g.params * choices[assignment[g.leader]].bits() for g in groups) + 16 * fixed_params) / n
    aq = (sum(g.params * choices[assignment[g.leader]].aq_bits() for g in groups) + 16 * fixed_params) / n
    return bits, aq, sum(g.scores[assignment[g.leader]] for g in groups)


@dataclass
class LatencyModel:
    """search.cost=latency: the measured unquantized and uniform latencies and the cost per weight of each format
    derived from them (quantlab.search.latency)."""
    none_ms: float
    per_weight: dict[str, float]  # choice name -> ms per weight relative to none (0 for none)
    measured: dict[str, dict]  # "none" and each uniform format -> time_forward's result
    not_faster: list[str]  # formats not min_speedup faster than none when applied everywhere (cost clamped >= 0)

    def predict(self, groups: list[Group], assignment: dict[str, str]) -> float:
        """The unquantized latency plus each group's weights times its format's cost per weight."""
        return self.none_ms + sum(g.params * self.per_weight[assignment[g.leader]] for g in groups)


def unit_costs(choices: dict[str, Choice], cost: str, latency: LatencyModel | None) -> dict[str, float]:
    """Cost per weight of every choice in the unit of search.cost."""
    if cost == "latency":
        if latency is None:
            raise ValueError("search.cost=latency needs the measured latency model")
        return dict(latency.per_weight)
    return {name: c.cost(cost) for name, c in choices.items()}


def frontier(groups: list[Group], choices: dict[str, Choice], cost: str, fixed_params: int,
             latency: LatencyModel | None = None) -> list[Candidate]:
    """Candidates 0..K: every group at its cheapest format, then one hull upgrade at a time, the upgrades that save
    the most predicted loss per bit of the model first (an upgrade costs the group's weights times the bits it adds
    to each). Each candidate minimizes score + lambda * cost for some lambda, so no configuration of the same or
    lower cost predicts less loss (tests/test_search.py checks it against brute force)."""
    moves, start = [], {}
    unit = unit_costs(choices, cost, latency)
    for gi, g in enumerate(groups):
        pts = sorted(((unit[c], g.scores[c], c) for c in g.scores), key=lambda p: (p[0], p[1]))
        hull: list[tuple] = []
        for p in pts:
            if hull and p[1] >= hull[-1][1]:
                continue  # costs more and predicts no less loss: dominated
            while len(hull) >= 2:
                (c1, s1, _), (c2, s2, _) = hull[-2], hull[-1]
                # keep hull[-1] only if the drop per bit from hull[-2] to it beats the drop from it to p
                if (s1 - s2) / (c2 - c1) <= (s2 - p[1]) / (p[0] - c2):
                    hull.pop()
                else:
                    break
            hull.append(p)
        start[g.leader] = hull[0][2]
        for (c1, s1, _), (c2, s2, name) in zip(hull, hull[1:], strict=False):
            moves.append(((s1 - s2) / ((c2 - c1) * g.params), -gi, g.leader, name))  # per bit of the model
    moves.sort(key=lambda m: (-m[0], -m[1]))
    chain, current = [], dict(start)
    for k in range(len(moves) + 1):
        if k:
            _, _, leader, name = moves[k - 1]
            current[leader] = name
        b, aq, pred = totals(groups, choices, current, fixed_params)
        ms = latency.predict(groups, current) if latency else None
        chain.append(Candidate(f"k{k}", dict(current), b, aq, pred, k, ms))
    return chain


def uniform(groups: list[Group], choices: dict[str, Choice], name: str, fixed_params: int,
            latency: LatencyModel | None = None) -> Candidate:
    """Every group at one format (a uniform configuration, off the frontier, for comparison)."""
    assignment = {g.leader: name for g in groups}
    b, aq, pred = totals(groups, choices, assignment, fixed_params)
    return Candidate(f"uniform {name}", assignment, b, aq, pred, None,
                     latency.predict(groups, assignment) if latency else None)


def next_k(chain: list[Candidate], evaluated: list[tuple[Candidate, dict]], lo: int, hi: int, target: float) -> int:
    """The next frontier position to evaluate, strictly between the dearest fail lo and the cheapest pass hi:
    where the slack, interpolated linearly in predicted score, reaches `target`."""
    pts = sorted({(c.predicted, slack(doc)) for c, doc in evaluated} | {(0.0, 1.0)})
    fails = [p for p in pts if p[1] < 0]
    passes = [p for p in pts if p[1] >= 0]
    if fails and passes:
        a = min(fails, key=lambda p: p[0])  # the failing point with the least predicted loss
        b = max((p for p in passes if p[0] < a[0]), key=lambda p: p[0], default=(0.0, 1.0))
    else:
        two = sorted(pts, key=lambda p: p[0])[:2] if not fails else [(0.0, 1.0), min(fails, key=lambda p: p[0])]
        b, a = two[0], two[-1]
    if a[0] == b[0] or a[1] == b[1]:
        want = (a[0] + b[0]) / 2
    else:
        want = b[0] + (target - b[1]) * (a[0] - b[0]) / (a[1] - b[1])
    k = next((i for i, c in enumerate(chain) if c.predicted <= want), len(chain) - 1)
    # safeguard (regula falsi can creep one candidate at a time along a flat stretch): stay in the middle half of
    # the bracket, so every evaluation removes at least a quarter of it
    margin = (hi - lo) // 4
    return min(max(k, lo + max(1, margin)), hi - max(1, margin))


# ------------------------------------------------------------------------------------- sensitivity
_LIVE: dict[str, Sensitivity] = {}  # sensitivity key -> the Sensitivity whose AutoQuantize model is live here


class Sensitivity:
    """AutoQuantize over the allowed formats: the scores (a cached artifact) and, once computed in this process, the
    calibrated model whose per-group formats can be switched for export."""

    def __init__(self, cfg: Config, ctx, r, choices: list[Choice]):
        self.cfg, self.ctx, self.r, self.choices = cfg, ctx, r, choices
        self.model = None
        self.fixed_params = 0  # lm_head parameters (kept at 16 bits), known once the scores are loaded
        self.state: dict | None = None  # AutoQuantize's search state (candidate_stats: its own re-solve needs it)
        self.batches: list = []
        self.recipes: dict[str, object] = {}  # choice name -> AutoQuantize's QuantRecipe
        self.kv_ready = False

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
        self.fixed_params = doc["fixed_params"]
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
        _LIVE.clear()  # one calibrated model kept per process
        _LIVE[self.key()] = self
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
        """The calibrated AutoQuantize model, from this process if it has one, else calibrated again."""
        live = _LIVE.get(self.key())
        if self.model is None and live is not None:  # calibrated earlier in this process (a stricter gate, an API user)
            self.model, self.recipes, self.batches, self.state = live.model, live.recipes, live.batches, live.state
        if self.model is None:
            log.info("search: a new candidate needs the calibrated model: running AutoQuantize again (same data, "
                     "same result)")
            self.calibrate()

    def export(self, cand: Candidate, kv: str, out: Path, groups: list[Group]) -> dict:
        """Switch every group to its format, add the KV quantizers if asked, and export a unified checkpoint."""
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

            def jitter(module, args, out):
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


EXPORT_CHECK_TOKENS = 128


def choice_by_name(choices: list[Choice], name: str) -> Choice:
    """The Choice of that name."""
    return next(c for c in choices if c.name == name)


# ------------------------------------------------------------------------------------------ driver
@dataclass
class Evaluation:
    """One candidate exported and evaluated: its label, the export, the run directory and metrics.json."""
    label: str
    candidate: Candidate
    kv: str
    export: str
    run_dir: str
    exit_code: int
    doc: dict = field(repr=False)
    latency: dict | None = None  # measured engine latency (search.cost=latency)

    @property
    def passed(self) -> bool:
        """The gate's verdict on the export."""
        return bool(self.doc["gate"]["passed"])

    def row(self, choices: dict[str, Choice]) -> dict:
        """The search report's row: costs, formats per group count, verdict, slack, metrics with intervals."""
        m, run = self.doc["metrics"], self.doc["run"]
        counts: dict[str, int] = {}
        for name in self.candidate.assignment.values():
            counts[name] = counts.get(name, 0) + 1
        return {"label": self.label, "k": self.candidate.k, "kv_cache": self.kv, "bits": round(self.candidate.bits, 4),
                "aq_bits": round(self.candidate.aq_bits, 4), "predicted_score": self.candidate.predicted,
                "stored_bits_measured": self.doc.get("search_stored_bits"),
                "formats": counts, "verdict": "PASS" if self.passed else "FAIL", "slack": round(slack(self.doc), 4),
                "metrics": {k: {"value": m[k]["value"], "ci": m[k].get("ci95")} if k in m else
                            {"value": None, "ci": None} for k in ("top1_agreement", "ppl_ratio", "kl_mean")},
                "failed": [c["name"] for c in self.doc["gate"]["checks"] if not c["passed"]] +
                          [f"audit {e}" for e in self.doc.get("audit_errors", [])],
                "windows": run["eval"]["windows"], "tokens": run["eval"]["tokens"], "run_dir": self.run_dir,
                "export": self.export, "exit_code": self.exit_code,
                "latency_ms_predicted": self.candidate.latency_ms,
                "latency_ms": self.latency["ms"] if self.latency else None,
                "latency_iqr_ms": self.latency["iqr_ms"] if self.latency else None}


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


def run_search(cfg: Config, run_dir: Path, snapshot: dict, argv: list[str]):
    """+search: sensitivity, frontier, evaluations of exports until the cheapest passing one is found (module
    docstring); writes search.json, report.md / report.html and run.json into run_dir. Exit 0 with a winner, 1
    when nothing quantized passes, 2 (QuantlabError) on input refused before calibration."""
    from quantlab.graph import Executor
    from quantlab.models import quantized_in_dims
    from quantlab.pipeline import context
    from quantlab.rundir import set_aside_previous
    from quantlab.stages import data, prepare

    start = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    set_aside_previous(run_dir)
    for name in ("search.json", "frontier.png", "winner", "evals"):  # an earlier search's files
        if (run_dir / name).exists() or (run_dir / name).is_symlink():
            prev = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
            prev.mkdir(parents=True, exist_ok=True)
            os.replace(run_dir / name, prev / name)
    if not hasattr(cfg.engine, "checkpoint") or cfg.engine.checkpoint is not None:
        raise QuantlabError(f"the search evaluates what it exports; engine={type(cfg.engine).__name__} does not run "
                            "an exported checkpoint, or engine.checkpoint is set",
                            fix="use engine=torch (the default) or engine=trtllm, without engine.checkpoint")
    if cfg.stop_after:
        raise QuantlabError("stop_after does not apply to +search", fix="drop stop_after")
    if cfg.search.cost == "latency":
        from quantlab.engines.registry import engine_of

        if engine_of(cfg.engine).name != "torch":
            raise QuantlabError(f"search.cost=latency times engine=torch; this search runs engine="
                                f"{engine_of(cfg.engine).name}", fix="use engine=torch, or search.cost=bits")
    if cfg.gate.baseline:
        raise QuantlabError("gate.baseline does not apply to +search (a regression check needs one configuration)",
                            fix="run the winner with gate.baseline=... afterwards")
    check_search_config(cfg)
    thresholds = check_gate_feasible(cfg)
    ctx = context(cfg)
    steps = [prepare.step(ctx), data.step(ctx, data.CALIB), data.step(ctx, data.EVAL)]
    r = Executor(ctx, steps)
    ref = r.value("prepare")
    from quantlab.families import family_of

    family = family_of(ref.config, cfg.model.unverified_family)
    if family is not None and family.moe:
        raise QuantlabError(f"{ref.name} is a Mixture-of-Experts model ({family.name}); the search supports dense "
                            "models (per-expert formats are not verified end to end)",
                            fix="run uniform precisions on this model: -m +precision=fp8,int4_awq")
    if cfg.search.cost == "latency":
        tokens, limit = cfg.search.latency_tokens or cfg.eval.seq_len, ref.config.get("max_position_embeddings")
        if limit and tokens > limit:
            raise QuantlabError(f"search.latency_tokens={tokens} exceeds {ref.name}'s {limit} positions",
                                fix=f"set search.latency_tokens <= {limit}")
    choices = choices_for(cfg, quantized_in_dims(ref))
    for c in choices:
        if c.precision:
            preflight.check_device(dataclasses.replace(cfg, precision=PRECISION_SCHEMAS[c.precision]()), ctx.device)
            if c.precision == "nvfp4" and ctx.device.type != "cuda":
                raise QuantlabError("nvfp4 in search.formats needs CUDA (ModelOpt calibrates NVFP4 only there)",
                                    fix="drop nvfp4 from search.formats on this machine")
    r.value("data:calib")
    r.value("data:eval")
    sens = Sensitivity(cfg, ctx, r, choices)
    groups, fixed_params, scores_doc = sens.load()
    by_name = {c.name: c for c in choices}
    kv_order = list(dict.fromkeys(cfg.search.kv_cache))
    base_kv = kv_order[0]
    fixed_modules = scores_doc["fixed_modules"]
    kind = cfg.search.cost
    timings: dict[str, dict] = {}  # export path -> measured latency (cost=latency)
    latency = None
    if kind == "latency":
        latency = latency_profile(cfg, ctx, sens, groups, fixed_modules, by_name, fixed_params, ref, base_kv, timings)
    chain = frontier(groups, by_name, kind, fixed_params, latency)

    def cost_of(c: Candidate) -> float:
        return {"bits": c.bits, "aq_bits": c.aq_bits, "latency": c.latency_ms}[kind]

    def span(a: Candidate, b: Candidate) -> float:
        """Stored bits between two candidates for the resolution stop (also under cost=latency)."""
        return abs(cost_of(a) - cost_of(b)) if kind != "latency" else abs(a.bits - b.bits)

    log.info("search: %d layer groups, %d frontier candidates from %.2f to %.2f %s", len(groups), len(chain),
             cost_of(chain[0]), cost_of(chain[-1]), "ms (predicted)" if kind == "latency" else kind)
    evaluations: list[Evaluation] = []
    budget = cfg.search.max_evaluations

    def measured_ms(e: Evaluation) -> float:
        return e.latency["ms"] if e.latency else math.inf

    def evaluate(cand: Candidate, kv: str) -> Evaluation:
        ev = evaluate_candidate(cfg, ctx, sens, groups, fixed_modules, cand, kv, run_dir, argv)
        if kind == "latency":
            ev.latency = timings.get(ev.export) or measure_latency(cfg, ctx, Path(ev.export))
            timings[ev.export] = ev.latency
        evaluations.append(ev)
        lat = (f", {ev.latency['ms']:.1f} ms measured ({cand.latency_ms:.1f} predicted)" if ev.latency else "")
        log.info("search: %s: %.3f bits (%.3f AutoQuantize bits)%s -> %s (slack %.3f, %d windows)", ev.label,
                 cand.bits, cand.aq_bits, lat, "PASS" if ev.passed else "FAIL", slack(ev.doc),
                 ev.doc["run"]["eval"]["windows"])
        return ev

    if len(chain) == 1:  # cost=latency: no allowed format is faster than the unquantized model on this device
        return _finish(cfg, run_dir, snapshot, argv, start, thresholds, choices, groups, fixed_params, scores_doc,
                       chain, evaluations, None, ref, False, latency)
    # 1. the cheapest candidate (every group at its cheapest format: uniform int4 at the model's block size)
    first = evaluate(chain[0], base_kv)
    lo, hi = (-1, 0) if first.passed else (0, len(chain) - 1)
    # 2. uniform FP8, the usual safe choice, for comparison (and a point to interpolate from)
    fp8 = uniform(groups, by_name, "fp8", fixed_params, latency) if "fp8" in by_name else None
    if not first.passed and fp8 is not None and fp8.assignment != first.candidate.assignment and \
            len(evaluations) < budget:
        evaluate(fp8, base_kv)
    # 3. the frontier between the dearest fail and the cheapest pass
    top_known = False  # whether the last quantized frontier candidate was evaluated
    reserve = min(len(kv_order) - 1, max(budget - 2, 0))  # evaluations kept for the KV formats tried last
    while not first.passed and len(evaluations) < budget - reserve:
        passing_ks = [e.candidate.k for e in evaluations if e.passed and e.candidate.k is not None]
        failing_ks = [e.candidate.k for e in evaluations if not e.passed and e.candidate.k is not None]
        lo = max(failing_ks, default=-1)
        best_pass = min((e for e in evaluations if e.passed), key=lambda e: cost_of(e.candidate), default=None)
        # the bracket's upper end: the cheapest chain pass, or the first chain candidate that costs as much as a
        # configuration off the chain that passed (uniform fp8), or past the end of the chain
        hi = min(passing_ks, default=len(chain))
        if best_pass is not None and best_pass.candidate.k is None:
            hi = min(hi, next((i for i, c in enumerate(chain) if cost_of(c) >= cost_of(best_pass.candidate)),
                              len(chain)))
        if hi - lo <= 1 or (hi < len(chain) and span(chain[hi], chain[lo]) <= cfg.search.resolution_bits):
            break
        k = next_k(chain, [(e.candidate, e.doc) for e in evaluations], lo, hi, 0.0)
        if best_pass is not None and cost_of(chain[k]) >= cost_of(best_pass.candidate):
            break  # the frontier has nothing cheaper than a configuration that already passed
        if k == len(chain) - 1:
            k = len(chain) - 2  # the last candidate is the unquantized model: evaluate the least quantized instead
            top_known = True
        evaluate(chain[k], base_kv)
        if top_known and not evaluations[-1].passed:
            break
    passing = [e for e in evaluations if e.passed]
    if kind == "latency":  # the fastest measured; a configuration not measured faster than unquantized is no win
        passing = [e for e in passing if measured_ms(e) <= (1.0 - cfg.search.min_speedup) * latency.none_ms]
        winner = min(passing, key=lambda e: (measured_ms(e), -slack(e.doc)), default=None)
    else:
        winner = min(passing, key=lambda e: (cost_of(e.candidate), -slack(e.doc)), default=None)
    # 4. cheaper KV formats on the winner (under cost=latency only if measured faster too)
    if winner is not None:
        for kv in kv_order[1:]:
            if len(evaluations) >= budget:
                break
            ev = evaluate(winner.candidate, kv)
            if ev.passed and kv == "fp8" and (kind != "latency" or measured_ms(ev) < measured_ms(winner)):
                winner = ev
    return _finish(cfg, run_dir, snapshot, argv, start, thresholds, choices, groups, fixed_params, scores_doc, chain,
                   evaluations, winner, ref, top_known, latency)


def _finish(cfg, run_dir, snapshot, argv, start, thresholds, choices, groups, fixed_params, scores_doc, chain,
            evaluations, winner, ref, top_known, latency):
    """search.json, the reports, the winner link, run.json and the final line; the exit code."""
    doc = _document(cfg, thresholds, choices, groups, fixed_params, scores_doc, chain, evaluations, winner, ref,
                    time.time() - start, argv, top_known, latency)
    _write_reports(run_dir, doc, chain, evaluations, winner, groups, cfg)
    if winner is not None:
        from quantlab.rundir import link

        link(run_dir / "winner", Path(winner.export))
        lat = ""
        if winner.latency and latency:
            lat = (f", {winner.latency['ms']:.1f} ms per forward pass measured "
                   f"({winner.latency['ms'] / latency.none_ms:.2f}x the unquantized {latency.none_ms:.1f} ms)")
        what = (f"search: {'fastest' if latency else 'cheapest'} passing configuration {winner.label}: "
                f"{winner.candidate.bits:.2f} bits per weight "
                f"({winner.candidate.aq_bits:.2f} as AutoQuantize counts){lat}, ppl ratio "
                f"{winner.doc['metrics']['ppl_ratio']['value']:.3f}, "
                f"top-1 {winner.doc['metrics']['top1_agreement']['value']:.3f}"
                f", {len(evaluations)} evaluations -> {run_dir / 'winner'}")
        code = EXIT_OK
    elif latency is not None and len(chain) == 1:
        what = (f"search: no allowed format is faster than the unquantized model in engine=torch on this device "
                f"(unquantized {latency.none_ms:.1f} ms; " +
                ", ".join(f"uniform {n} {m['ms']:.1f} ms" for n, m in latency.measured.items() if n != "none") +
                f"; min_speedup {cfg.search.min_speedup:.0%}), so no quantization is cheaper in latency "
                f"(evidence in {run_dir / 'report.md'})")
        code = EXIT_GATE_FAILED
    elif latency is not None and any(e.passed for e in evaluations):
        what = (f"search: the configurations that pass the gate are not measured faster than the unquantized model "
                f"({latency.none_ms:.1f} ms) by search.min_speedup={cfg.search.min_speedup:.0%} "
                f"(evidence in {run_dir / 'report.md'})")
        code = EXIT_GATE_FAILED
    else:
        what = ("search: no quantization passes the gate: " + ("even the least quantized configuration fails"
                if top_known else f"none of the {len(evaluations)} evaluated configurations passes") +
                f" (evidence in {run_dir / 'report.md'})")
        code = EXIT_GATE_FAILED
    record = {"argv": argv, "config": snapshot, "versions": versions(), "exit_code": code,
              "wall_time_s": round(time.time() - start, 1), "search": {"evaluations": len(evaluations)}}
    write_json_atomic(run_dir / "run.json", record)
    print(f"quantlab: {what} in {time.time() - start:.0f} s")
    from quantlab.rundir import RunResult

    return RunResult(code, run_dir, doc, record)


def export_candidate(ctx, sens: Sensitivity, groups: list[Group], cand: Candidate, kv: str) -> Path:
    """A candidate's export: a cached artifact keyed by the sensitivity, the assignment and the KV format."""
    assignment = {g.leader: cand.assignment[g.leader] for g in groups}
    digest = hashlib.sha256(json.dumps([assignment, kv], sort_keys=True).encode()).hexdigest()[:16]
    key = ctx.store.key("export", search=sens.key(), assignment=digest, kv=kv, version=SEARCH_VERSION)
    art, _ = ctx.store.get_or_build("export", key, lambda out: Built(sens.export(cand, kv, out, groups)),
                                    {"search": sens.key(), "label": cand.label}, describe=f"export {cand.label}")
    return art.path


def evaluate_candidate(cfg: Config, ctx, sens: Sensitivity, groups: list[Group], fixed_modules: list[str],
                       cand: Candidate, kv: str, run_dir: Path, argv: list[str]) -> Evaluation:
    """Export a candidate (export_candidate) and evaluate the checkpoint like any run, into run_dir/evals/<label>."""
    path = export_candidate(ctx, sens, groups, cand, kv)
    label = cand.label + ("" if kv == "none" else f" kv={kv}")
    sub = run_dir / "evals" / _slug(label)
    code, doc = _evaluate_export(cfg, path, kv, sub, argv)
    doc["search_stored_bits"] = round(stored_bits(path, groups, fixed_modules, sens.fixed_params), 4)
    return Evaluation(label, cand, kv, str(path), str(sub), code, doc)


def measure_latency(cfg: Config, ctx, path: Path | None, ref=None) -> dict:
    """search.cost=latency: an export's latency in engine=torch, or (path None) the unquantized model's."""
    from quantlab.search import latency as lt

    s = cfg.search
    args = (ctx.device, ctx.dtype, s.latency_batch, s.latency_tokens or cfg.eval.seq_len, s.latency_repeats,
            cfg.model.device_map)
    return lt.measure_reference(ref, *args) if path is None else lt.measure_export(path, *args)


def latency_profile(cfg: Config, ctx, sens: Sensitivity, groups: list[Group], fixed_modules: list[str],
                    by_name: dict[str, Choice], fixed_params: int, ref, kv: str,
                    timings: dict[str, dict]) -> LatencyModel:
    """The unquantized model and every uniform format (exported; the exports are the search's own cached
    artifacts) timed in engine=torch; each format's cost per weight from them (quantlab.search.latency)."""
    from quantlab.search.latency import per_weight_costs

    measured = {"none": measure_latency(cfg, ctx, None, ref)}
    for name in by_name:
        if name == "none":
            continue
        path = export_candidate(ctx, sens, groups, uniform(groups, by_name, name, fixed_params), kv)
        measured[name] = timings[str(path)] = measure_latency(cfg, ctx, path)
    none_ms = measured["none"]["ms"]
    per_weight, slow = per_weight_costs(none_ms, {n: m["ms"] for n, m in measured.items() if n != "none"},
                                        sum(g.params for g in groups), cfg.search.min_speedup)
    log.info("search: latency of a %d x %d prefill in engine=torch: %s", cfg.search.latency_batch,
             cfg.search.latency_tokens or cfg.eval.seq_len,
             ", ".join(f"{n} {m['ms']:.1f} ms" for n, m in measured.items()))
    return LatencyModel(none_ms, per_weight, measured, slow)


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


def _evaluate_export(cfg: Config, path: Path, kv: str, run_dir: Path, argv: list[str]) -> tuple[int, dict]:
    """One full gate evaluation of an exported checkpoint: the normal pipeline with engine.checkpoint, the base
    thresholds for every format (gate.per_precision off: one bar)."""
    from dataclasses import asdict

    from quantlab.checkpoint import read_quant_config
    from quantlab.pipeline import run_pipeline

    quant = read_quant_config(path, required=True)
    precision = precision_by_algo(quant.quant_algo)
    evaluation = cfg.eval if generations_gated(cfg) else dataclasses.replace(cfg.eval, gen_prompts=0)
    sub = dataclasses.replace(cfg, precision=PRECISION_SCHEMAS[precision.name](),
                              kv_cache=KvCacheConfig(kv), engine=dataclasses.replace(cfg.engine, checkpoint=str(path)),
                              gate=dataclasses.replace(cfg.gate, per_precision={}), search=None, eval=evaluation)
    code = run_pipeline(sub, run_dir.resolve(), asdict(sub), reproduce_argv(argv, path)).exit_code
    metrics, audit = run_dir / "metrics.json", run_dir / "audit.json"
    if not metrics.is_file() and audit.is_file():  # the audit stopped the run: a broken export fails, unevaluated
        from quantlab.audit import AuditReport

        errors = AuditReport.from_dict(json.loads(audit.read_text())).errors
        return code, {"gate": {"passed": False, "checks": []}, "metrics": {},
                      "run": {"eval": {"windows": 0, "tokens": 0}},
                      "audit_errors": [f"[{f.check}] {f.message}" for f in errors]}
    if not metrics.is_file():
        raise RuntimeError(f"the evaluation of {path} left no metrics.json (exit {code})")
    return code, json.loads(metrics.read_text())


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


# ------------------------------------------------------------------------------------------ reports
def _layer_map(groups: list[Group], assignment: dict[str, str]) -> dict:
    """Per decoder layer, the format of each group (named by its first member's last two name parts)."""
    rows: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for g in groups:
        parts = g.leader.removesuffix(".quant_recipe").split(".")
        layer = next((p for p in parts if p.isdigit()), "-")
        col = "+".join(m.split(".")[-1] for m in g.modules)
        if col not in columns:
            columns.append(col)
        rows.setdefault(layer, {})[col] = assignment[g.leader]
    return {"columns": columns, "rows": [{"layer": k, "formats": v} for k, v in rows.items()]}


def _document(cfg, thresholds, choices, groups, fixed_params, scores_doc, chain, evaluations, winner, ref, seconds,
              argv, top_known, latency: LatencyModel | None = None) -> dict:
    by_name = {c.name: c for c in choices}
    rows = [e.row(by_name) for e in evaluations]
    return {
        "schema": 1, "model": ref.name, "argv": argv, "wall_time_s": round(seconds, 1),
        "cost": cfg.search.cost, "thresholds": thresholds,
        "design": dataclasses.asdict(cfg.gate.statistical),
        "choices": [{"name": c.name, "bits": c.bits(), "aq_bits": c.aq_bits()} for c in choices],
        "sensitivity": {k: scores_doc[k] for k in ("method", "seconds", "score_windows", "seq_len", "calib_windows",
                                                   "measure_seconds", "spearman_vs_autoquantize") if k in scores_doc},
        "groups": len(groups), "fixed_params": fixed_params,
        "frontier": [{"k": c.k, "bits": round(c.bits, 4), "aq_bits": round(c.aq_bits, 4), "predicted": c.predicted,
                      "latency_ms": c.latency_ms} for c in chain],
        "latency": None if latency is None else {
            "batch": cfg.search.latency_batch, "tokens": cfg.search.latency_tokens or cfg.eval.seq_len,
            "repeats": cfg.search.latency_repeats, "min_speedup": cfg.search.min_speedup,
            "unquantized_ms": latency.none_ms, "measured": latency.measured,
            "per_weight_ms": latency.per_weight, "not_faster": latency.not_faster},
        "evaluations": rows, "evaluations_used": len(evaluations), "max_evaluations": cfg.search.max_evaluations,
        "generations": generations_gated(cfg) and cfg.eval.gen_prompts > 0,
        "tokens_used": sum(r["tokens"] for r in rows),
        "winner": None if winner is None else {
            **winner.row(by_name), "layer_map": _layer_map(groups, winner.candidate.assignment),
            "reproduce": "python -m quantlab " + shlex.join(reproduce_argv(argv, Path(winner.export)))},
        "no_quantization_passes": winner is None, "least_quantized_evaluated": top_known,
        "versions": versions(),
    }


def _write_reports(run_dir: Path, doc: dict, chain, evaluations, winner, groups, cfg) -> None:
    from quantlab.artifacts import write_text_atomic
    from quantlab.report.plots import search_frontier
    from quantlab.report.render import environment

    write_json_atomic(run_dir / "search.json", doc)
    plot = search_frontier(doc)
    env = environment()
    ctx = {"doc": doc, "plot": plot, "winner": doc["winner"], "rows": doc["evaluations"]}
    write_text_atomic(run_dir / "report.md", env.get_template("search.md.j2").render(ctx))
    write_text_atomic(run_dir / "report.html", env.get_template("search.html.j2").render(ctx))
