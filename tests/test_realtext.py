"""Gate guarantees on real text: documents as clusters, looks across documents, tails that cannot hide."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import FAST, compose

from quantlab.errors import QuantlabError
from quantlab.gate import checks as gate_checks
from quantlab.gate import stats
from quantlab.gate.config import Threshold
from quantlab.gate.metrics import Windows
from quantlab.stages import data


# ------------------------------------------------------------------------------------------ cluster interval
def test_cluster_interval_by_hand(monkeypatch):
    """Three documents of sizes 2, 1, 3: CR2 variance, Bell-McCaffrey df and the symmetric interval by hand."""
    monkeypatch.setattr(stats, "WORKING_ICC", 0.0)  # the closed form below; the working ICC is checked next
    v = np.array([1.0, 3.0, 2.0, 4.0, 6.0, 5.0])
    ids = np.array([0, 0, 1, 2, 2, 2])
    cl = stats.Clusters(ids)
    # residuals about the mean 3.5: totals per document -2.5-0.5 = -3, -1.5, 0.5+2.5+1.5 = 4.5
    totals = np.array([-3.0, -1.5, 4.5])
    sizes = np.array([2, 1, 3])
    w = 1 / (1 - sizes / 6)  # 1.5, 1.2, 2
    se = math.sqrt((w * totals ** 2).sum()) / 6  # sqrt(13.5 + 2.7 + 40.5) / 6
    assert se == pytest.approx(math.sqrt(56.7) / 6)
    a = sizes ** 2 / (6 - sizes)  # 1, 0.2, 3
    df = 36 / ((sizes ** 2).sum() + a.sum() ** 2 - (a ** 2).sum())  # 36 / (14 + 17.64 - 10.04)
    assert cl.df == pytest.approx(36 / 21.6)
    assert cl.df == pytest.approx(df)
    mean, lo, hi, got_se = stats.interval(v, 2.0, cl)
    assert mean == 3.5 and got_se == pytest.approx(se)
    # skew corrections only widen: the interval contains the symmetric one
    assert lo <= mean - 2.0 * se + 1e-12 and hi >= mean + 2.0 * se - 1e-12
    # with a working ICC rho: (tr B)^2 / ||B||^2, B = U' Omega U, formed densely here
    monkeypatch.setattr(stats, "WORKING_ICC", 0.5)
    onehot = (ids[:, None] == np.arange(3)[None, :]).astype(float)
    omega = 0.5 * np.eye(6) + 0.5 * onehot @ onehot.T
    u = (np.eye(6) - np.full((6, 6), 1 / 6)) @ onehot * np.sqrt(w) / 6
    b = u.T @ omega @ u
    assert stats.Clusters(ids).df == pytest.approx(np.trace(b) ** 2 / (b * b).sum())
    symmetric = stats.interval(np.array([1.0, 2.0, 4.0, 5.0]), 2.0, stats.Clusters([0, 0, 1, 1]))
    assert symmetric[1] == pytest.approx(3.0 - 2.0 * symmetric[3]) and symmetric[2] == pytest.approx(
        3.0 + 2.0 * symmetric[3])


def test_every_window_its_own_document_is_todays_interval():
    rng = np.random.default_rng(3)
    v = rng.gamma(0.7, 1.0, 24)
    assert stats.interval(v, 2.4, stats.Clusters(np.arange(24))) == stats.interval(v, 2.4)
    forced = stats.Clusters(np.arange(24))
    forced.singletons = False  # the cluster formulas themselves reduce to the t interval with n - 1 df
    assert forced.df == pytest.approx(23)
    assert np.allclose(stats.interval(v, 2.4, forced), stats.interval(v, 2.4), rtol=1e-12)
    summary = stats.cluster_summary(v, stats.Clusters(np.arange(24)))
    assert summary["design_effect"] == 1.0 and summary["clusters"] == 24


def test_icc_and_design_effect_measured():
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(40), 5)
    v = rng.standard_normal(40)[ids] + 0.5 * rng.standard_normal(200)  # ICC 1 / 1.25 = 0.8
    s = stats.cluster_summary(v, stats.Clusters(ids))
    assert 0.65 < s["icc"] < 0.9 and s["design_effect"] > 3 and s["clusters"] == 40


def test_documents_keep_type_one_error_where_windows_would_not():
    """Ten documents of six windows, intra-document correlation 0.5, the truth on the threshold: a t interval over
    windows passes far more often than alpha, the interval over documents about alpha (seeded; seconds)."""
    rng = np.random.default_rng(7)
    ids = np.repeat(np.arange(10), 6)
    sims = 3000
    values = math.sqrt(0.5) * rng.standard_normal((sims, 10))[:, ids] + math.sqrt(0.5) * rng.standard_normal(
        (sims, 60))
    design = stats.make_design(60, 60, 0.05, 0.2, sequential=False)
    cl = stats.Clusters(ids)
    _, _, hi_windows, _ = stats.interval(values, design.t_boundary(0, 60))
    _, _, hi_docs, _ = stats.interval(values, design.t_boundary(0, 60, cl.df), cl)
    assert (hi_windows <= 0).mean() > 0.15
    assert (hi_docs <= 0).mean() < 0.07


# ---------------------------------------------------------------------------------------------- look order
def test_look_order_is_stratified_seeded_and_deterministic():
    docs = np.repeat(np.arange(5), [20, 10, 5, 3, 2])
    order = data.look_order(docs, 0)
    assert sorted(order.tolist()) == list(range(40))
    assert np.array_equal(order, data.look_order(docs, 0))
    assert not np.array_equal(order, data.look_order(docs, 1))
    sizes = np.bincount(docs)
    for n in range(1, 41):  # every prefix holds each document in proportion to its size, within one window
        counts = np.bincount(docs[order[:n]], minlength=5)
        assert np.all(np.abs(counts - n * sizes / 40) < 1.0 + 1e-9), (n, counts)


# --------------------------------------------------------------------------------------- documents per source
def _cfg(path, **kw):
    over = [f"eval.path={path}"] + [f"eval.{k}={v}" for k, v in kw.items()]
    return compose(["+precision=fp8", *over])[0].eval


def _documents(cfg) -> tuple[str, data.Documents]:
    src = data.source(cfg, data.EVAL)
    docs = data.Documents(src.rule)
    text = "".join(data._text_pieces(src, docs, data._separator(cfg, "eval")))
    return text, docs


@pytest.mark.parametrize("name,content", [
    ("r.jsonl", '{"text": "alpha beta"}\n{"text": "gamma"}\n'),
    ("r.json", '[{"text": "alpha beta"}, {"text": "gamma"}]'),
    ("r.csv", 'id,text\n1,"alpha beta"\n2,gamma\n'),
])
def test_records_are_documents(name, content, tmp_path):
    path = tmp_path / name
    path.write_text(content)
    text, docs = _documents(_cfg(path))
    assert text == "alpha beta\n\ngamma"
    assert docs.starts == [0, 10] and len(docs.labels) == 2
    assert docs.labels[0].endswith("alpha beta") and docs.labels[1].endswith("gamma")


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["alpha beta", "gamma"]}), tmp_path / "t.parquet")
    _, docs = _documents(_cfg(tmp_path / "t.parquet"))
    assert docs.starts == [0, 10] and docs.labels == ["row 0: alpha beta", "row 1: gamma"]


def test_plain_text_blank_lines_and_separator(tmp_path):
    path = tmp_path / "wiki.raw"
    body = " \n = First = \n\n one two \n\n three \n = = Sub = = \n four \n = Second = \n five \n"
    path.write_text(body)
    text, docs = _documents(_cfg(path))
    assert text == body
    # blank lines cut paragraphs; the leading blank line belongs to the first
    assert [text[s:s + 8] for s in docs.starts] == [" \n = Fir", " one two", " three \n"]
    assert docs.labels == ["= First =", "one two", "three"]
    text, docs = _documents(_cfg(path, doc_separator="'^ = [^=].* = $'"))
    assert text == body
    assert docs.labels == ["= First =", "= Second ="]  # '= = Sub = =' does not start an article
    assert [text[s:s + 10] for s in docs.starts] == [" \n = First", " = Second "]
    with pytest.raises(QuantlabError, match="not a regular expression"):
        data.key(_cfg(path, doc_separator="'(unclosed'"), data.EVAL, "m", None)


def test_pydoc_topics_are_documents():
    cfg = compose(["+precision=fp8"])[0].eval
    text, docs = _documents(cfg)
    names = data._pydoc_names(data.EVAL)
    assert len(docs.starts) == len(names) and docs.labels[0].startswith(names[0] + ":")
    assert text == data.read_text(cfg, data.EVAL)[0]


def test_the_default_texts_parts_share_no_text_and_its_documents_are_distinct():
    """pydoc's topics nest (`compound` holds `class`, `typesseq` holds `typesseq-mutable`): the evaluation part shares
    no 128-character run with the calibration part (the split by a hash of the name shared 2.5% of it), and no
    evaluation document lies even a quarter inside another one (the same text as two documents would be two
    "independent" observations)."""
    topics = {name: text.strip() for name, text in data.pydoc_topics().items()}
    evals, calibs = data._pydoc_names(data.EVAL), data._pydoc_names(data.CALIB)
    assert len(evals) >= 40 and calibs and not set(evals) & set(calibs)

    def grams(text: str) -> set[str]:
        return {text[i:i + 128] for i in range(max(1, len(text) - 127))}

    # calibration keeps enough text for ModelOpt's examples' 32 windows of 2048 tokens (at 4 characters a token;
    # SmolLM2: 73.6k tokens, 35 such windows; its distinct documents alone, nested topics dropped, would give 26)
    assert sum(len(topics[n]) for n in calibs) >= 32 * 2048 * 4
    calib_grams = set().union(*(grams(topics[n]) for n in calibs))
    assert not any(grams(topics[n]) & calib_grams for n in evals)
    by_name = {n: grams(topics[n]) for n in evals}
    for a in evals:
        for b in evals:
            if a != b:
                assert len(by_name[a] & by_name[b]) < 0.25 * len(by_name[a]), (a, b)


def test_dataset_rows_are_documents_when_cached():
    datasets = pytest.importorskip("datasets")
    try:
        datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception:  # noqa: BLE001 - not in the local cache (offline)
        pytest.skip("wikitext is not in the local datasets cache")
    cfg = compose(["+precision=fp8", "calib_data@eval=wikitext2"])[0].eval
    _, docs = _documents(cfg)
    assert len(docs.starts) > 50 and all(label.startswith("row ") for label in docs.labels)


def test_windows_belong_to_the_document_holding_most_of_their_tokens(tok_dir, tmp_path):
    """Records of one repeated word each: the stored windows (in look order) are the text's windows, and each
    window's document is the record whose word fills most of it."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join([w] * (40 + 25 * i))}) + "\n"
                            for i, w in enumerate(words)))
    cfg = _cfg(path, seq_len=16, max_windows="null")
    ident = data.key(cfg, data.EVAL, "model", _Store())
    (tmp_path / "out").mkdir()
    info = data.build(cfg, data.EVAL, ident, tok, tmp_path / "out")
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "out" / "tokens.safetensors"))
    text = data.read_text(cfg, data.EVAL)[0]
    lead = tok("", add_special_tokens=True)["input_ids"]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = lead + enc["input_ids"]
    starts, at = [], 0
    for i, w in enumerate(words):  # record i starts after the previous ones and their "\n\n"
        starts.append(at)
        at += len(" ".join([w] * (40 + 25 * i))) + 2
    token_doc = [0] * len(lead) + [int(np.searchsorted(starts, o[0], side="right")) - 1 for o in enc["offset_mapping"]]
    for row, pos, doc in zip(stored["tokens"], stored["positions"].tolist(), stored["docs"].tolist(), strict=True):
        assert row.tolist() == ids[pos * 16:(pos + 1) * 16]
        counts = np.bincount(token_doc[pos * 16:(pos + 1) * 16], minlength=6)
        assert doc == int(np.argmax(counts)), (pos, counts, doc)  # most tokens; ties to the earlier document
        assert words[doc] in tok.decode(row.tolist())
    assert info["documents"]["in_set"] == 6 and info["documents"]["rule"] == "records"
    first = stored["docs"][:6].tolist()  # the first look spreads over the documents, not the text's start
    assert len(set(first)) >= 4


class _Store:
    """The one method data.key needs of an ArtifactStore."""

    def key(self, *args, **kw) -> str:
        return json.dumps([args, kw], sort_keys=True, default=str)


# ------------------------------------------------------------------------------------------------- tails
def test_tail_boundaries_exact():
    looks = stats.make_design(61, 8, 0.05, 0.2).looks
    assert stats.tail_boundaries(looks, 0.05, 0.05) == (-1,) * 7 + (0,)  # 0.95^61 = 0.044 <= 0.05
    assert stats.tail_boundaries((59,), 0.05, 0.05) == (0,) and stats.tail_boundaries((58,), 0.05, 0.05) == (-1,)
    design = stats.make_design(61, 8, 0.05, 0.2)
    assert stats.decide_tail(np.zeros(61), 0.05, design, 7).verdict == "pass"
    assert stats.decide_tail(np.r_[np.ones(1), np.zeros(60)], 0.05, design, 7).verdict == "undecided"
    assert stats.decide_tail(np.zeros(8), 0.05, design, 0).verdict == "undecided"
    assert stats.decide_tail(np.r_[np.ones(5), np.zeros(3)], 0.05, design, 0).verdict == "fail"
    mde = stats.decide_tail(np.zeros(61), 0.05, design, 7).mde
    assert (1 - (0.05 - mde)) ** 61 == pytest.approx(0.8)  # power 1 - beta at the share 0.05 - MDE


def test_tail_threshold_validation_and_windows_needed():
    cfg = compose(["+precision=fp8", "eval.max_windows=32"])[0]
    with pytest.raises(QuantlabError, match="takes 59 windows") as caught:
        gate_checks.check_gate(cfg.gate, "fp8", cfg.eval)
    assert "kl_tail, ppl_tail, top1_tail can never pass" in str(caught.value)  # every blocked tail, not the first
    for name, bad, match in (("kl_tail", {"max": 0.05}, "needs above"),
                             ("kl_tail", {"max": 1.5, "above": 0.5}, "outside kl_tail's range"),
                             ("kl_tail", {"min": 0.01, "max": 0.05, "above": 0.5}, "no min"),
                             ("kl_tail", {"max": 0.05, "above": 0.0}, r"outside \(0, inf\)"),
                             ("ppl_tail", {"max": 0.05, "above": 1.0}, r"ppl ratio .* outside \(1, inf\)"),
                             ("ppl_tail", {"max": 0.05, "above": 0.9}, "e.g. 1.21"),
                             ("top1_tail", {"max": 0.05, "above": 1.0}, r"top-1 disagreement .* outside \(0, 1\)"),
                             ("top1_tail", {"max": 0.05}, "needs above")):
        cfg = compose(["+precision=fp8"])[0]
        cfg.gate.thresholds = {name: bad}
        with pytest.raises(QuantlabError, match=match):
            gate_checks.thresholds_for(cfg.gate, "fp8")
    cfg = compose(["+precision=fp8"])[0]
    cfg.gate.thresholds = {"kl_mean": {"max": 0.2, "above": 0.5}}
    with pytest.raises(QuantlabError, match="only tail checks"):
        gate_checks.thresholds_for(cfg.gate, "fp8")


def test_a_window_that_is_not_a_number_is_beyond_every_tail_bound():
    """NaN or overflowing windows (a broken candidate's logits) count as beyond the bound: never as healthy."""
    n, t = 64, 8
    arrays = {k: np.zeros((n, t), dtype=np.float32) for k in ("kl", "nll_ref", "nll_cand", "dp_true", "dp_top")}
    arrays.update(argmax_ref=np.zeros((n, t), dtype=np.int32), argmax_cand=np.zeros((n, t), dtype=np.int32))
    arrays["kl"][3] = np.nan
    arrays["nll_cand"][5] = np.float32(1e30)  # exp(dNLL) overflows
    arrays["nll_cand"][7] = np.nan
    w = Windows(arrays, np.zeros((n, t), dtype=np.int32), np.arange(n))
    design = stats.make_design(n, 8, 0.05, 0.2)
    found = gate_checks.evaluate_checks({"kl_tail": Threshold(max=0.05, above=0.5),
                                         "ppl_tail": Threshold(max=0.05, above=1.21)}, w, None, design,
                                        len(design.looks) - 1)
    assert [c.verdict for c in found] == ["undecided", "undecided"]  # 1 and 2 of 64 beyond: not a pass
    assert "1 of 64 windows beyond" in found[0].detail and "2 of 64 windows beyond" in found[1].detail


def test_one_document_is_refused_and_few_documents_warned():
    design = stats.make_design(40, 8, 0.05, 0.2)
    with pytest.raises(QuantlabError, match="one document"):
        gate_checks.check_documents(np.zeros(40, dtype=int), design)
    assert gate_checks.check_documents(np.arange(40), design) == []
    warned = gate_checks.check_documents(np.arange(40) % 3, design)
    assert warned and "3 documents" in warned[0]


def test_tail_check_fails_a_candidate_broken_on_part_of_the_text(tiny_llama, tmp_path):
    """A tiny candidate identical to the reference except on the windows of a few documents (about a fifth of the
    text): the mean checks cannot see where, the tail check fails it and names the broken documents' windows."""
    from quantlab.artifacts import ArtifactStore
    from quantlab.engines.base import Limits
    from quantlab.engines.hf import HFModelEngine
    from quantlab.env import resolve_device
    from quantlab.models import load_model, load_tokenizer
    from quantlab.stages import evaluate, prepare

    over = [a for a in FAST if not a.startswith(("eval.max_windows", "~gate"))]
    cfg, _ = compose(["+precision=fp8", f"model.path={tiny_llama}", *over, "eval.max_windows=64"])
    store = ArtifactStore(tmp_path / "cache")
    ref = prepare.run(cfg.model, store)
    evalset = data.run(cfg.eval, data.EVAL, ref.fingerprint, load_tokenizer(ref), store)
    assert evalset.num_windows == 64 and evalset.docs is not None
    sizes = {int(d): int((evalset.docs == d).sum()) for d in np.unique(evalset.docs)}
    broken_docs, total = [], 0
    for d in sorted(sizes, key=sizes.get):  # the smallest documents until about a fifth of the windows
        if total >= 12:
            break
        broken_docs.append(d)
        total += sizes[d]
    broken = {tuple(evalset.tokens[i, :24].tolist()) for i in range(64) if int(evalset.docs[i]) in broken_docs}

    device = resolve_device("cpu")
    damaged = load_model(ref, device, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in damaged.named_parameters():
            if "layers" in name and p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 3.0)

    class PartlyBroken(HFModelEngine):
        def __init__(self):
            super().__init__(load_model(ref, device, torch.float32), Limits(512, 512, 64), "candidate")
            self.bad = HFModelEngine(damaged, Limits(512, 512, 64), "bad")

        def _forward(self, tokens):
            good, bad = super()._forward(tokens), self.bad._forward(tokens)
            mask = torch.tensor([tuple(t[:24].tolist()) in broken for t in tokens])
            good.hidden = torch.where(mask[:, None, None], bad.hidden, good.hidden)
            return good

    reference = HFModelEngine(load_model(ref, device, torch.float32), Limits(512, 512, 64), "reference")
    w = evaluate.compare_engines(reference, PartlyBroken(), evalset.tokens, cfg.eval)
    w = Windows(w.a, w.targets, evalset.docs, evalset.info["documents"]["labels"], evalset.positions)
    design = stats.make_design(64, 8, 0.05, 0.2)
    thresholds = {"kl_tail": Threshold(max=0.05, above=0.5), "ppl_tail": Threshold(max=0.05, above=1.21),
                  "top1_tail": Threshold(max=0.05, above=0.4)}
    look = len(design.looks) - 1
    found = gate_checks.finish(gate_checks.evaluate_checks(thresholds, w, None, design, look), at_cap=True)
    assert [c.metric for c in found] == ["kl_tail", "ppl_tail", "top1_tail"]
    labels = {evalset.doc_label(d) for d in broken_docs}
    for tail in found:  # each tail check on its own quantity: KL, the window's ppl ratio, its top-1 disagreement
        assert not tail.passed and tail.verdict == "fail", tail.detail
        assert tail.where and all(any(label in x["window"] for label in labels) for x in tail.where)
        assert tail.clusters == len(sizes)
    ppl = found[1]
    ratio = np.exp(w.per_window("dnll"))
    assert ppl.where[0]["value"] == pytest.approx(ratio.max()) and "ppl ratio above 1.21" in ppl.name
    assert found[2].where[0]["value"] == pytest.approx(1 - w.per_window("agree").min())
    # the same candidate where it is not broken: the tail check passes at 64 windows, none beyond the bound
    clean = [i for i in range(64) if int(evalset.docs[i]) not in broken_docs]
    w_clean = Windows({k: np.concatenate([v[clean]] * 2)[:64] for k, v in w.a.items()},
                      np.concatenate([w.targets[clean]] * 2)[:64])
    assert [c.verdict for c in gate_checks.evaluate_checks(thresholds, w_clean, None, design, look)] == ["pass"] * 3
