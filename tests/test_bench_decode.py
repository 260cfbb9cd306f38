"""bench/decode.py's own logic that runs without a GPU: what every table it prints marks (rows timed uncompiled though
compiling was asked, rows not measured), the ratios and attribution deltas it leaves out between such rows, the
targets it does not judge from them, the budget rule for the rows after the headline, the INT4 table the sweep's
separate timing puts back, and where its models come from (the GPU numbers themselves: bench/RESULTS.md)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from _scripts import bench_module

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    yield from bench_module("decode.py", "_bench_decode_logic")


def _row(ms: float, compiled: bool = True, prefill: float | None = None, **extra) -> dict:
    row = {"decode_ms_per_token": ms, "compiled": compiled, "compile_error": None, "roofline_fraction": 0.5,
           "decode_ms_spread": [ms, ms], **extra}
    if prefill is not None:
        row["prefill_ms"] = prefill
    return row


def _args(**kw) -> argparse.Namespace:
    base = dict(batches=[1, 16, 64], prefill_batches=[1, 16], compile=True, attribution=True,
                attribution_precisions=["bf16", "fp8_kv"])
    return argparse.Namespace(**{**base, **kw})


def _attribution(bench, default: dict | None, attention_off_ms: float, uncompiled_ms: float) -> dict:
    default = default or {}
    out = {"default_ms": default.get("decode_ms_per_token"), "default_compiled": default.get("compiled"),
           "default_compile_error": None, "compile_requested": True}
    (attn, _, attn_compiled), (unc, _, unc_compiled) = bench.ATTRIBUTION
    out[attn] = {"ms": attention_off_ms, "compiled": True, "expected_compiled": attn_compiled}
    out[unc] = {"ms": uncompiled_ms, "compiled": False, "expected_compiled": unc_compiled}
    return out


def _results(bench, bf16: dict, fp8_kv: dict, attribution: dict) -> dict:
    return {"sections": {"bench_bf16": {"batches": bf16, "attribution": attribution["bf16"]},
                         "bench_fp8_kv": {"batches": fp8_kv, "attribution": attribution["fp8_kv"]}},
            "skipped": ["fp8_kv batch 64 (budget)"], "errors": {}, "int4_configs_timed_are_shipped": True}


def _summary_text(bench, monkeypatch, capsys, results: dict, args) -> str:
    monkeypatch.setattr(bench, "RESULTS", results)
    bench.summary(["bf16", "fp8_kv"], args)
    return capsys.readouterr().out


def test_attribution_leaves_out_deltas_against_an_uncompiled_default(bench, monkeypatch, capsys):
    """The issue's case: fp8_kv's default row ran uncompiled (the budget) while its variants compiled; no delta is
    printed between them (the old table printed -1.884 ms unmarked). bf16's, all as asked, keeps its deltas."""
    bf16 = {1: _row(5.099, prefill=24.0), 16: _row(5.587, prefill=196.0), 64: _row(6.61)}
    fp8_kv = {1: _row(4.619, compiled=False, prefill=30.0), 16: _row(4.1, compiled=False, prefill=150.0)}
    attribution = {"bf16": _attribution(bench, bf16[1], 5.518, 6.961),
                   "fp8_kv": _attribution(bench, fp8_kv[1], 2.735, 5.057)}
    text = _summary_text(bench, monkeypatch, capsys, _results(bench, bf16, fp8_kv, attribution), _args())
    lines = text.splitlines()
    bf16_attr = next(line for line in lines if line.strip().startswith("bf16") and "|" in line and "(+" in line)
    assert "(+0.419)" in bf16_attr and "(+1.862)" in bf16_attr
    kv_attr = [line for line in lines if line.strip().startswith("fp8_kv") and "n/c" in line
               and "default row ran uncompiled" in line]
    assert len(kv_attr) == 1, text
    assert "4.619*" in kv_attr[0] and "-1.884" not in text and "(+" not in kv_attr[0]
    delta, why = bench.attribution_delta(attribution["fp8_kv"], attribution["fp8_kv"][bench.ATTRIBUTION[0][0]])
    assert delta is None and "uncompiled" in why


def test_decode_table_marks_uncompiled_and_unmeasured_rows_and_leaves_out_their_ratios(bench, monkeypatch, capsys):
    bf16 = {1: _row(5.0, prefill=24.0), 16: _row(5.5, prefill=196.0), 64: _row(6.6)}
    fp8_kv = {1: _row(2.5, prefill=20.0), 16: _row(4.4, compiled=False, prefill=150.0)}  # 64: skipped
    attribution = {"bf16": None, "fp8_kv": None}
    text = _summary_text(bench, monkeypatch, capsys, _results(bench, bf16, fp8_kv, attribution), _args())
    row = next(line for line in text.splitlines() if line.startswith("fp8_kv "))
    cells = [c.strip() for c in row.split("|")]
    assert cells[1].split()[:2] == ["2.500", "2.00"]  # B=1 compiled: its ratio
    assert cells[2].startswith("4.400*") and "n/c" in cells[2]  # B=16 uncompiled: marked, no ratio
    assert "not measured" in cells[3]  # B=64 skipped
    assert cells[4].split() == ["1.20", "n/c*"]  # prefill B=1 ratio; B=16 (uncompiled layers) left out
    assert bench.MARKS["*"] in text and bench.MARKS["-"] in text
    # the JSON row carries no speedup either, and says why
    assert "decode_speedup_vs_bf16" not in fp8_kv[16] and "not compiled" in fp8_kv[16]["vs_bf16_not_comparable"]
    assert fp8_kv[1]["decode_speedup_vs_bf16"] == pytest.approx(2.0)


def test_targets_are_not_judged_from_uncompiled_or_missing_rows(bench):
    ok, uncompiled = _row(2.0), _row(4.0, compiled=False)
    entry, line = bench.target_line("int4_awq decode >= 2.5x bf16", 2.55, 2.5, [ok, ok], True)
    assert entry == {"value": 2.55, "met": True} and "MET" in line
    entry, line = bench.target_line("int8_sq decode >= 1.0x bf16", 1.2, 1.0, [uncompiled, ok], True)
    assert entry["met"] is None and entry["value"] is None and "NOT MEASURED" in line and "1.20" not in line
    entry, line = bench.target_line("fp8 prefill >= 1.4x bf16 (B=16)", None, 1.4, [None, ok], True)
    assert entry["met"] is None and "NOT MEASURED" in line and "MISS" not in line
    # --no-compile asks for uncompiled rows: they are what the run asked, and judged
    entry, _ = bench.target_line("int8_sq decode >= 1.0x bf16", 1.2, 1.0, [uncompiled, ok], False)
    assert entry["met"] is True
    # a compile that failed is the engine's own result: marked "!", still judged
    failed = _row(4.0, compiled=False, compile_error="RuntimeError: x")
    assert bench.row_mark(failed, True)[0] == "!"
    assert bench.target_line("t", 0.9, 1.0, [failed, ok], True)[0]["met"] is False


def test_rows_after_the_headline_are_skipped_not_timed_uncompiled(bench):
    assert bench.extra_row_skip(300, 480, True) is None
    why = bench.extra_row_skip(400, 480, True)
    assert why and "uncompiled" in why  # 80 s left: too little to compile
    assert bench.extra_row_skip(400, 480, False) is None  # --no-compile: nothing to compile
    assert bench.extra_row_skip(470, 480, False)


def test_sweep_timed_puts_the_shipped_int4_table_back(bench, tmp_path, monkeypatch):
    """The sweep's table is installed only for its own timing (a fresh int4_awq engine) and the shipped
    int4.CONFIGS is back after it; the row says which table it timed and is not the headline."""
    from quantlab.engines.kernels import int4

    shipped = {k: dict(v) for k, v in int4.CONFIGS.items()}
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    shape = dict(bench.LLAMA_8B, vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2)
    model = bench.build_reference(1, shape)
    dirs = bench.export_all(model, bench.calibrate(model, tokens=16), tmp_path, ["int4_awq"])
    sweep = {**shipped, (1, 1536, 256): {"gemv": True, "block_n": 64, "bpi": 1, "split_k": 1, "num_warps": 4}}
    monkeypatch.setattr(bench, "SWEEP_TABLE", sweep)
    monkeypatch.setattr(bench, "RESULTS", {"sections": {"bench_bf16": {"batches": {1: _row(5.0)}}}})
    args = argparse.Namespace(batches=[1], context=16, tokens=4, compile=False)
    row = bench.sweep_timed(args, {k: str(v) for k, v in dirs.items()})
    assert int4.CONFIGS == shipped
    assert row["decode_ms_per_token"] > 0 and "(1, 1536, 256)" in row["configs"]
    assert row["decode_speedup_vs_bf16"] == pytest.approx(5.0 / row["decode_ms_per_token"])


def test_provenance_is_stated_and_results_md_does_not_claim_quantlabs_pipeline(bench):
    assert "bench/decode.py's own helpers" in bench.PROVENANCE and "not by quantlab's pipeline" in bench.PROVENANCE
    assert "load_exported" in bench.PROVENANCE
    text = (REPO / "bench" / "RESULTS.md").read_text()
    assert "exported by\nquantlab's own pipeline" not in text and "exported by quantlab's own pipeline" not in text
