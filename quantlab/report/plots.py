"""Report plots (matplotlib, Agg), returned as data: URIs so the HTML stays one self-contained file."""
from __future__ import annotations

import base64
import io
import re

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _smooth(y: np.ndarray, width: int) -> np.ndarray:
    if width <= 1 or y.size < width:
        return y
    return np.convolve(y, np.ones(width) / width, mode="valid")


def ppl_per_window(windows: dict) -> str:
    """Perplexity of reference and candidate per evaluated window (a data URI)."""
    plt = _plt()
    ref, cand = np.exp(windows["nll_reference"]), np.exp(windows["nll_candidate"])
    fig, ax = plt.subplots(figsize=(7, 3))
    x = np.arange(ref.size)
    ax.plot(x, ref, "o-", ms=3, label="reference")
    ax.plot(x, cand, "s-", ms=3, label="candidate")
    ax.set_xlabel("evaluation window")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity per window (same tokens)")
    ax.legend()
    return _uri(fig)


def along_position(positions: dict) -> str:
    """Top-1 agreement and mean KL along the window's positions (a data URI)."""
    plt = _plt()
    agree, kl = np.asarray(positions["top1_agreement"]), np.asarray(positions["kl_mean"])
    width = max(1, agree.size // 32)
    fig, ax1 = plt.subplots(figsize=(7, 3))
    ax1.plot(_smooth(agree, width), color="tab:blue")
    ax1.set_ylabel("top-1 agreement", color="tab:blue")
    ax1.set_xlabel(f"position in window (moving average over {width})")
    ax2 = ax1.twinx()
    ax2.plot(_smooth(kl, width), color="tab:red")
    ax2.set_ylabel("KL(ref || cand)", color="tab:red")
    ax1.set_title("Agreement and KL along the window")
    return _uri(fig)


def kl_histogram(kl_values: np.ndarray) -> str:
    """Histogram of the per-position KL on a log scale (a data URI)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    values = np.clip(np.asarray(kl_values, dtype=np.float64), 1e-8, None)
    ax.hist(np.log10(values), bins=60, color="tab:red", alpha=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("log10 KL(ref || cand) per position")
    ax.set_ylabel("positions")
    ax.set_title("Distribution of per-position KL")
    return _uri(fig)


# a decoder layer's linear module: <...>.layers.<i>.<role> (Llama, Qwen, Gemma, Mistral; h / blocks for others);
# the role drops its sublayer prefix (self_attn., mlp.) and expert indices (experts.5.down_proj -> experts.down_proj)
_LAYER_MODULE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.(.+)$")
_SUBLAYER = re.compile(r"^(?:self_attn|attn|attention|mlp|feed_forward|block_sparse_moe)\.")
ROLE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SQNR_SHOWN = (-20.0, 80.0)  # the plot's SQNR range (dB): an exact layer's 999 dB would flatten every other line
WORST_NAMED = 5
MAX_ROLES = 9  # roles beyond the nine with most layers are drawn as one grey "other roles"


def layer_role(module: str) -> tuple[int | None, str]:
    """(layer index, role) of a linear module's name: model.layers.17.mlp.down_proj -> (17, "down_proj"); a module
    outside the numbered layers (lm_head) -> (None, its name)."""
    m = _LAYER_MODULE.search(module)
    if not m:
        return None, module
    return int(m.group(1)), re.sub(r"\.\d+\.", ".", _SUBLAYER.sub("", m.group(2)))


def short_name(module: str) -> str:
    """A module as the plot names it: L17 down_proj (the module's name where it is in no numbered layer)."""
    layer, role = layer_role(module)
    return role if layer is None else f"L{layer} {role}"


def _role_key(role: str) -> tuple:
    base = role.rpartition(".")[2]
    return (ROLE_ORDER.index(base) if base in ROLE_ORDER else len(ROLE_ORDER), role)


def _sqnr_bounds(rows: list[dict]) -> list[tuple[str, float, float]]:
    """(format, error bound, warning bound) in dB of every format among the rows: what the audit holds it to."""
    from quantlab.audit.bounds import weight_bounds

    return [(f, weight_bounds(f).sqnr_error_db, weight_bounds(f).sqnr_warn_db)
            for f in sorted({str(r.get("format")) for r in rows})]


def _role_lines(parsed: list[tuple[int | None, str, float]], outside: int) -> dict[str, dict[int, list[float]]]:
    """role -> layer index -> SQNRs of its modules there; beyond MAX_ROLES roles, those with fewest layers merged
    into "other roles"."""
    by_role: dict[str, dict[int, list[float]]] = {}
    for layer, role, v in parsed:
        by_role.setdefault(role, {}).setdefault(outside if layer is None else layer, []).append(v)
    if len(by_role) <= MAX_ROLES + 1:
        return {k: by_role[k] for k in sorted(by_role, key=_role_key)}
    ranked = sorted(by_role, key=lambda k: (-len(by_role[k]), _role_key(k)))
    lines = {k: by_role[k] for k in sorted(ranked[:MAX_ROLES], key=_role_key)}
    other: dict[int, list[float]] = {}
    for k in ranked[MAX_ROLES:]:
        for x, vs in by_role[k].items():
            other.setdefault(x, []).extend(vs)
    return {**lines, "other roles": other}


def weight_sqnr_figure(rows: list[dict]):
    """Weight SQNR of every quantized layer (the audit's rows: module, format, sqnr_db, ...) against its depth, one
    line per role (q/k/v/o/gate/up/down; a role with several modules per layer, experts, draws its worst per layer
    and every module as a dot), the audit's error and warning bounds of each format dashed and dotted, the five
    worst layers ringed, numbered and listed beside the axes with their SQNR. The figure's size does not depend on
    the number of layers (a model of 210 layers reads as one of 14). The matplotlib figure; None without rows."""
    if not rows:
        return None
    plt = _plt()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    lo, hi = SQNR_SHOWN
    parsed = [(*layer_role(r["module"]), float(r["sqnr_db"])) for r in rows]
    depth = max((p[0] for p in parsed if p[0] is not None), default=-1) + 1
    unlayered = any(p[0] is None for p in parsed)  # lm_head and the like: drawn one step past the last layer
    values = [v for _, _, v in parsed]
    shown = np.clip(values, lo, hi)
    fig, ax = plt.subplots(figsize=(6.6, 3.4))
    handles = []
    for i, (role, points) in enumerate(_role_lines(parsed, depth).items()):
        xs = sorted(points)
        color = "tab:gray" if role == "other roles" else plt.get_cmap("tab10").colors[i % 10]
        (line,) = ax.plot(xs, np.clip([min(points[x]) for x in xs], lo, hi), "o-", ms=2.5, lw=1, color=color,
                          label=role.replace("$", r"\$"), gid=f"sqnr-{role}")  # a name is no mathtext
        if any(len(points[x]) > 1 for x in xs):
            ax.scatter([x for x in xs for _ in points[x]], np.clip([v for x in xs for v in points[x]], lo, hi),
                       s=4, color=color, alpha=0.35)
        handles.append(line)
    bounds = _sqnr_bounds(rows)
    for fmt_name, err, warn in bounds:
        for kind, y, ls, color in (("error", err, "--", "tab:red"), ("warning", warn, ":", "tab:orange")):
            name = f"{fmt_name} {kind} bound {y:g} dB" if len(bounds) > 1 else f"audit's {kind} bound {y:g} dB"
            handles.append(ax.axhline(y, ls=ls, color=color, lw=1.2, label=name, gid=f"sqnr-{kind}-bound"))
    span = [*shown, *(b[1] for b in bounds)]
    pad = max(0.08 * (max(span) - min(span)), 0.5)
    ax.set_ylim(min(span) - pad, max(span) + pad)
    ax.set_xlim(-0.5, depth + (0.5 if unlayered else -0.5))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    worst = sorted(range(len(rows)), key=lambda i: values[i])[:WORST_NAMED]
    xy = [(depth if parsed[i][0] is None else parsed[i][0], float(shown[i])) for i in worst]
    ax.scatter([x for x, _ in xy], [y for _, y in xy], s=70, facecolors="none", edgecolors="tab:red",
               linewidths=1.3, zorder=5, gid="sqnr-worst")
    handles.append(Line2D([], [], marker="o", ls="", mfc="none", mec="tab:red", ms=8, label="worst (numbered)"))
    for ann in place_labels(ax, [(x, y, str(k + 1)) for k, (x, y) in enumerate(xy)], fontsize=7):
        ann.set_color("tab:red")
    named = "\n".join(f"{k + 1}  {short_name(rows[i]['module'])}  {values[i]:.1f} dB" for k, i in enumerate(worst))
    ax.text(1.02, 1.0, f"worst layers\n{named}", transform=ax.transAxes, va="top", ha="left", fontsize=7.5,
            family="monospace", gid="sqnr-worst-names", parse_math=False)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=4, fontsize=7, frameon=False)
    ax.set_xlabel(f"layer index ({depth} layers)" + (f"; {depth}: modules outside the layers" if unlayered else ""))
    clipped = f" (shown within {lo:g} to {hi:g})" if np.any(shown != np.asarray(values)) else ""
    ax.set_ylabel(f"weight SQNR, dB{clipped}\n(higher is better)")
    ax.set_title(f"Quantization error of the exported weights: {len(rows)} linear layers by depth and role",
                 fontsize=10)
    return fig


def weight_sqnr(rows: list[dict]) -> str | None:
    """weight_sqnr_figure as a data URI; None without rows."""
    fig = weight_sqnr_figure(rows)
    return _uri(fig) if fig is not None else None


MIN_RATIO_SPAN = 0.02  # the perplexity-ratio axis spans at least 2% of the reference's perplexity
MIN_SPEEDUP_SPAN = 0.1  # the speedup axis spans at least 0.1x
FRONT_LABEL = "Pareto front (runs above or right of it are dominated)"


def _limits(values: list[float], min_span: float, pad: float = 0.08) -> tuple[float, float]:
    """An axis range over values, at least min_span wide (widened about its middle) and padded by `pad` of its span
    on each side: points that differ by less than min_span are not spread over the whole axis."""
    lo, hi = min(values), max(values)
    if hi - lo < min_span:
        mid = (lo + hi) / 2
        lo, hi = mid - min_span / 2, mid + min_span / 2
    return lo - pad * (hi - lo), hi + pad * (hi - lo)


def _ratio_axis(ax, rows: list[dict]) -> None:
    """The perplexity-ratio (y) axis: the runs' ratios, their intervals and the reference's 1.0, at least
    MIN_RATIO_SPAN wide; plain tick labels on both axes (no offset such as "+1" over the ticks)."""
    values = [1.0] + [r["ppl_ratio"] for r in rows] + [v for r in rows for v in (r.get("ppl_ratio_ci") or [])]
    ax.set_ylim(*_limits(values, MIN_RATIO_SPAN))
    ax.ticklabel_format(axis="both", style="plain", useOffset=False)


def _ratio_err(row: dict) -> list[list[float]]:
    """matplotlib's yerr of a run's perplexity ratio: its interval (none: no bar)."""
    q = row["ppl_ratio"]
    lo, hi = row.get("ppl_ratio_ci") or [q, q]
    return [[max(q - lo, 0.0)], [max(hi - q, 0.0)]]


def _inside(ext, box) -> bool:
    return box.x0 <= ext.x0 and ext.x1 <= box.x1 and box.y0 <= ext.y0 and ext.y1 <= box.y1


def place_labels(ax, points: list[tuple[float, float, str]], fontsize: int = 8) -> list:
    """Label each point (x, y, text) beside it, inside the axes and clear of the labels placed before it: right of
    a point in the left half of the axes, left of one in the right half; stacked above the point, then below it,
    where that place is taken (runs of one size and quality). Call once the axis limits are set; the annotations."""
    renderer = ax.figure.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    to_points = 72 / ax.figure.dpi
    placed, out = [], []
    for x, y, text in points:
        left = ax.transData.transform((x, y))[0] > (box.x0 + box.x1) / 2
        dx = -6 if left else 6
        ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, 4), ha="right" if left else "left",
                          va="bottom", fontsize=fontsize, parse_math=False, annotation_clip=False)
        step = ann.get_window_extent(renderer).height * to_points + 1
        tries = [4 + k * step for k in range(len(points))] + [-4 - k * step for k in range(1, len(points) + 1)]
        fits = []
        for dy in tries:
            ann.xyann = (dx, dy)
            ext = ann.get_window_extent(renderer)
            if _inside(ext, box):
                fits.append(dy)
                if not any(ext.overlaps(p) for p in placed):
                    fits = [dy]
                    break
        if fits:
            ann.xyann = (dx, fits[0])
        else:  # no place beside the point inside the axes: moved in
            ann.xyann = (dx, 4)
            ext = ann.get_window_extent(renderer)
            shift_x = max(box.x0 - ext.x0, 0) + min(box.x1 - ext.x1, 0)
            shift_y = max(box.y0 - ext.y0, 0) + min(box.y1 - ext.y1, 0)
            ann.xyann = (dx + shift_x * to_points, 4 + shift_y * to_points)
        placed.append(ann.get_window_extent(renderer))
        out.append(ann)
    return out


def _legend_below(ax, handles: list) -> None:
    """The legend under the axes (never over a point or a label)."""
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)


def staircase(front: list[tuple[float, float]], x_max: float, y_max: float) -> tuple[list[float], list[float]]:
    """The Pareto front over (size, ratio) as the edge of what its runs dominate: up from the smallest run on it to
    y_max, then across and down through each next run, to x_max at the last one's ratio. Drawn for one run too."""
    pts = sorted(front)
    xs, ys = [pts[0][0]], [y_max]
    for i, (s, q) in enumerate(pts):
        xs += [s, pts[i + 1][0] if i + 1 < len(pts) else x_max]
        ys += [q, q]
    return xs, ys


def pareto_figure(rows: list[dict]):
    """Quality (ppl ratio with its interval, lower is better) vs checkpoint size on disk: the Pareto front drawn as
    the edge of what its runs dominate, the unquantized model (its size, ratio 1) where the rows say its size. The
    size axis starts at 0 (and reaches the unquantized size): checkpoints a few percent apart sit together, as they
    are. The matplotlib figure; None when no row has a size and a ratio."""
    pts = [r for r in rows if r.get("size_bytes") and r.get("ppl_ratio")]
    if not pts:
        return None
    plt = _plt()
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [r["size_bytes"] / 2**20 for r in pts]
    refs = {r["size_bytes"] / r["size_vs_reference"] / 2**20 for r in pts if r.get("size_vs_reference")}
    models = {r.get("model") for r in pts}
    ref = max(refs) if refs and len(models) == 1 and max(refs) - min(refs) <= 0.01 * max(refs) else None
    ax.set_xlim(0, max(sizes + ([ref] if ref else [])) * 1.1)
    _ratio_axis(ax, pts)
    front = pareto_front([(s, r["ppl_ratio"]) for s, r in zip(sizes, pts, strict=True)])
    for i, (s, r) in enumerate(zip(sizes, pts, strict=True)):
        color = "tab:green" if i in front else "tab:gray"
        ax.errorbar([s], [r["ppl_ratio"]], yerr=_ratio_err(r), fmt="o", ms=8 if i in front else 6, color=color,
                    ecolor=color, elinewidth=1, capsize=3, zorder=4 if i in front else 3)
    xs, ys = staircase([(sizes[i], pts[i]["ppl_ratio"]) for i in front], ax.get_xlim()[1], ax.get_ylim()[1])
    (line,) = ax.plot(xs, ys, "--", color="tab:green", lw=1.2, gid="pareto-front", label=FRONT_LABEL)
    handles = [line, Line2D([], [], marker="o", ls="", color="tab:green", label="run on the front")]
    if len(front) < len(pts):
        handles.append(Line2D([], [], marker="o", ls="", color="tab:gray", label="dominated run"))
    if ref:
        ax.scatter([ref], [1.0], marker="s", s=50, facecolors="none", edgecolors="black", zorder=3)
        handles.append(Line2D([], [], marker="s", ls="", mfc="none", color="black",
                              label=f"unquantized model ({ref:.4g} MiB, ratio 1)"))
    place_labels(ax, [(s, r["ppl_ratio"], r["label"]) for s, r in zip(sizes, pts, strict=True)])
    _legend_below(ax, handles)
    ax.set_xlabel("checkpoint size on disk (MiB)")
    ax.set_ylabel("perplexity ratio vs reference, interval\n(lower is better)")
    ax.set_title("Quality vs size")
    return fig


def pareto(rows: list[dict]) -> str | None:
    """pareto_figure as a data URI; None when no row has a size and a ratio."""
    fig = pareto_figure(rows)
    return _uri(fig) if fig is not None else None


def _speed_point(ax, row: dict, on_front: bool) -> str:
    """One run on the quality vs speed plot: its speedup interval as a bar, filled green when it passed its gates,
    hollow red otherwise, ringed when on the front; returns its legend entry."""
    x, (lo, hi), y = row["speed_b1"]["value"], row["speed_b1"]["ci"], row["ppl_ratio"]
    passed = row["verdict"] == "PASS"
    color = "tab:green" if passed else "tab:red"
    ax.errorbar([x], [y], xerr=[[max(x - lo, 0.0)], [max(hi - x, 0.0)]], fmt="o", ms=7, mec=color,
                mfc=color if passed else "none", ecolor=color, capsize=3, zorder=3)
    if on_front:
        ax.scatter([x], [y], s=200, facecolors="none", edgecolors="black", zorder=4)
    return "passed its gates" if passed else "did not pass"


def speed_figure(rows: list[dict]):
    """Quality (ppl ratio, lower is better) vs decode speedup over the unquantized model at batch 1 (with its
    interval), runs that passed their gates filled, the Pareto front over (faster, closer to the reference) ringed and
    dashed (the legend shows a dashed line only where one is drawn: two runs or more on the front); the speedup axis
    holds 1x and every interval, at least MIN_SPEEDUP_SPAN wide. The matplotlib figure, None when no row measured its
    speed at batch 1."""
    pts = [r for r in rows if r.get("speed_b1") and r.get("ppl_ratio")]
    if not pts:
        return None
    plt = _plt()
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_xlim(*_limits([1.0] + [v for r in pts for v in (r["speed_b1"]["value"], *r["speed_b1"]["ci"])],
                         MIN_SPEEDUP_SPAN))
    _ratio_axis(ax, pts)
    front = pareto_front([(-r["speed_b1"]["value"], r["ppl_ratio"]) for r in pts])
    kinds = {_speed_point(ax, r, i in front) for i, r in enumerate(pts)}
    fx = sorted((pts[i]["speed_b1"]["value"], pts[i]["ppl_ratio"]) for i in front)
    line = len(set(fx)) > 1
    if line:
        ax.plot([p[0] for p in fx], [p[1] for p in fx], "--", color="black", alpha=0.6, gid="speed-front")
    ax.axvline(1.0, color="tab:gray", ls=":")
    runs = {"passed its gates": Line2D([], [], marker="o", ls="", color="tab:green", label="passed its gates"),
            "did not pass": Line2D([], [], marker="o", ls="", mfc="none", color="tab:red", label="did not pass")}
    place_labels(ax, [(r["speed_b1"]["value"], r["ppl_ratio"], r["label"]) for r in pts])
    _legend_below(ax, [runs[k] for k in runs if k in kinds] + [
        Line2D([], [], marker="o", ls="--" if line else "", mfc="none", ms=12, color="black",
               label="Pareto front: no other run is both faster and closer"),
        Line2D([], [], ls=":", color="tab:gray", label="unquantized speed (1x)")])
    ax.set_xlabel("decode speedup over the unquantized model at batch 1 (paired rounds, interval)")
    ax.set_ylabel("perplexity ratio vs reference, interval\n(lower is better)")
    ax.set_title("Quality vs decode speed (batch 1)")
    return fig


def speed_pareto(rows: list[dict]) -> str | None:
    """speed_figure as a data URI; None when no row measured its speed at batch 1."""
    fig = speed_figure(rows)
    return _uri(fig) if fig is not None else None


def pareto_front(points: list[tuple[float, float]]) -> set[int]:
    """Indices of points not dominated (smaller size and lower ratio both better)."""
    front = set()
    for i, (s, q) in enumerate(points):
        if not any((s2 <= s and q2 <= q) and (s2 < s or q2 < q) for j, (s2, q2) in enumerate(points) if j != i):
            front.add(i)
    return front


def search_frontier(doc: dict) -> str | None:
    """The search: the frontier's predicted loss against cost (line) and every evaluated configuration's ppl ratio
    with its interval, pass or fail (points), the ppl threshold and the winner."""
    rows = [r for r in doc["evaluations"] if (r["metrics"].get("ppl_ratio") or {}).get("value") is not None]
    if not rows:
        return None
    plt = _plt()
    cost = {"bits": "bits", "aq_bits": "aq_bits", "latency": "latency_ms"}[doc["cost"]]  # latency: measured ms
    rows = [r for r in rows if r.get(cost) is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in rows:
        m = r["metrics"]["ppl_ratio"]
        lo, hi = (m["ci"] or [m["value"], m["value"]])
        color = "tab:green" if r["verdict"] == "PASS" else "tab:red"
        x = r[cost]
        ax.errorbar([x], [m["value"]], yerr=[[m["value"] - lo], [hi - m["value"]]], fmt="o", color=color, capsize=3,
                    zorder=3)
        ax.annotate(r["label"], (x, m["value"]), textcoords="offset points", xytext=(5, 4), fontsize=7)
    th = (doc["thresholds"].get("ppl_ratio") or {}).get("max")
    if th:
        ax.axhline(th, color="tab:gray", ls=":", label=f"ppl ratio threshold {th}")
    front = [f for f in doc["frontier"][:-1] if f.get(cost) is not None]
    if front:
        ax2 = ax.twinx()
        ax2.plot([f[cost] for f in front], [f["predicted"] for f in front], color="tab:blue", alpha=0.5,
                 label="frontier: predicted loss (AutoQuantize score)")
        ax2.set_ylabel("predicted loss increase (score)", color="tab:blue")
        ax2.legend(loc="upper center", fontsize=8)
    if doc.get("winner"):
        w = doc["winner"]
        unit = "ms" if cost == "latency_ms" else "bits"
        ax.axvline(w[cost], color="tab:green", ls="--", alpha=0.6, label=f"winner {w[cost]:.2f} {unit}")
    ax.set_xlabel({"bits": "bits per weight (stored, scales included)",
                   "aq_bits": "bits per weight (AutoQuantize count)",
                   "latency_ms": "engine latency, ms (measured; frontier: predicted)"}[cost])
    ax.set_ylabel("perplexity ratio (95% interval)")
    ax.set_title("Search: evaluated configurations on the frontier")
    ax.legend(loc="upper right", fontsize=8)
    return _uri(fig)
