"""Report plots (matplotlib, Agg), returned as data: URIs so the HTML stays one self-contained file."""
from __future__ import annotations

import base64
import io

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


def sqnr_bars(rows: list[dict]) -> str | None:
    """Weight SQNR per quantized layer (the audit's rows), the five worst in red."""
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, max(3, 0.12 * len(rows))))
    names = [r["module"].replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "") for r in rows]
    values = [min(r["sqnr_db"], 80) for r in rows]
    worst = np.argsort(values)[:5]
    colors = ["tab:red" if i in worst else "tab:blue" for i in range(len(rows))]
    ax.barh(np.arange(len(rows)), values, color=colors)
    ax.set_yticks(np.arange(len(rows)))
    ax.set_yticklabels(names, fontsize=5 if len(rows) > 40 else 7)
    ax.invert_yaxis()
    ax.set_xlabel("weight SQNR (dB, higher is better; red = 5 worst)")
    ax.set_title("Quantization error of the exported weights per linear layer")
    return _uri(fig)


def pareto(rows: list[dict]) -> str | None:
    """Quality (ppl ratio, lower is better) vs checkpoint size, Pareto front marked."""
    pts = [(r["size_bytes"] / 2**20, r["ppl_ratio"], r["label"]) for r in rows
           if r.get("size_bytes") and r.get("ppl_ratio")]
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    front = pareto_front([(s, q) for s, q, _ in pts])
    for i, (s, q, label) in enumerate(pts):
        on = i in front
        ax.scatter([s], [q], s=60 if on else 30, color="tab:green" if on else "tab:gray", zorder=3)
        ax.annotate(label, (s, q), textcoords="offset points", xytext=(5, 4), fontsize=8)
    fx = sorted((pts[i][0], pts[i][1]) for i in front)
    ax.plot([p[0] for p in fx], [p[1] for p in fx], "--", color="tab:green", label="Pareto front")
    ax.set_xlabel("checkpoint size on disk (MiB)")
    ax.set_ylabel("perplexity ratio vs reference (lower is better)")
    ax.set_title("Quality vs size")
    ax.legend()
    return _uri(fig)


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
    ax.annotate(row["label"], (x, y), textcoords="offset points", xytext=(6, 5), fontsize=8, parse_math=False)
    return "passed its gates" if passed else "did not pass"


def speed_figure(rows: list[dict]):
    """Quality (ppl ratio, lower is better) vs decode speedup over the unquantized model at batch 1 (with its
    interval), runs that passed their gates filled, the Pareto front over (faster, closer to the reference) ringed and
    dashed; the matplotlib figure, None when no row measured its speed at batch 1."""
    pts = [r for r in rows if r.get("speed_b1") and r.get("ppl_ratio")]
    if not pts:
        return None
    plt = _plt()
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(7, 4))
    front = pareto_front([(-r["speed_b1"]["value"], r["ppl_ratio"]) for r in pts])
    kinds = {_speed_point(ax, r, i in front) for i, r in enumerate(pts)}
    fx = sorted((pts[i]["speed_b1"]["value"], pts[i]["ppl_ratio"]) for i in front)
    ax.plot([p[0] for p in fx], [p[1] for p in fx], "--", color="black", alpha=0.6)
    ax.axvline(1.0, color="tab:gray", ls=":")
    runs = {"passed its gates": Line2D([], [], marker="o", ls="", color="tab:green", label="passed its gates"),
            "did not pass": Line2D([], [], marker="o", ls="", mfc="none", color="tab:red", label="did not pass")}
    ax.legend(handles=[runs[k] for k in runs if k in kinds] + [
        Line2D([], [], marker="o", ls="--", mfc="none", ms=12, color="black",
               label="Pareto front: no other run is both faster and closer"),
        Line2D([], [], ls=":", color="tab:gray", label="unquantized speed (1x)")], fontsize=8)
    ax.set_xlabel("decode speedup over the unquantized model at batch 1 (paired rounds, interval)")
    ax.set_ylabel("perplexity ratio vs reference (lower is better)")
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
