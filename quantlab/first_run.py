"""What a step's work() reads of the run (quantlab.costs.work, priced by quantlab.prior): the model's shape and the
tokens, from what is built or, on a machine's or a model's first run, before it is, from the configuration alone:
the embedded model's declared shape (conf/model/*.yaml), num_samples x seq_len calibration tokens, the windows the
evaluation text's characters give. The pipeline and the plan call the same work() functions."""
from __future__ import annotations

from quantlab.prior import Shape

CHARS_PER_TOKEN = 4.0  # characters of English prose and code per token (the default text: 4.2 with SmolLM2's)


def model(r) -> tuple[Shape | None, int, dict]:
    """(shape, parameters, config) of the run's model: the prepared model's, else the embedded model's declared
    shape; Pending (quantlab.step) when neither is known."""
    from quantlab.step import Pending

    try:
        ref = r.value("prepare")
        return Shape.of(ref.config, ref.num_params), ref.num_params, ref.config
    except Pending:
        emb = r.ctx.cfg.model.embedded
        if emb is None or not emb.shape:
            raise
        hint = dict(emb.shape)
        return Shape.of(hint, hint.get("params")), int(hint.get("params") or 0), hint


def calib_tokens(r) -> int:
    """Calibration tokens: the token set's, else num_samples x seq_len."""
    from quantlab.step import Pending

    try:
        calib = r.value("data:calib")
        return calib.num_windows * calib.seq_len
    except Pending:
        return r.ctx.cfg.calib.num_samples * r.ctx.cfg.calib.seq_len


def eval_windows(r) -> int:
    """Evaluation windows the text gives: the token set's, else estimated from its characters (_cold_windows)."""
    from quantlab.step import Pending

    try:
        return r.value("data:eval").num_windows
    except Pending:
        return _cold_windows(r.ctx.cfg)


def passing_tokens(r) -> int:
    """The tokens a passing run's evaluation reads (gate.checks.passing_windows: the first look where its tail
    checks can pass, 64 of the default text's 70 windows; a failing run may stop earlier, an undecided one reads on to
    the cap). Was: one look's windows, 8-20x too low for a passing run."""
    from quantlab.gate.checks import passing_windows

    cfg = r.ctx.cfg
    return passing_windows(cfg.gate, r.ctx.precision.name, eval_windows(r), cfg.eval.max_windows,
                           cfg.eval.seq_len) * cfg.eval.seq_len


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
