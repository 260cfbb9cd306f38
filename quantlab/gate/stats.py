"""Statistics of the gate: paired per-window intervals, the group-sequential design, decisions and their power.

Units. Candidate and reference are scored on the same tokens. A window is a contiguous block of tokens; the
per-token values inside a window are dependent, and so are the windows of one document (a topic, an article, a
record), so every interval is computed over per-window values with the document as the cluster (`Clusters`,
`interval`): the mean of window means (the token mean: windows have equal lengths) with the CR2 cluster-robust
variance (Bell-McCaffrey: each document's residual total divided by sqrt(1 - n_g / N)) and Satterthwaite degrees of
freedom for that variance, widened on the side a right or left skew of the document totals threatens (Hall's
transformation). When every window is its own document this is exactly the t interval over windows with n - 1
degrees of freedom. Its coverage under within-document correlation, skew and rare bad windows is checked by
simulation of the gate's own decisions in bench/gate_calibration.py.

Tails. A share of windows whose value exceeds a bound (`decide_tail`) is tested as a count with exact binomial
group-sequential boundaries: at each look the largest count that may still pass is the one whose exact probability
of passing so far, when the true share is on the threshold, stays within the alpha spent by that look. That is exact
for independent windows only; windows of one document move together, so a PASS also needs the upper confidence
bound of the windows' (1 - share) quantile on the log scale, with documents as clusters (`tail_quantile_bound`: a
one-way random-effects model, generalized pivotal quantities), to be below the bound.

Sequential design. Evaluation proceeds in looks of `look_windows` windows up to the cap (eval.max_windows or the
text's windows). Each check is a one-sided test of "the metric is on the good side of its threshold": PASS when the
whole interval at a look's boundary is on the good side, FAIL when it is wholly on the bad side, otherwise
undecided and the next look is taken; undecided at the cap is a FAIL. The boundaries come from Lan-DeMets
alpha spending (Pocock-type, O'Brien-Fleming-type, or Hwang-Shih-DeCani with parameter gamma) computed for the
Brownian-motion information fractions n_k / N by the Armitage-McPherson-Rowe recursion, then turned into t
quantiles with n_k - 1 degrees of freedom (the variance is estimated). The overall probability of PASS when the true
value sits on the threshold is alpha (type-I error); at the reported minimum detectable effect the probability
of PASS is at least 1 - beta. Both are checked by simulation, not asserted.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SPENDING = ("pocock", "obf", "hsd")


# --------------------------------------------------------------------------------------------- intervals
def t_interval(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi) of a t-interval over independent units; degenerate (a point) when n < 2 or no spread."""
    from scipy import stats

    v = np.asarray(values, dtype=np.float64)
    mean = float(v.mean())
    if v.size < 2 or float(v.std(ddof=1)) == 0.0:
        return mean, mean, mean
    half = float(stats.t.ppf(0.5 + confidence / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
    return mean, mean - half, mean + half


def clustered_interval(values, clusters: Clusters | None, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi) of a two-sided interval of the mean with the windows' documents as clusters (the gate's CR2
    interval with its Bell-McCaffrey degrees of freedom and skew correction, at `confidence`); the t interval of
    `t_interval` when every window is its own document. Point-valued when there is no spread."""
    from scipy import stats

    v = np.asarray(values, dtype=np.float64)
    if clusters is None or clusters.singletons or clusters.n != v.size:
        return t_interval(v, confidence)
    if clusters.g < 2:
        mean = float(v.mean())
        return mean, -math.inf, math.inf
    c = float(stats.t.ppf(0.5 + confidence / 2, max(clusters.df, 1e-3)))
    mean, lo, hi, _ = interval(v, c, clusters)
    return float(mean), float(lo), float(hi)


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Score interval for a proportion; stays inside [0, 1] and is sane for small n."""
    if n == 0:
        return 0.0, 1.0
    zz = z(0.5 + confidence / 2)
    p = successes / n
    denom = 1 + zz * zz / n
    centre = (p + zz * zz / (2 * n)) / denom
    half = zz * math.sqrt(p * (1 - p) / n + zz * zz / (4 * n * n)) / denom
    lo = 0.0 if successes <= 0 else max(0.0, centre - half)  # exact ends: the formula gives 0 / 1 up to rounding
    hi = 1.0 if successes >= n else min(1.0, centre + half)
    return lo, hi


def z(p: float) -> float:
    """The standard normal quantile of p."""
    from scipy import stats

    return float(stats.norm.ppf(p))


def percentile(values, q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics (numpy's default, Hyndman-Fan type 7;
    what llama.cpp's KL statistics use)."""
    v = np.asarray(values, dtype=np.float64)
    return float(np.quantile(v, q)) if v.size else float("nan")


WORKING_ICC = 0.5  # the intra-document correlation the degrees of freedom assume (bench/gate_calibration.py)


class Clusters:
    """The documents of the first n windows (their ids in window order), with what the cluster-robust interval
    needs: sizes, CR2 weights 1 / (1 - n_g / N) and the Bell-McCaffrey degrees of freedom. None of it depends on the
    values, so one layout serves every look of every simulated dataset."""

    def __init__(self, ids):
        ids = np.asarray(ids)
        self.n = int(ids.size)
        _, self.inverse, self.sizes = np.unique(ids, return_inverse=True, return_counts=True)
        self.g = int(self.sizes.size)
        self.singletons = self.g == self.n
        with np.errstate(divide="ignore"):
            self.weights = 1.0 / (1.0 - self.sizes / self.n)  # inf for one document holding every window
        self._onehot = None

    @property
    def df(self) -> float:
        """Satterthwaite degrees of freedom of the CR2 variance of a mean (Bell and McCaffrey) under a working model
        of exchangeable windows within a document, correlation WORKING_ICC: (tr B)^2 / ||B||_F^2 with
        B = U' Omega U, U's columns sqrt(w_g) (I - H) 1_g / N. n - 1 for singletons (any working ICC); fewer
        for few or unequal documents, and fewer the more a document's windows are assumed alike."""
        if self.g < 2:
            return 0.0
        n_g = self.sizes.astype(np.float64)
        a = 1 - WORKING_ICC + WORKING_ICC * n_g  # Omega 1_g = a_g 1_g
        total = float((a * n_g).sum())
        outer = np.outer(n_g, n_g) / self.n
        b = np.diag(a * n_g) - outer * (a[:, None] + a[None, :]) + outer * total / self.n
        b *= np.sqrt(np.outer(self.weights, self.weights))
        return float(np.trace(b) ** 2 / (b * b).sum())

    def totals(self, d):
        """Per-document sums of d along its last axis ([..., n] -> [..., G])."""
        d = np.asarray(d, dtype=np.float64)
        if d.ndim == 1:
            return np.bincount(self.inverse, weights=d, minlength=self.g)
        if self._onehot is None:
            self._onehot = np.zeros((self.n, self.g))
            self._onehot[np.arange(self.n), self.inverse] = 1.0
        return d @ self._onehot


def cluster_summary(values, clusters: Clusters | None) -> dict:
    """Documents, the measured intra-document correlation of the values (one-way ANOVA estimator, unequal sizes;
    may be negative) and the design effect: the CR2 variance of the mean over the variance that independent windows
    would give (1 when every window is its own document)."""
    v = np.asarray(values, dtype=np.float64)
    n = v.size
    if clusters is None or clusters.singletons or n < 3:
        return {"clusters": int(n if clusters is None else clusters.g), "icc": None, "design_effect": 1.0,
                "df": float(max(n - 1, 0))}
    g, sizes = clusters.g, clusters.sizes
    means = clusters.totals(v) / sizes
    msb = float((sizes * (means - v.mean()) ** 2).sum() / max(g - 1, 1))
    msw = float(((v - means[clusters.inverse]) ** 2).sum() / max(n - g, 1))
    n0 = (n - (sizes ** 2).sum() / n) / max(g - 1, 1)
    icc = (msb - msw) / (msb + (n0 - 1) * msw) if msb + (n0 - 1) * msw > 0 else 0.0
    d = v - v.mean()
    naive = float((d * d).sum() / (n - 1) / n)
    t = clusters.totals(d)
    cr2 = float((clusters.weights * t * t).sum() / n ** 2) if g > 1 else math.inf
    return {"clusters": g, "icc": float(icc), "design_effect": cr2 / naive if naive > 0 else 1.0, "df": clusters.df}


def cluster_bootstrap(window_values: list[np.ndarray], statistic, confidence: float = 0.95, resamples: int = 1000,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile interval of statistic(concatenated values) resampling whole windows with replacement (seeded, so
    a rerun gives the same interval). For statistics that are not means (percentiles of per-position KL)."""
    rng = np.random.default_rng(seed)
    n = len(window_values)
    if n < 2:
        value = statistic(np.concatenate(window_values)) if n else float("nan")
        return value, value
    out = np.empty(resamples)
    for r in range(resamples):
        pick = rng.integers(0, n, n)
        out[r] = statistic(np.concatenate([window_values[i] for i in pick]))
    a = (1 - confidence) / 2
    return float(np.quantile(out, a)), float(np.quantile(out, 1 - a))


def mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for b discordant pairs one way and c the other (binomial, p = 1/2)."""
    from scipy import stats

    n = b + c
    if n == 0:
        return 1.0
    return float(min(1.0, 2 * stats.binom.cdf(min(b, c), n, 0.5)))


def clustered_mcnemar(b_per_window, c_per_window) -> tuple[float, float]:
    """(z, two-sided p) of McNemar's comparison with windows as clusters (Obuchowski's adjustment): the per-window
    difference b_i - c_i is tested for mean zero with its variance estimated between windows, so flips that come
    in bursts inside one window are not counted as independent evidence."""
    d = np.asarray(b_per_window, dtype=np.float64) - np.asarray(c_per_window, dtype=np.float64)
    n = d.size
    if n < 2 or d.std(ddof=1) == 0:
        return (0.0, 1.0) if d.sum() == 0 else (math.copysign(math.inf, d.sum()), 0.0)
    stat = d.mean() / (d.std(ddof=1) / math.sqrt(n))
    from scipy import stats

    return float(stat), float(2 * stats.t.sf(abs(stat), n - 1))


# --------------------------------------------------------------------------------------- alpha spending
def spent(t: float, alpha: float, kind: str, gamma: float = -2.0) -> float:
    """Cumulative one-sided alpha spent by information fraction t (Lan-DeMets)."""
    t = min(max(t, 0.0), 1.0)
    if t == 0:
        return 0.0
    if kind == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    if kind == "obf":
        return 2 * (1 - _phi(z(1 - alpha / 2) / math.sqrt(t)))
    if kind == "hsd":
        return alpha * t if gamma == 0 else alpha * (1 - math.exp(-gamma * t)) / (1 - math.exp(-gamma))
    raise ValueError(kind)


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


@lru_cache(maxsize=256)
def boundaries(fractions: tuple[float, ...], alpha: float, kind: str, gamma: float = -2.0) -> tuple[float, ...]:
    """Upper z boundaries c_1..c_K such that a standard Brownian motion observed at information fractions t_k
    (Z_k = S_k / sqrt(t_k)) first crosses c_k with probability spent(t_k) - spent(t_{k-1}) under the null.
    Armitage-McPherson-Rowe recursion on a grid (the density of S_k on the continuation region)."""
    from scipy import optimize, stats

    grid_n = 801
    density = None  # (s grid, density of S_{k-1} on the continuation region)
    out = []
    prev_t, prev_spent = 0.0, 0.0
    for t in fractions:
        target = spent(t, alpha, kind, gamma) - prev_spent
        dt = t - prev_t
        sd = math.sqrt(dt)
        if density is None:
            c = float(stats.norm.isf(max(target, 1e-300)))
            s = np.linspace(-10 * math.sqrt(t), c * math.sqrt(t), grid_n)
            f = stats.norm.pdf(s, scale=math.sqrt(t))
        else:
            s0, f0 = density
            w0 = np.full(s0.size, s0[1] - s0[0]) * f0  # trapezoid weights
            w0[0] *= 0.5
            w0[-1] *= 0.5

            def crossing(c_k, s0=s0, w0=w0, sd=sd, t=t):
                return float((w0 * stats.norm.sf((c_k * math.sqrt(t) - s0) / sd)).sum())

            if target <= 0:
                c = math.inf
            else:
                c = float(optimize.brentq(lambda c_k, target=target: crossing(c_k) - target, -10, 40, xtol=1e-10))
            upper = c * math.sqrt(t) if math.isfinite(c) else s0[-1] + 10 * sd
            s = np.linspace(min(s0[0] - 10 * sd, upper - 20 * sd), upper, grid_n)
            f = (w0[None, :] * stats.norm.pdf((s[:, None] - s0[None, :]) / sd) / sd).sum(1)
        out.append(c)
        density = (s, f)
        prev_t, prev_spent = t, spent(t, alpha, kind, gamma)
    return tuple(out)


@dataclass(frozen=True)
class Design:
    """A group-sequential design: looks at these window counts (the last is the cap), one-sided alpha and beta,
    the spending function. sequential=False is the fixed design: one look at the cap."""

    looks: tuple[int, ...]
    alpha: float
    beta: float
    kind: str = "pocock"
    gamma: float = -2.0
    first_pass: int = 0  # the first look at which the gate can pass (a tail check needs many windows): alpha is spent
    # over the looks from there on; before it a check can fail but not pass

    def passable(self, look: int) -> bool:
        """Whether a check may pass at this look."""
        return look >= self.first_pass

    @property
    def cap(self) -> int:
        """The last look's window count (the cap)."""
        return self.looks[-1]

    def z_boundary(self, look: int) -> float:
        """The one-sided z boundary of a look: alpha spending over the information fractions of the looks at which a
        check can pass (from first_pass on); an earlier look (fail only) has the boundary of spending over every
        look."""
        if look < self.first_pass or self.first_pass == 0:
            return boundaries(tuple(n / self.cap for n in self.looks), self.alpha, self.kind, self.gamma)[look]
        passing = tuple(n / self.cap for n in self.looks[self.first_pass:])
        return boundaries(passing, self.alpha, self.kind, self.gamma)[look - self.first_pass]

    def t_boundary(self, look: int, n: int, df: float | None = None) -> float:
        """The z boundary as a t quantile with df degrees of freedom (default n - 1; same tail probability)."""
        c = self.z_boundary(look)
        if not math.isfinite(c):
            return math.inf
        df = n - 1 if df is None else df
        return _t_isf(_phi(-c), df) if df > 0 else math.inf

    def t_beta(self, n: int, c: float | None = None, df: float | None = None) -> float:
        """Standard errors beyond the boundary c that a true effect must lie for power 1 - beta with n windows:
        the noncentrality that puts 1 - beta of a noncentral t(df) above c, minus c (about t_beta; exact for
        the estimated variance). df defaults to n - 1. Without c: the t quantile t_{1-beta, df}."""
        df = max(n - 1, 1) if df is None else max(df, 1e-3)
        return power_margin(c, df, self.beta) if c is not None and math.isfinite(c) else _t_isf(self.beta, df)

    def look_of(self, n: int) -> int:
        """Index of the look made with n windows (the last look at or below n)."""
        return max(i for i, k in enumerate(self.looks) if k <= n) if n >= self.looks[0] else 0


def make_design(cap: int, look_windows: int, alpha: float, beta: float, sequential: bool = True,
                kind: str = "pocock", gamma: float = -2.0) -> Design:
    """Looks every look_windows windows up to cap (the last look is the cap itself)."""
    if not sequential or look_windows >= cap:
        return Design((cap,), alpha, beta, kind, gamma)
    looks = list(range(look_windows, cap, look_windows))
    if cap - looks[-1] < max(2, look_windows // 2):  # a last look of a few windows adds nothing: fold it in
        looks[-1] = cap
    else:
        looks.append(cap)
    return Design(tuple(looks), alpha, beta, kind, gamma)


@lru_cache(maxsize=4096)
def _t_isf(q: float, df: float) -> float:
    from scipy import stats

    return float(stats.t.isf(q, df))


@lru_cache(maxsize=4096)
def power_margin(c: float, df: float, beta: float) -> float:
    """ncp - c, where a noncentral t(df, ncp) exceeds c with probability 1 - beta."""
    from scipy import optimize, stats

    lo = c + _t_isf(beta, df) - 1.0
    return float(optimize.brentq(lambda ncp: stats.nct.sf(c, df, ncp) - (1 - beta), lo, lo + 20, xtol=1e-8)) - c


# -------------------------------------------------------------------------------------------- decisions
def _skew_inverse(x, gamma, n: int):
    """Inverse of Hall's (1992) cubic transformation g(T) = T + gamma (1 + 2 T^2) / (6 sqrt n) + gamma^2 T^3 / (27 n),
    which is monotone and removes the skewness of a studentized mean to second order: the quantile of T whose
    transformed value is the normal (here t) quantile x.

    As a function of the skewness k = gamma / sqrt(n) the widening this gives rises, peaks and then falls back (the
    cube root changes sign), so a very skewed small sample would get a narrower interval than a moderately skewed
    one; k is therefore capped at the peak for this x (`_k_peak`), which keeps the widening monotone in k."""
    k = np.asarray(gamma, dtype=np.float64) / math.sqrt(n)
    cap = _k_peak(round(abs(float(x)), 12))
    k = np.clip(k, -cap, cap)
    a = k / 6
    u = k / 3
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (np.cbrt(1 + 3 * u * (x - a)) - 1) / np.where(u == 0, 1.0, u)
    return np.where(np.abs(u) < 1e-12, x - a, r)


@lru_cache(maxsize=1024)
def _k_peak(x: float) -> float:
    """The skewness k at which Hall's inverse at the quantile x widens the interval the most."""
    from scipy import optimize

    if x <= 0:
        return math.inf

    def width(k: float) -> float:  # how far the widened end lies beyond x (for x > 0 and k > 0: the upper end)
        return -(1 - np.cbrt(1 - 3 * (k / 3) * (x + k / 6))) / (k / 3)

    res = optimize.minimize_scalar(width, bounds=(1e-6, 20.0), method="bounded", options={"xatol": 1e-9})
    return float(res.x)


def interval(values, c: float, clusters: Clusters | None = None):
    """(mean, lo, hi, se) of the mean of per-window values, along the last axis, at the t multiplier c; with
    clusters (the documents of the windows, not all singletons) the cluster-robust version (`_cluster_interval`).

    Window values of KL, exceedance shares and (less) dNLL are right-skewed, and a symmetric t interval then
    passes 'mean <= threshold' too often: the samples that look good are the ones that missed the long tail, so
    their own skewness is small or negative. Hence each side is corrected with Hall's transformation using the
    sample skewness only when that widens it (the upper end uses max(skew, 0), the lower end min(skew, 0)), and the
    skewness is inflated by (1 + 4 / sqrt(n)) for its small-sample bias toward zero. With looks of 8 windows this
    keeps the type-I error of every check at 5% +- 1% in bench/gate_calibration.py (symmetric data: slightly
    conservative); the factor was chosen there, on simulated and resampled real window values."""
    if clusters is not None and not clusters.singletons:
        return _cluster_interval(values, c, clusters)
    v = np.asarray(values, dtype=np.float64)
    n = v.shape[-1]
    mean = v.mean(-1)
    if n < 2:
        inf = np.full(np.shape(mean), math.inf)
        return mean, -inf, inf, inf
    d = v - mean[..., None] if v.ndim > 1 else v - mean
    var = (d * d).sum(-1) / (n - 1)
    se = np.sqrt(var / n)
    if n >= 3:
        mu3 = n * (d ** 3).sum(-1) / ((n - 1) * (n - 2))
        with np.errstate(divide="ignore", invalid="ignore"):
            gamma = np.where(var > 0, mu3 / var ** 1.5, 0.0) * (1 + 4 / math.sqrt(n))
    else:
        gamma = np.zeros(np.shape(mean))
    hi = mean - se * _skew_inverse(-c, np.maximum(gamma, 0.0), n)
    lo = mean - se * _skew_inverse(c, np.minimum(gamma, 0.0), n)
    if v.ndim == 1:
        return float(mean), float(lo), float(hi), float(se)
    return mean, lo, hi, se


SKEW_INFLATION = 4.0  # the sample skewness is inflated by 1 + SKEW_INFLATION / sqrt(units) (bench/gate_calibration.py)
DOC_SKEW_INFLATION = 0.0  # the same for the skewness of the documents' totals (none: with the windows' inflated
# skewness beside it, more made pydoc's 10 documents needlessly conservative; bench/gate_calibration.py)
MDE_SAFETY = 1.0  # the reported MDE is widened by this beyond its upper confidence bound (bench/gate_calibration.py
# --rows mde: none needed; the c4-corrected point estimate needed 1.12)
MDE_CONFIDENCE = 0.9  # the reported MDE is an upper bound at this confidence on the run's own spread (chi-square with
# the interval's degrees of freedom): the MDE a run states is at least the true one in 9 runs of 10


def _mean_skewness(x, units: int, inflation: float = SKEW_INFLATION):
    """Skewness of a mean estimated from per-unit residual sums x [..., units] (adjusted Fisher-Pearson, inflated for
    its small-sample bias toward zero): gamma / sqrt(units) in Hall's notation."""
    s2 = (x * x).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(s2 > 0, (x ** 3).sum(-1) / s2 ** 1.5, 0.0)
    return k * math.sqrt(units * (units - 1)) / (units - 2) * (1 + inflation / math.sqrt(units))


def _cluster_interval(values, c: float, clusters: Clusters):
    """The interval of `interval` with documents as clusters: CR2 standard error sqrt(sum_g w_g T_g^2) / N over the
    documents' residual totals T_g (w_g = 1 / (1 - n_g / N)), and Hall's correction with the skewness of the
    adjusted totals sqrt(w_g) T_g (G sqrt(G - 1) / (G - 2) sum A^3 / (sum A^2)^1.5, inflated by 1 + 4 / sqrt(G)),
    on the side it widens. With every window its own document this is the t interval of `interval` exactly."""
    v = np.asarray(values, dtype=np.float64)
    n, g = v.shape[-1], clusters.g
    mean = v.mean(-1)
    if g < 2:
        inf = np.full(np.shape(mean), math.inf)
        out = (mean, -inf, inf, inf)
        return tuple(float(x) for x in out) if v.ndim == 1 else out
    d = v - (mean[..., None] if v.ndim > 1 else mean)
    a = clusters.totals(d) * np.sqrt(clusters.weights)
    s2 = (a * a).sum(-1)
    se = np.sqrt(s2) / n
    # skewness of the mean: from the documents' totals and from the windows (as if independent), the larger in
    # size on each side: few documents estimate it poorly, and windows miss a skewed document effect
    k_docs = _mean_skewness(a, g, DOC_SKEW_INFLATION) if g >= 3 else np.zeros(np.shape(mean))
    k_windows = _mean_skewness(d, n, SKEW_INFLATION) if n >= 3 else np.zeros(np.shape(mean))
    up, down = np.maximum(np.maximum(k_docs, k_windows), 0.0), np.minimum(np.minimum(k_docs, k_windows), 0.0)
    hi = mean - se * _skew_inverse(-c, up, 1)
    lo = mean - se * _skew_inverse(c, down, 1)
    if v.ndim == 1:
        return float(mean), float(lo), float(hi), float(se)
    return mean, lo, hi, se


@dataclass
class Decision:
    """One check at one look: the estimate, its interval at the look's boundary, and the verdict."""

    value: float  # the estimate (mean of window values, in the test's scale)
    lo: float  # interval at the boundary's level
    hi: float
    se: float
    n: int
    boundary: float  # t multiplier used
    verdict: str  # pass | fail | undecided
    mde: float  # minimum detectable distance from the threshold (test scale) at this n, power 1 - beta (reported:
    # an upper MDE_CONFIDENCE bound for means, `reported_mde`)
    mde_estimate: float | None = None  # means: the point estimate of that distance (what the bound bounds)
    df: float | None = None  # degrees of freedom of the spread the MDE is computed from
    quantile_hi: float | None = None  # tail checks: upper bound of the windows' (1 - share) quantile (latent scale)


def decide(window_values, threshold: float, higher_is_better: bool, design: Design, look: int,
           clusters: Clusters | None = None) -> Decision:
    """Test one threshold on per-window values at one look of the design (the interval of `interval`, with the
    windows' documents as clusters when given: the t quantile then has the CR2 Bell-McCaffrey degrees of freedom)."""
    v = np.asarray(window_values, dtype=np.float64)
    n = int(v.size)
    df = None if clusters is None or clusters.singletons else clusters.df
    c = design.t_boundary(look, n, df)
    if n == 0:
        return Decision(float("nan"), -math.inf, math.inf, math.inf, 0, c, "undecided", math.inf)
    mean, lo, hi, se = interval(v, c, clusters) if math.isfinite(c) else \
        (float(v.mean()), -math.inf, math.inf, math.inf)
    passed, failed = (lo >= threshold, hi < threshold) if higher_is_better else (hi <= threshold, lo > threshold)
    verdict = "pass" if passed and design.passable(look) else "fail" if failed and not passed else "undecided"
    bound, estimate = reported_mde(mde(mean, lo, hi, se, higher_is_better, c, design.t_beta(n, c, df)), df or n - 1)
    return Decision(mean, lo, hi, se, n, c, verdict, bound, mde_estimate=estimate, df=float(df or n - 1))


def reported_mde(raw, df: float):
    """(bound, estimate) of the minimum detectable effect from `mde`'s value at the observed standard error: the
    estimate divides by c4(df) (E[s] / sigma); the bound, the one reported, scales by sqrt(df / chi2_{1-q}(df)) with
    q = MDE_CONFIDENCE (the upper q confidence bound of sigma) and MDE_SAFETY. With few documents the observed
    spread varies several-fold between runs of one population (10 documents, about 3 degrees of freedom: the
    estimate 6.5x between the 10th and 90th percentile run), so a point estimate would claim too small an effect
    for half the runs; for normal windows the bound is at least the true MDE in a share q of them (skewed windows
    add the skew correction's own spread: bench/gate_calibration.py --rows mde measures power at the median and
    the 10th-percentile run's stated MDE). Works on arrays."""
    return raw * _sd_bound(df) * MDE_SAFETY, raw / _c4(df)


@lru_cache(maxsize=1024)
def _sd_bound(df: float) -> float:
    """sqrt(df / chi2_{1 - MDE_CONFIDENCE}(df)): the upper MDE_CONFIDENCE bound of sigma over s (1 when df <= 0)."""
    from scipy import stats as st

    if df <= 0:
        return 1.0
    return math.sqrt(df / float(st.chi2.ppf(1 - MDE_CONFIDENCE, df)))


@lru_cache(maxsize=1024)
def _c4(df: float) -> float:
    """E[s] / sigma for a variance estimate with df degrees of freedom: the reported MDE divides by it (an MDE from
    the observed standard error would otherwise be too small on average when df is small)."""
    if df <= 0:
        return 1.0
    return math.exp(0.5 * math.log(2 / df) + math.lgamma((df + 1) / 2) - math.lgamma(df / 2))


def mde(mean, lo, hi, se, higher_is_better: bool, c: float, t_beta: float):
    """Minimum detectable distance from the threshold with power 1 - beta at this n: the tested side's half-width
    (skew-widened, so not always c * se) plus t_beta standard errors widened in the same proportion, at the observed
    standard error (`reported_mde` turns it into the reported bound). Works on arrays (the calibration bench)."""
    half = (mean - lo) if higher_is_better else (hi - mean)
    return half * (1 + t_beta / c) if c > 0 else half + t_beta * se


def decide_binary(outcomes, threshold: float, higher_is_better: bool, design: Design, look: int) -> Decision:
    """A threshold on a proportion of independent 0/1 outcomes (generated prompts): Clopper-Pearson interval at the
    look's boundary level, so a handful of identical prompts does not make a zero-width interval."""
    from scipy import stats as st

    v = np.asarray(outcomes, dtype=np.float64)
    n, k = int(v.size), int(v.sum())
    tail = _phi(-design.z_boundary(look)) if math.isfinite(design.z_boundary(look)) else 0.0
    lo = 0.0 if k == 0 else float(st.beta.ppf(tail, k, n - k + 1))
    hi = 1.0 if k == n else float(st.beta.ppf(1 - tail, k + 1, n - k))
    mean = k / n if n else float("nan")
    if higher_is_better:
        verdict = "pass" if lo >= threshold else "fail" if hi < threshold else "undecided"
    else:
        verdict = "pass" if hi <= threshold else "fail" if lo > threshold else "undecided"
    se = math.sqrt(max(mean * (1 - mean), 0.25 / max(n, 1)) / max(n, 1))
    c = design.z_boundary(look)
    return Decision(mean, lo, hi, se, n, c, verdict, (c + z(1 - design.beta)) * se)


# ------------------------------------------------------------------------------------------------- tails
@lru_cache(maxsize=256)
def tail_boundaries(looks: tuple[int, ...], share: float, alpha: float, kind: str = "pocock",
                    gamma: float = -2.0) -> tuple[int, ...]:
    """For each look, the largest count of windows beyond the bound that still passes "share of such windows <
    `share`" (-1: no count can pass yet). Exact for independent windows: the count's distribution at the threshold
    share is carried from look to look on the paths not yet passed (binomial increments), and each look's pass
    boundary is the largest count whose probability of passing by then stays within spent(n_k / N)."""
    from scipy import stats as st

    cap = looks[-1]
    alive = np.zeros(cap + 1)
    alive[0] = 1.0
    passed, prev, out = 0.0, 0, []
    for n in looks:
        step = st.binom.pmf(np.arange(n - prev + 1), n - prev, share)
        alive = np.convolve(alive, step)[: cap + 1]
        budget = spent(n / cap, alpha, kind, gamma) - passed
        cum = np.cumsum(alive)
        c = int(np.searchsorted(cum, budget * (1 + 1e-12), side="right")) - 1
        if c >= 0:
            passed += float(cum[c])
            alive[: c + 1] = 0.0
        out.append(c)
        prev = n
    return tuple(out)


TAIL_FLOOR = 32.0  # a tail check's windows more than this factor below its bound count as that far below (latent test)
TAIL_DRAWS = 4096  # draws of the latent bound's generalized pivotal quantities (fixed seed: the gate is deterministic)
TAIL_SEED = 20261207
TAIL_MDE_SIMS = 2000  # simulated runs behind a tail check's MDE (the working model; a fixed seed)


def tail_latent(values, above: float):
    """The latent (log) scale of a tail check's per-window values: log(max(value, above / TAIL_FLOOR)); a value that
    is not a number is beyond any bound (+inf). Windows far below the bound say nothing about the tail, and a
    candidate whose windows sit at 0 (no disagreement) would otherwise have an unbounded log-scale spread."""
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(np.maximum(v, above / TAIL_FLOOR))
    return np.where(np.isnan(v), math.inf, out)


@lru_cache(maxsize=64)
def _pivot_draws(g: int, df_w: int):
    """(Z, chi2_{g-1}, chi2_{df_w} or None): the draws behind `tail_quantile_bound`, the same for every decision."""
    rng = np.random.default_rng(TAIL_SEED)
    zs, cb = rng.standard_normal(TAIL_DRAWS), rng.chisquare(g - 1, TAIL_DRAWS)
    return zs, cb, (rng.chisquare(df_w, TAIL_DRAWS) if df_w > 0 else None)


def tail_quantile_bound(latent, share: float, design: Design, look: int, clusters: Clusters | None = None,
                        draws: int = TAIL_DRAWS):
    """Upper confidence bound, at the look's one-sided level Phi(-z_k), of the (1 - share) quantile of the windows'
    latent values with documents as clusters (along the last axis; works on arrays). The model is one-way random
    effects on the latent scale: a normal document effect (variance sigma_b^2) plus a normal window effect
    (sigma_w^2), the quantile mu + z_{1-share} sqrt(sigma_b^2 + sigma_w^2). Its bound is the (1 - level) quantile
    of a generalized pivotal quantity (Weerahandi's construction, as for tolerance limits of one-way random models):
    with G documents, Ybar the unweighted mean of the documents' means and S_b^2 their variance (G - 1 degrees of
    freedom, expectation sigma_b^2 + h sigma_w^2, h the mean of 1 / n_g), SSW the within-document sum of squares
    (N - G degrees of freedom),
    G_bh = S_b^2 (G - 1) / chi2_{G-1}, G_w = SSW / chi2_{N-G}, G_b = max(G_bh - h G_w, 0),
    G_q = Ybar + Z sqrt(G_bh / G) + z_{1-share} sqrt(G_b + G_w).
    No correlation is assumed: the data's own between- and within-document spread set the width (with no document
    effect it is close to the exact normal tolerance bound; with windows as their own documents it is that bound).
    `draws` of a fixed set of TAIL_DRAWS. Fewer than 3 windows or 2 documents, a look without a finite boundary, or
    a value that is not finite: +inf."""
    v = np.asarray(latent, dtype=np.float64)
    shape, n = v.shape[:-1], v.shape[-1]
    if n == 0:  # no windows: nothing bounds the quantile
        return math.inf if not shape else np.full(shape, math.inf)
    cl = clusters if clusters is not None and clusters.n == n else Clusters(np.arange(n))
    z_k = design.z_boundary(look)
    flat = v.reshape(-1, n)
    out = np.full(flat.shape[0], math.inf)
    if n >= 3 and cl.g >= 2 and math.isfinite(z_k):
        finite = np.isfinite(flat).all(-1)
        w = np.where(np.isfinite(flat), flat, 0.0)
        means = cl.totals(w) / cl.sizes
        ssw = ((w - means[:, cl.inverse]) ** 2).sum(-1)
        mu, sb2 = means.mean(-1), means.var(-1, ddof=1)
        h, g = float((1.0 / cl.sizes).mean()), cl.g
        zs, cb, cw = (d[:draws] if d is not None else None for d in _pivot_draws(g, n - g))
        q = 1 - _phi(-z_k)
        idx = np.flatnonzero(finite)
        for i in range(0, idx.size, 256):
            sel = idx[i:i + 256]
            g_bh = sb2[sel, None] * (g - 1) / cb
            g_w = ssw[sel, None] / cw if cw is not None else 0.0
            g_q = mu[sel, None] + zs * np.sqrt(g_bh / g) + z(1 - share) * np.sqrt(np.maximum(g_bh - h * g_w, 0.0)
                                                                                  + g_w)
            out[sel] = np.quantile(g_q, q, axis=-1)
    return float(out[0]) if not shape else out.reshape(shape)


def tail_verdicts(beyond, share: float, design: Design, look: int, latent=None, bound: float | None = None,
                  clusters: Clusters | None = None):
    """The tail test's verdict codes (1 pass, -1 fail, 0 undecided) on [..., n] 0/1 outcomes, with the count, the
    Clopper-Pearson bounds at the look's level and the latent quantile bound: PASS when the count is at most the
    look's exact binomial boundary (`tail_boundaries`) and, given the latent values, their (1 - share) quantile's
    upper bound (`tail_quantile_bound`) is at most the bound; FAIL when the Clopper-Pearson lower bound is above the
    share. For arrays the quantile bound is computed only where the count passes (+inf elsewhere); -inf without
    latent values."""
    from scipy import stats as st

    v = np.asarray(beyond, dtype=np.float64)
    n = v.shape[-1]
    k = v.sum(-1)
    bounds = tail_boundaries(design.looks, share, design.alpha, design.kind, design.gamma)
    c_pass = bounds[look] if n == design.looks[look] else -1
    z_k = design.z_boundary(look)
    tail = _phi(-z_k) if math.isfinite(z_k) else 0.0
    with np.errstate(invalid="ignore"):
        lo = np.where(k > 0, st.beta.ppf(tail, np.maximum(k, 1), n - k + 1), 0.0)
        hi = np.where(k < n, st.beta.ppf(1 - tail, k + 1, np.maximum(n - k, 1)), 1.0)
    count_ok = k <= c_pass
    if latent is None:
        q_hi = np.full(np.shape(k), -math.inf)
    elif v.ndim == 1:
        q_hi = np.asarray(tail_quantile_bound(latent, share, design, look, clusters))
    else:
        q_hi = np.full(np.shape(k), math.inf)
        if count_ok.any():
            q_hi[count_ok] = tail_quantile_bound(np.asarray(latent)[count_ok], share, design, look, clusters)
    passed = count_ok & (q_hi <= (bound if bound is not None else math.inf))
    verdict = np.where(passed, 1, np.where(lo > share, -1, 0))
    return verdict, k, lo, hi, q_hi


def decide_tail(beyond, share: float, design: Design, look: int, latent=None, bound: float | None = None,
                clusters: Clusters | None = None) -> Decision:
    """Test "the share of windows beyond the bound is below `share`" on 0/1 per-window outcomes at one look
    (`tail_verdicts`). Without latent values this is the exact binomial test, which assumes independent windows;
    with them (`tail_latent` of the per-window values, `bound` their bound on that scale, `clusters` the windows'
    documents) a PASS also needs the windows' (1 - share) quantile to be bounded below the bound with documents as
    clusters (`tail_quantile_bound`): windows of one document move together, and a count alone passes a candidate
    on the threshold 10-17% of the time when documents explain 30-50% of the log-scale variance
    (bench/gate_calibration.py --rows tails).

    The MDE is how far below the threshold the true share must be to pass at the cap with probability 1 - beta:
    for the count alone exact (binomial); with latent values, at a look where the check can pass, from
    TAIL_MDE_SIMS seeded runs of these documents' sizes under a normal latent model whose documents explain
    WORKING_ICC of the variance (`_tail_mde_share`, about a second per layout; before the first passing look the
    count's alone)."""
    v = np.asarray(beyond, dtype=np.float64)
    n, k = int(v.size), int(v.sum())
    verdict, _, lo, hi, q_hi = tail_verdicts(v, share, design, look, latent, bound, clusters)
    z_k = design.z_boundary(look)
    c_cap = tail_boundaries(design.looks, share, design.alpha, design.kind, design.gamma)[-1]
    # the share s1 at which P(count at the cap <= its boundary) = 1 - beta: the MDE is share - s1
    s1 = 0.0 if c_cap < 0 else float(_solve_share(c_cap, design.cap, 1 - design.beta))
    if latent is not None and c_cap >= 0 and design.passable(look):
        sizes = clusters.sizes if clusters is not None and clusters.n == n else np.ones(n, dtype=np.int64)
        s1 = _tail_mde_share(share, design, _sizes_at(sizes, design.cap))
    mean = k / n if n else float("nan")
    return Decision(mean, float(lo), float(hi), math.sqrt(max(mean * (1 - mean), 0.25 / max(n, 1)) / max(n, 1)), n,
                    z_k, {1: "pass", -1: "fail", 0: "undecided"}[int(verdict)],
                    share - s1 if c_cap >= 0 else math.inf,
                    quantile_hi=float(q_hi) if latent is not None else None)


def _sizes_at(sizes, cap: int) -> tuple[int, ...]:
    """The documents' sizes scaled to `cap` windows in all (largest remainders; every document keeps at least one):
    the MDE is the power at the cap, whose count boundary is for exactly cap windows."""
    sizes = np.asarray(sizes, dtype=np.float64)
    want = sizes * cap / sizes.sum()
    out = np.maximum(np.floor(want), 1).astype(np.int64)
    for i in np.argsort(-(want - np.floor(want))):
        if out.sum() >= cap:
            break
        out[i] += 1
    while out.sum() > cap and (out > 1).any():  # more documents than the cap leaves room for at one each
        out[np.argmax(out)] -= 1
    return tuple(sorted(int(x) for x in out))


@lru_cache(maxsize=256)
def _tail_mde_share(share: float, design: Design, sizes: tuple[int, ...]) -> float:
    """The share beyond the bound at which both parts of the tail test pass at the cap with probability 1 - beta
    (count at most the cap's boundary, latent quantile bound at most the bound), over TAIL_MDE_SIMS seeded runs
    whose windows' latent values are normal with these documents (their sizes scaled to the cap: `_sizes_at`)
    explaining WORKING_ICC of the variance, with the
    gate's own TAIL_DRAWS (fewer change the share by a tenth). The test is location- and scale-free on the latent
    scale, so with latent values Z - z_{1-s} it passes when tail_quantile_bound(Z) <= z_{1-s} and at most the
    boundary's count of Z exceed z_{1-s}: the share is found by bisection on these runs. 0 when no share reaches
    the power."""
    from scipy import optimize

    ids = np.repeat(np.arange(len(sizes)), sizes)
    cl = Clusters(ids)
    rng = np.random.default_rng(TAIL_SEED + 1)
    zz = (math.sqrt(WORKING_ICC) * rng.standard_normal((TAIL_MDE_SIMS, cl.g))[:, cl.inverse]
          + math.sqrt(1 - WORKING_ICC) * rng.standard_normal((TAIL_MDE_SIMS, cl.n)))
    last = len(design.looks) - 1
    u = tail_quantile_bound(zz, share, design, last, cl)
    c_cap = tail_boundaries(design.looks, share, design.alpha, design.kind, design.gamma)[-1]

    def power(t: float) -> float:
        return float(((u <= t) & ((zz > t).sum(-1) <= c_cap)).mean()) - (1 - design.beta)

    top = 12.0
    if power(top) < 0:
        return 0.0
    return _phi(-optimize.brentq(power, z(1 - share), top, xtol=1e-6)) if power(z(1 - share)) < 0 else share


def _solve_share(c: int, n: int, power: float) -> float:
    from scipy import optimize
    from scipy import stats as st

    if st.binom.cdf(c, n, 1e-12) < power:
        return 0.0
    return optimize.brentq(lambda p: st.binom.cdf(c, n, p) - power, 1e-12, 1 - 1e-12)


def median_interval(values: list[float], tail: float = 0.05) -> tuple[float, float, float]:
    """(median, lo, hi): the median and its distribution-free bounds from order statistics, the k-th smallest and
    k-th largest value for the largest k with P(Bin(n, 1/2) < k) <= tail (each bound fails with at most that
    probability). Too few values for any k: (median, -inf, inf)."""
    v = sorted(values)
    n = len(v)
    k, below, term = 0, 0.0, 0.5 ** n  # below = P(Bin < k); term = P(Bin = k)
    while k < n // 2 and below + term <= tail:
        below += term
        k += 1
        term = term * (n - k + 1) / k
    if k == 0:
        return statistics.median(v), -math.inf, math.inf
    return statistics.median(v), v[k - 1], v[n - k]
