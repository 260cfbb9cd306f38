"""bench/maintained_kernels.py's own logic that runs without a GPU: the numerics contract a kernel's output is judged by
(it passes the plain-torch arithmetic and catches one wrong code or channel scale), torch's int4 mm operands built
from the export layout (through torch's CPU int4 mm they give back the dequantized weights bit for bit), and the
decision that prefers a maintained kernel only where it meets the contract at ours' speed or better."""
from __future__ import annotations

import math
import time

import pytest
import torch
from _scripts import bench_module

from quantlab.engines.kernels import int4


@pytest.fixture(scope="module")
def mk():
    yield from bench_module("maintained_kernels.py", "_bench_maintained_logic")


def _layer(n=32, k=256, group=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n // 2, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).bfloat16()
    x = torch.randn(3, k, generator=g).bfloat16()
    return x, packed, scales


def test_contract_passes_the_plain_arithmetic_and_catches_one_wrong_code(mk):
    x, packed, scales = _layer()
    w = int4.reference(torch.eye(256).bfloat16(), packed, scales, None, 128).t()  # the dequantized weights
    exact, bound = int4.bound(x, w, torch.bfloat16)
    good = mk.contract(int4.reference(x, packed, scales, None, 128), exact, bound, torch.bfloat16)
    assert good["meets"] and good["worst"] <= 1.0 and 0 < good["max_abs_err"] < math.inf
    wrong = packed.clone()
    wrong[5, 17] ^= 0x10  # one code of row 11 changed
    bad = mk.contract(int4.reference(x, wrong, scales, None, 128), exact, bound, torch.bfloat16)
    assert not bad["meets"] and bad["worst"] > 10 and "outside the bound" in bad["why"]
    as_fp32 = mk.contract(exact.float(), exact, bound, torch.bfloat16)
    assert not as_fp32["meets"] and "wrong output" in as_fp32["why"]
    y = int4.reference(x, packed, scales, None, 128)
    y[0, 0] = float("nan")
    assert not mk.contract(y, exact, bound, torch.bfloat16)["meets"]


def test_tinygemm_operands_give_back_the_dequantized_weights(mk):
    _, packed, scales = _layer(n=64, k=1024)
    codes, sz = mk.tinygemm_codes(packed, scales)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert sz.shape == (1024 // 128, 64, 2) and sz.dtype == torch.bfloat16
    w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)  # torch's CPU packing of the same codes
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(1024).bfloat16(), w, 128, sz).t()
    want = int4.reference(torch.eye(1024).bfloat16(), packed, scales, None, 128).t()
    assert torch.equal(got, want)  # (u - 8) * scale + 0, the one rounding to bf16 of q * scale
    pairs = mk.nibble_pairs(codes)
    assert pairs.shape == (64, 512) and pairs.dtype == torch.uint8
    assert torch.equal((pairs >> 4).int(), codes[:, 0::2]) and torch.equal((pairs & 15).int(), codes[:, 1::2])


def test_rowwise_bound_catches_a_wrong_channel_scale(mk):
    from quantlab.engines.kernels import fp8

    g = torch.Generator().manual_seed(1)
    xq, w = fp8.codes((2, 512), g), fp8.codes((48, 512), g, 0.25)
    sa, sb = torch.rand(2, 1, generator=g) * 0.02 + 1e-3, torch.rand(1, 48, generator=g) * 0.01 + 1e-4
    exact, bound = mk.rowwise_bound(xq, w, sa, sb, torch.bfloat16)
    y = ((xq.float() @ w.float().t()) * sa * sb).bfloat16()
    assert mk.contract(y, exact, bound, torch.bfloat16)["meets"]
    sb_wrong = sb.clone()
    sb_wrong[0, 7] *= 1.01
    y_wrong = ((xq.float() @ w.float().t()) * sa * sb_wrong).bfloat16()
    assert not mk.contract(y_wrong, exact, bound, torch.bfloat16)["meets"]


def _r(kernel, us, meets=True, role="maintained", m=1, shape="o 4096x4096", **extra):
    return {"op": "w4a16", "kernel": kernel, "role": role, "shape": shape, "m": m, "us": us, "meets": meets,
            "why": "within the bound" if meets else "outside the bound: worst/bound 3.10", **extra}


def test_decide_prefers_a_maintained_kernel_only_when_exact_and_as_fast(mk):
    rows = [_r("ours", 10.0, role="ours"), _r("fast but inexact", 5.0, meets=False), _r("slower", 12.0),
            _r("failed", math.nan, meets=False, error="prepare: RuntimeError: no")]
    (d,) = mk.decide(rows)
    assert d["prefer"] == "ours" and not d["maintained"]
    assert "outside the bound" in d["refused"]["fast but inexact"] and "slower" in d["refused"]["slower"]
    assert d["refused"]["failed"].startswith("prepare:")
    (tie,) = mk.decide([_r("ours", 10.0, role="ours"), _r("equal", 10.0)])
    assert tie["prefer"] == "equal" and tie["maintained"]  # at least as fast: equal time counts
    (tol,) = mk.decide([_r("ours", 10.0, role="ours"), _r("near", 10.4)], tolerance=0.05)
    assert tol["prefer"] == "near"
    (none,) = mk.decide([_r("ours", 10.0, role="ours"), _r("near", 10.4)])
    assert none["prefer"] == "ours"
    (two,) = mk.decide([_r("ours", 10.0, role="ours"), _r("a", 9.0), _r("b", 8.0)])
    assert two["prefer"] == "b" and "qualifies, but b" in two["refused"]["a"]
    (lost,) = mk.decide([_r("a", 9.0)])
    assert lost["prefer"] is None and "not measured" in lost["why"]
    (broken,) = mk.decide([_r("ours", 10.0, role="ours", meets=False), _r("a", 9.0)])
    assert broken["prefer"] is None


def test_prefer_lines_and_ratios(mk):
    rows = mk.with_ratios([_r("ours", 10.0, role="ours"), _r("a", 8.0), _r("ours", 20.0, role="ours", m=16),
                           _r("a", 25.0, m=16)])
    assert rows[1]["vs_ours"] == pytest.approx(1.25) and rows[3]["vs_ours"] == pytest.approx(0.8)
    (line,) = mk.prefer_lines(mk.decide(rows))
    assert line.startswith("prefer w4a16: a at M=1 o 4096x4096") and "ours at the other 1 of 2" in line
    (kept,) = mk.prefer_lines(mk.decide([_r("ours", 10.0, role="ours"), _r("a", 11.0)]))
    assert kept == "prefer w4a16: ours at all 1 (shape, M) measured"
    assert len(mk.table(rows)) == 2 + len(rows)


def test_arguments(mk):
    args = mk.parse_args(["--rows", "16,1,16", "--ops", "w4a16"])
    assert args.row_counts == [1, 16] and args.op_list == ["w4a16"]
    with pytest.raises(SystemExit):
        mk.parse_args(["--ops", "w4a16,nvfp4"])
    with pytest.raises(SystemExit):
        mk.parse_args(["--rows", "1,x"])
    plan = mk.plan(mk.parse_args(["--quick", "--exclude", "gemlite,iKT=2"]))
    assert sum("[not run: --exclude gemlite]" in line for line in plan) == 3
    assert sum("[not run: --exclude iKT=2]" in line for line in plan) == 1
    assert any("tinygemm, iKT=8" in line for line in plan) and any("gemlite GEMM" in line and "M=[16]" in line
                                                                   for line in plan)


def test_run_shape_checks_times_and_records_every_failure(mk):
    x, packed, scales = _layer()
    w = int4.reference(torch.eye(256).bfloat16(), packed, scales, None, 128).t()
    exact, bound = int4.bound(x, w, torch.bfloat16)
    t = {"n": 32, "k": 256, "layers": [(packed, scales, None, None)] * 2, "inputs": lambda m: (x[:m],),
         "exact_for": lambda m: (exact[:m], bound[:m]), "dtype": torch.bfloat16}
    prepared = []

    def prepare(t):
        prepared.append(1)
        return [(p, s) for p, s, _, _ in t["layers"]]

    def plain(a, s):
        return int4.reference(a[0], s[0], s[1], None, 128)

    kernels = [mk.Kernel("w4a16", "ours", prepare, plain, role=mk._ours, share="export"),
               mk.Kernel("w4a16", "wrong codes", prepare, lambda a, s: plain(a, (s[0] ^ 0x11, s[1])), share="export"),
               mk.Kernel("w4a16", "broken", lambda t: 1 / 0, plain),
               mk.Kernel("w4a16", "raises", prepare, lambda a, s: torch.empty(0).view(3, 3), share="export"),
               mk.Kernel("w4a16", "missing", prepare, plain, lib="nolib"),
               mk.Kernel("w4a16", "skipped", prepare, plain, skip="not run: a reason"),
               mk.Kernel("w4a16", "16 rows only", prepare, plain, rows=(16,))]
    libs = {"nolib": {"imports": False, "error": "ModuleNotFoundError: nolib"}}
    rows = mk.run_shape(kernels, t, "test 32x256", [1, 3], libs, time.time() + 60)
    assert len(prepared) == 1  # the kernels of one share key prepare once
    by = {(r["kernel"], r["m"]): r for r in rows}
    assert set(by) == {(name, m) for name in ("ours", "wrong codes", "broken", "raises", "missing", "skipped")
                       for m in (1, 3)}
    assert all(by["ours", m]["meets"] and by["ours", m]["us"] > 0 and by["ours", m]["role"] == "ours" for m in (1, 3))
    wrong = by["wrong codes", 1]
    assert not wrong["meets"] and wrong["us"] > 0 and wrong["role"] == "maintained"  # timed all the same
    assert by["broken", 1]["error"].startswith("prepare: ZeroDivisionError")
    assert by["raises", 3]["error"].startswith("RuntimeError") and not by["raises", 3]["meets"]
    assert "nolib does not import (ModuleNotFoundError: nolib)" in by["missing", 1]["error"]
    assert by["skipped", 3]["error"] == "not run: a reason"
    (d1, d3) = mk.decide(mk.with_ratios(rows))
    assert d1["refused"]["wrong codes"].startswith("outside the bound")
    assert d1["refused"]["skipped"] == "not run: a reason" and d3["refused"]["missing"].startswith("not run: nolib")
    late = mk.run_shape(kernels[:1], t, "test 32x256", [1], libs, time.time() - 1)
    assert [r["error"] for r in late] == ["not run: budget spent"]
