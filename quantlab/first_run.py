"""The plan of a machine's (or a model's) first run: the work of every step priced from the configuration alone,
before anything it reads is built (quantlab.prior turns the work into seconds)."""
from __future__ import annotations

from quantlab.prior import Shape, audit, calibration, evaluation, export, reference

CHARS_PER_TOKEN = 4.0  # characters of English prose and code per token (the default text: 4.2 with SmolLM2's)


def _cold_shape(r) -> Shape | None:
    """The model's shape before anything is built: the local checkpoint's config, else the embedded model's
    declared shape (conf/model/*.yaml)."""
    from quantlab.step import Pending

    try:
        ref = r.value("prepare")
        return Shape.of(ref.config, ref.num_params)
    except Pending:
        emb = r.ctx.cfg.model.embedded
        hint = dict(emb.shape) if emb is not None and emb.shape else None
        return Shape.of(hint, hint.get("params")) if hint else None


def _cold_windows(cfg, precision: str | None = None) -> int:
    """Evaluation windows a run will read, before its text is tokenized: the text's characters at CHARS_PER_TOKEN,
    in full windows, up to the pool (eval.pool_windows); of those, what a passing run of the precision reads
    (gate.checks.passing_windows: up to the cap, eval.max_windows); with no precision, all of them up to the cap."""
    from quantlab.gate.checks import passing_windows
    from quantlab.stages import data

    pool = min(x for x in (cfg.eval.pool_windows, 10 ** 9) if x)
    try:
        chars = data.source(cfg.eval, data.EVAL).length
        prefix = 0 if cfg.eval.prefix_token in (None, "none") else 1
        windows = max(1, min(pool, int(chars / CHARS_PER_TOKEN // max(1, cfg.eval.seq_len - prefix))))
    except Exception:  # noqa: BLE001 - the plan prices; the run itself reports a bad source
        windows = pool
    if precision is None:
        return min(windows, cfg.eval.max_windows or windows)
    return passing_windows(cfg.gate, precision, windows, cfg.eval.max_windows, cfg.eval.seq_len)


def cold_work(r, name: str) -> dict | None:
    """The work() of step `name` when its inputs are not built yet (a machine's or a model's first run): the same
    record from the configuration alone (the model's shape, num_samples x seq_len calibration tokens, the windows
    the evaluation text gives); None for steps it cannot price."""
    from quantlab import costs

    cfg, ctx = r.ctx.cfg, r.ctx
    shape = _cold_shape(r)
    if shape is None:
        return None
    dev, recipe = costs.device_label(ctx.device), f"{ctx.precision.name}/kv={cfg.kv_cache.dtype}"
    calib_tokens = cfg.calib.num_samples * cfg.calib.seq_len
    eval_tokens = _cold_windows(cfg, ctx.precision.name) * cfg.eval.seq_len
    if name in ("data:calib", "data:eval"):
        from quantlab.stages import data

        role = data.CALIB if name == "data:calib" else data.EVAL
        try:
            length = data.source(getattr(cfg, role.name), role).length
        except Exception:  # noqa: BLE001
            return None
        return costs.work("cpu", role.name, size=length, units={"bytes": length})
    if name == "quantize":
        passes = costs.precision_passes(ctx.precision.name, {"hidden_size": shape.hidden,
                                        "intermediate_size": shape.inter, "num_attention_heads": shape.heads,
                                        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim},
                                        cfg.calib.seq_len)
        return costs.work(dev, recipe, shape.params, calib_tokens, passes=passes,
                          units=calibration(shape, calib_tokens, cfg.calib.seq_len, cfg.calib.batch_size, passes))
    if name == "export":
        return costs.work(dev, recipe, shape.params, units=export(shape))
    if name == "audit":
        from quantlab.stages.audit import CANARY

        return costs.work(dev, "audit", shape.params, units=audit(shape, CANARY["windows"], CANARY["tokens"]))
    prompts = cfg.eval.gen_prompts if cfg.eval.gen_tokens else 0
    if name == "reference":
        return costs.work(dev, "reference", shape.params, eval_tokens,
                          units=reference(shape, eval_tokens, cfg.eval.seq_len, cfg.eval.batch_size,
                                          (prompts, cfg.eval.gen_tokens)))
    if name.startswith("evaluate:"):
        if name == "evaluate:served":  # a server's time is its own machine's: nothing here prices it
            return None
        main = name == f"evaluate:{ctx.engine.name}"  # the numerics check runs for the gated engine only
        look = cfg.gate.statistical.look_windows * cfg.eval.seq_len if cfg.eval.numerics and main else 0
        return costs.work(dev, f"{name.split(':', 1)[1]}:{recipe}", shape.params, eval_tokens,
                          units=evaluation(shape, eval_tokens, cfg.eval.seq_len, cfg.eval.batch_size, look,
                                           (prompts, cfg.eval.gen_tokens)))
    return None
