"""What the search refuses, and why, before it calibrates anything: search.* options, the run options a search does
not take, the gate every candidate is held to, the per-layer choices for this model's widths and this device.
Every refusal is a QuantlabError (exit 2) naming the fix.
"""
from __future__ import annotations

import dataclasses

from quantlab.config import Config, SearchConfig
from quantlab.errors import QuantlabError
from quantlab.gate.metrics import METRICS
from quantlab.precisions import PRECISION_SCHEMAS, PRECISIONS
from quantlab.search.frontier import Choice

SEARCHABLE = ("int4_awq", "w4a8_awq", "fp8", "nvfp4", "none")  # per-layer formats AutoQuantize calibrates and the
# torch engine runs inside one MIXED_PRECISION checkpoint
LATENCY_OPTIONS = ("latency_batch", "latency_tokens", "latency_repeats", "min_speedup")  # search.cost=latency only


def _check_formats(s: SearchConfig) -> None:
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


def _check_cost(s: SearchConfig) -> None:
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
        default = SearchConfig()
        unused = [f"search.{k}={getattr(s, k)}" for k in LATENCY_OPTIONS if getattr(s, k) != getattr(default, k)]
        if unused:
            raise QuantlabError(f"{', '.join(unused)} only apply to search.cost=latency; this search minimizes "
                                f"{s.cost}", fix="add search.cost=latency, or drop them")


def _check_budget(s: SearchConfig) -> None:
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


def _check_kv_and_blocks(s: SearchConfig) -> None:
    if not s.kv_cache:
        raise QuantlabError("search.kv_cache is empty", fix="give [none], [fp8] or [none,fp8]")
    for kv in s.kv_cache:
        if kv not in ("none", "fp8"):
            raise QuantlabError(f"search.kv_cache has {kv!r}", fix="use none and/or fp8")
    bad = [b for b in s.int4_block_sizes if not isinstance(b, int) or b <= 0]
    if bad:
        raise QuantlabError(f"search.int4_block_sizes {bad} are not positive integers", fix="e.g. [32]")


def check_search_config(cfg: Config) -> None:
    """Everything about search.* that is known without the model (exit 2 naming the fix), in a fixed order:
    formats, cost and the latency options, the evaluation budget and sensitivity, KV formats and block sizes.

    Raises:
        QuantlabError: the first option refused.
    """
    for check in (_check_formats, _check_cost, _check_budget, _check_kv_and_blocks):
        check(cfg.search)


def check_search_run(cfg: Config) -> None:
    """The run options a search does not take: an engine that cannot run an export (or a fixed checkpoint),
    stop_after, a latency search on an engine other than torch, a regression baseline.

    Raises:
        QuantlabError: the first option refused.
    """
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


def check_model(cfg: Config, ref) -> None:
    """What the model decides: a Mixture-of-Experts model is refused (dense models only), and a latency search's
    token count must fit the model's positions.

    Args:
        cfg: the search's config.
        ref: the prepared model (quantlab.models.ModelRef).

    Raises:
        QuantlabError: the model or the latency token count is refused.
    """
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


def choices_for(cfg: Config, in_dims: dict[str, int]) -> list[Choice]:
    """The search's per-layer options for this model's layer widths, checked before any compute.

    Args:
        cfg: the search's config (search.formats, search.int4_block_sizes).
        in_dims: input width of every quantizable linear layer (quantlab.models.quantized_in_dims).

    Returns:
        Every quantized format (blockwise ones at the model's block size, then each other block size asked for),
        then `none`.

    Raises:
        QuantlabError: search.* is refused, or a block size does not divide a layer's input width.
    """
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


def check_choices_on_device(cfg: Config, choices: list[Choice], device) -> None:
    """Every quantized choice must run on this device (the checks a uniform run of that precision has; NVFP4
    calibrates only on CUDA).

    Raises:
        QuantlabError: a format in search.formats cannot run here.
    """
    from quantlab import preflight

    for c in choices:
        if c.precision:
            preflight.check_device(dataclasses.replace(cfg, precision=PRECISION_SCHEMAS[c.precision]()), device)
            if c.precision == "nvfp4" and device.type != "cuda":
                raise QuantlabError("nvfp4 in search.formats needs CUDA (ModelOpt calibrates NVFP4 only there)",
                                    fix="drop nvfp4 from search.formats on this machine")


def check_gate_feasible(cfg: Config) -> dict:
    """The gate every candidate is held to (base thresholds). A threshold the unquantized model itself cannot pass
    (its ideal value is on or beyond it) makes the search pointless: exit 2 before calibration.

    Returns:
        metric -> its threshold as a dict (min, max, ...), the search's one quality bar.

    Raises:
        QuantlabError: the gate has no thresholds, or one that even the unquantized model cannot pass.
    """
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
