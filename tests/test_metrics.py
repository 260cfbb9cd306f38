"""Golden values and properties that pin the metric definitions (pure functions, fresh random inputs)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantlab import metrics


def test_position_stats_golden():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(3.0), 0.0], [5.0, 5.0]]])  # [1, 3, 2]
    targets = torch.tensor([[1, 1]])
    stats = metrics.PositionStats(logits, targets)
    nll, am = stats.nll, stats.argmax
    # p(target) = 3/4 at position 0, 1/4 at position 1; the last position predicts nothing.
    assert torch.allclose(nll, torch.tensor([[-math.log(0.75), -math.log(0.25)]]), atol=1e-6)
    assert am.tolist() == [[1, 0]]


def test_topk_kl_equals_full_kl_when_k_is_vocab_and_bounds_it_otherwise():
    gen = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    ref = torch.log_softmax(torch.randn(4, 7, 50, generator=gen) * 2, -1)
    cand = torch.log_softmax(ref + 0.3 * torch.randn(4, 7, 50, generator=gen), -1)
    full = (ref.exp() * (ref - cand)).sum(-1)
    top = ref.topk(50, dim=-1)
    assert torch.allclose(metrics.topk_kl(top.values, cand.gather(-1, top.indices)), full, atol=1e-5)
    for k in (1, 5, 20):
        top = ref.topk(k, dim=-1)
        bound = metrics.topk_kl(top.values, cand.gather(-1, top.indices))
        assert (bound <= full + 1e-5).all()
        assert (bound >= 0).all()


def test_topk_kl_of_identical_distributions_is_zero():
    ref = torch.log_softmax(torch.randn(3, 9, 40), -1)
    top = ref.topk(8, dim=-1)
    assert metrics.topk_kl(top.values, ref.gather(-1, top.indices)).abs().max().item() == 0.0


def test_position_stats_log_probs_match_log_softmax():
    """nll, top-k and gathered log-probs equal log_softmax's, without forming the [B,T,V] log-probs."""
    logits = torch.randn(2, 9, 300) * 4
    targets = torch.randint(0, 300, (2, 8))
    stats = metrics.PositionStats(logits, targets)
    nll, am = stats.nll, stats.argmax
    lp = torch.log_softmax(logits[:, :-1], -1)
    assert torch.allclose(nll, -lp.gather(-1, targets[..., None])[..., 0], atol=1e-5)
    assert torch.equal(am, lp.argmax(-1))
    values, idx = stats.topk(7)
    assert torch.equal(idx, lp.topk(7, dim=-1).indices)
    assert torch.allclose(values, lp.topk(7, dim=-1).values, atol=1e-5)
    assert torch.allclose(stats.at(idx), values, atol=0)


def test_t_interval_golden():
    mean, lo, hi = metrics.t_interval([1.0, 2.0, 3.0, 4.0])
    # t_{0.975, 3} = 3.182446; s = 1.290994; half = t * s / 2
    assert mean == 2.5
    assert hi - mean == pytest.approx(3.182446 * 1.290994 / 2, rel=1e-5)
    assert lo == pytest.approx(2 * mean - hi)
    assert metrics.t_interval([5.0]) == (5.0, 5.0, 5.0)


def test_wilson_interval_golden_and_bounded():
    lo, hi = metrics.wilson_interval(1, 4)
    assert lo == pytest.approx(0.045587, abs=1e-5) and hi == pytest.approx(0.699358, abs=1e-5)
    assert metrics.wilson_interval(0, 3)[0] == 0.0 and metrics.wilson_interval(3, 3)[1] == 1.0


def test_statistical_threshold_matches_formula():
    thr, theta = metrics.statistical_threshold(2.0, sigma=0.5, n=50, alpha=0.05, beta=0.2, higher_is_better=False)
    se = math.sqrt(2 * 0.25 / 50)
    assert thr == pytest.approx(2.0 + 1.644854 * se, rel=1e-6)
    assert theta == pytest.approx((1.644854 + 0.841621) * se, rel=1e-6)
    thr_hi, _ = metrics.statistical_threshold(0.9, 0.1, 10, 0.05, 0.2, higher_is_better=True)
    assert thr_hi < 0.9
    n = metrics.windows_needed(0.5, theta, 0.05, 0.2)
    assert n in (50, 51)


def test_summarize_definitions():
    w = {"nll_ref": np.array([10.0, 20.0]), "nll_cand": np.array([11.0, 22.0]), "n_pred": np.array([10, 10]),
         "agree": np.array([9.0, 7.0]), "kl": np.array([1.0, 3.0])}
    m = metrics.summarize(w, np.linspace(0, 1, 101), None, 0.0)
    assert m["ppl_reference"]["value"] == pytest.approx(math.exp(30 / 20))
    assert m["ppl_candidate"]["value"] == pytest.approx(math.exp(33 / 20))
    assert m["ppl_ratio"]["value"] == pytest.approx(math.exp(3 / 20))
    assert m["top1_agreement"]["value"] == pytest.approx(0.8)
    assert m["kl_mean"]["value"] == pytest.approx(0.2)
    assert m["kl_p90"]["value"] == pytest.approx(0.9)
    lo, hi = m["ppl_ratio"]["ci95"]
    assert lo <= m["ppl_ratio"]["value"] <= hi


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert metrics.first_divergence([1, 2, 3], [1, 5, 3]) == 1


def test_registry_directions():
    assert metrics.METRICS["top1_agreement"].higher_is_better
    assert not metrics.METRICS["ppl_ratio"].higher_is_better
    assert not metrics.METRICS["ppl_reference"].gateable
    assert metrics.METRICS["top1_agreement"].loss(0.9) == pytest.approx(0.1)
    assert metrics.METRICS["ppl_ratio"].loss(1.05) == pytest.approx(0.05)
