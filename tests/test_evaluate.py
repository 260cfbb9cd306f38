"""Evaluation and gate sanity on tiny models: self-comparison, damaged candidates, direct transformers ppl."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import FAST, compose, read_json, run_api

from quantlab.artifacts import ArtifactStore
from quantlab.engines.base import Limits
from quantlab.engines.hf import HFModelEngine
from quantlab.env import resolve_device
from quantlab.gate import checks as gate_checks
from quantlab.models import load_model, load_tokenizer
from quantlab.stages import data, evaluate, prepare


def _setup(tiny_llama, cache, extra=()):
    cfg, _ = compose(["+precision=fp8", f"model.path={tiny_llama}", *FAST, *extra])
    store = ArtifactStore(cache)
    ref = prepare.run(cfg.model, store)
    tok = load_tokenizer(ref)
    evalset = data.run(cfg.eval, data.EVAL, ref.fingerprint, tok, store)
    return cfg, store, ref, tok, evalset


def _engine(model):
    return HFModelEngine(model, Limits(512, 512, 64), "candidate")


def test_reference_against_itself_is_perfect_and_passes(tiny_llama, tmp_path, shared_cache):
    code = run_api(["+precision=fp8", "engine=reference", f"model.path={tiny_llama}", f"cache_dir={shared_cache}",
                    *FAST], tmp_path)
    doc = read_json(tmp_path / "metrics.json")
    m = doc["metrics"]
    assert m["top1_agreement"]["value"] == 1.0
    assert m["kl_mean"]["value"] == 0.0 and m["kl_p99"]["value"] == 0.0
    assert m["ppl_ratio"]["value"] == 1.0
    assert m["gen_exact_match"]["value"] == 1.0
    assert doc["behaviour"]["flips"]["ref_right_cand_wrong"] == 0
    assert doc["gate"]["passed"] and code == 0


def test_damaged_candidate_fails_every_quality_gate(tiny_llama, shared_cache):
    from quantlab.gate import stats

    cfg, store, ref, tok, evalset = _setup(tiny_llama, shared_cache)
    device = resolve_device("cpu")
    model = load_model(ref, device, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers" in name and p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 3.0)
    w = evaluate.compare_engines(_engine(load_model(ref, device, torch.float32)), _engine(model), evalset.tokens,
                                 cfg.eval)
    design = stats.make_design(w.n, w.n, 0.05, 0.2)
    checks = gate_checks.evaluate_checks(gate_checks.thresholds_for(cfg.gate, "fp8"), w, None, design, 0)
    failed = {c.metric for c in checks if c.verdict == "fail"}
    assert {"top1_agreement", "ppl_ratio", "kl_mean"} <= failed
    assert all(c.ci and c.mde is not None for c in checks)


def test_perplexity_matches_direct_transformers(tiny_llama, shared_cache):
    from transformers import AutoModelForCausalLM

    from quantlab.gate import metrics

    cfg, store, ref, tok, evalset = _setup(tiny_llama, shared_cache)
    device = resolve_device("cpu")
    w = evaluate.compare_engines(_engine(load_model(ref, device, torch.float32)),
                                 _engine(load_model(ref, device, torch.float32)), evalset.tokens, cfg.eval)
    m = metrics.summarize(w)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    losses = []
    with torch.no_grad():
        for window in evalset.tokens:
            losses.append(model(window[None], labels=window[None]).loss.item())  # HF shifts labels itself
    direct = math.exp(sum(losses) / len(losses))
    assert m["ppl_reference"]["value"] == pytest.approx(direct, rel=1e-4)
    assert m["ppl_candidate"]["value"] == pytest.approx(direct, rel=1e-4)
    assert m["kl_mean"]["value"] == 0.0


def test_prefix_token_windows_score_every_text_token(tiny_llama, tmp_path):
    """eval.prefix_token=eos: each window is EOS + seq_len - 1 consecutive text tokens (lm-eval's convention),
    so every text token is scored, the first one of each window given only the prefix."""
    cfg, store, ref, tok, evalset = _setup(tiny_llama, tmp_path / "cache", ["eval.prefix_token=eos"])
    text, _ = data.read_text(cfg.eval, data.EVAL)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    width = cfg.eval.seq_len - 1
    assert evalset.seq_len == cfg.eval.seq_len
    assert (evalset.tokens[:, 0] == tok.eos_token_id).all()
    # windows are stored in the look order (spread across documents); positions say where each is in the text
    for i, window in zip(evalset.positions.tolist(), evalset.tokens, strict=True):
        assert window[1:].tolist() == ids[i * width:(i + 1) * width]
    device = resolve_device("cpu")
    nll = evaluate.reference_arrays(_engine(load_model(ref, device, torch.float32)), evalset.tokens, cfg.eval)["nll"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        for window, ours in zip(evalset.tokens, nll, strict=True):
            direct = model(window[None], labels=window[None]).loss.item() * width  # mean over the width text tokens
            assert ours.sum().item() == pytest.approx(direct, rel=1e-5)


def test_metrics_identical_across_batch_sizes(tiny_llama, tmp_path):
    docs = []
    for bs in (1, 4):
        run_dir = tmp_path / f"bs{bs}"
        # a cache per batch size: evaluations are cached without batch_size in the key, so sharing one would
        # compare a result with itself
        run_api(["+precision=int8_sq", f"model.path={tiny_llama}", f"cache_dir={tmp_path / f'cache{bs}'}", *FAST,
                 f"eval.batch_size={bs}"], run_dir)
        docs.append(read_json(run_dir / "metrics.json"))
    a, b = (d["metrics"] for d in docs)
    for name in a:
        assert a[name]["value"] == b[name]["value"], name
    assert docs[0]["run"]["candidate_forward_batches"] > 0 and docs[1]["run"]["candidate_forward_batches"] > 0


def test_baseline_regression_and_refusal(tiny_llama, tiny_qwen2, tmp_path, shared_cache):
    base_dir = tmp_path / "base"
    common = [f"model.path={tiny_llama}", f"cache_dir={shared_cache}", *FAST]
    run_api(["+precision=fp8", "engine=reference", *common], base_dir)
    baseline = base_dir / "metrics.json"
    # fp8 vs a perfect baseline: significantly worse on the paired per-window test
    code = run_api(["+precision=int4_awq", f"gate.baseline={baseline}", *common], tmp_path / "cand")
    doc = read_json(tmp_path / "cand" / "metrics.json")
    base_checks = [c for c in doc["gate"]["checks"] if c["kind"] == "baseline"]
    assert len(base_checks) == 3 and code == 1
    assert doc["gate"]["baseline"]["kl_mean"]["windows"] >= 4
    assert not all(c["passed"] for c in base_checks)
    assert set(doc["gate"]["baseline"]) >= {"top1_agreement", "kl_mean", "dnll_mean", "path"}
    html = (tmp_path / "cand" / "report.html").read_text()
    assert 'id="baseline"' in html and "candidate worse by" in html  # side by side, with the paired interval
    assert "Baseline comparison" in (tmp_path / "cand" / "report.md").read_text()
    # same model re-evaluated against itself as baseline: not worse
    code = run_api(["+precision=fp8", "engine=reference", f"gate.baseline={baseline}", *common], tmp_path / "same")
    assert code == 0
    # a baseline from another model is refused before any compute
    from quantlab.errors import QuantlabError

    with pytest.raises(QuantlabError, match="different model"):
        run_api(["+precision=fp8", f"model.path={tiny_qwen2}", f"cache_dir={shared_cache}", *FAST,
                 f"gate.baseline={baseline}"], tmp_path / "other")


def test_reference_outputs_computed_once_per_sweep(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    counts = []
    for precision in ("fp8", "int8_sq", "int4_awq"):
        run_api([f"+precision={precision}", f"model.path={tiny_llama}", f"cache_dir={cache}", *FAST],
                tmp_path / precision)
        counts.append(read_json(tmp_path / precision / "metrics.json")["run"]["reference_forward_batches"])
    assert counts[0] > 0 and counts[1:] == [0, 0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_numerics_probe_moves_every_dtype_by_its_last_bit(dtype):
    """perturbed_inputs on a real Linear: the output moves in every dtype (in bfloat16 and float16 a relative 2^-21
    rounds to exactly 1, so the probe uses the dtype's own last bit there), by about that relative amount, and the
    model is unchanged afterwards."""
    import torch

    from quantlab.stages.evaluate import NUMERICS_EPS, perturbed_inputs

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    layer = torch.nn.Linear(64, 32).to(dt)
    x = torch.randn(8, 64).to(dt)
    base = layer(x)
    with perturbed_inputs(layer) as n:
        moved = layer(x)
    assert n == 1 and not torch.equal(base, moved)
    rel = float((moved.float() - base.float()).norm() / base.float().norm())
    e = max(NUMERICS_EPS, float(torch.finfo(dt).eps))
    assert 0.05 * e < rel < 20 * e, (rel, e)
    assert torch.equal(layer(x), base) and not hasattr(layer, "_ql_signs") and not hasattr(layer, "_ql_pm")
