"""The plan's cost model where runs showed it wrong (issue 39): AWQ's scale search, builds made on a busy machine,
an evaluation the gate ends before the windows it was priced at, and the large-vocabulary arithmetic the plan
prices (the comparison of logits, the audit's weight statistics)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import FAST, read_json, run_cli

from quantlab import costs, prior

EIGHT_B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256)
H100 = {"matmul_flops": 7.6e14, "elementwise_per_s": 1.8e11, "launch_s": 7.0e-6, "hash_bytes_per_s": 1.3e9}


def _calibration(precision: str, shape, tokens=32 * 512, seq=512, batch=16) -> dict:
    passes = costs.precision_passes(precision, EIGHT_B, seq)
    tried = costs.searches(precision, tokens, seq, batch)
    return costs.work("cuda:H100", f"{precision}/kv=none", shape.params, tokens, passes=passes,
                      units=prior.calibration(shape, tokens, seq, batch, passes, tried))


def test_awq_search_is_priced_per_candidate_layer_and_batch():
    """AWQ-lite tries every candidate scale on every quantized linear layer for every calibration batch: the units
    count those (11 x batches x 7 layers a block), max calibration has none, and the count follows the batches."""
    shape = prior.Shape.of(EIGHT_B, 8_030_261_248)
    fp8, awq = _calibration("fp8", shape)["units"], _calibration("int4_awq", shape)["units"]
    assert "searches" not in fp8
    assert awq["searches"] == 2 * 11 * 32 * 7  # 32 windows in batches of 16, 11 candidates, 32 blocks of 7 layers
    assert _calibration("int4_awq", shape, batch=8)["units"]["searches"] == 2 * awq["searches"]
    assert costs.searches("int8_sq", 16384, 512, 16) == 0 and costs.searches("w4a8_awq", 16384, 512, 16) == 22
    # on a GPU the search dominates a large model's calibration, as measured (101.6 s against fp8's 15.6 s)
    t_fp8 = prior.seconds("quantize", fp8, "cuda", H100, "fp8/kv=none")
    t_awq = prior.seconds("quantize", awq, "cuda", H100, "int4_awq/kv=none")
    assert 4 < t_awq / t_fp8 < 10, (t_fp8, t_awq)


def test_another_precisions_build_is_scaled_by_the_a_priori_work_of_each():
    """A sweep's second precision on one machine: fp8's calibration predicts int4_awq's through the ratio of their
    a-priori seconds (passes and searches), not through the passes alone, which predicted 41 s for 101.6 s."""
    shape = prior.Shape.of(EIGHT_B, 8_030_261_248)
    fp8 = _calibration("fp8", shape)
    rec = costs.record("quantize", 15.6, fp8)
    want = _calibration("int4_awq", shape)
    est = costs.estimate([rec], "quantize", want, speed=H100)
    ratio = (prior.seconds("quantize", want["units"], "cuda", H100, want["variant"])
             / prior.seconds("quantize", fp8["units"], "cuda", H100, fp8["variant"]))
    assert est.rough and "work of each" in est.basis
    assert est.seconds == pytest.approx(15.6 * ratio)
    rec_no_units = {k: v for k, v in rec.items() if k != "units"}  # an older record: linearly, by the passes
    old = costs.estimate([rec_no_units], "quantize", want, speed=H100)
    assert old.seconds == pytest.approx(15.6 * want["passes"] / fp8["passes"])


def test_fixed_seconds_follow_the_machines_launch_time():
    """The fixed seconds are Python-side work: a host whose launches are 1.4x faster does them 1.4x faster."""
    units = {"bytes": 1.0}
    slow = prior.seconds("evaluate", units, "cuda", H100, "torch:int4_awq/kv=none")
    fast = prior.seconds("evaluate", units, "cuda", {**H100, "launch_s": 5.0e-6}, "torch:int4_awq/kv=none")
    assert fast == pytest.approx(slow * 5.0 / 7.0, rel=1e-6)


def test_a_build_on_a_busy_machine_counts_as_on_an_idle_one(tmp_path):
    """A CPU build that had half the machine is counted at half its time, and the estimate says so; a GPU build and
    a record without the share are taken as measured."""
    from quantlab.artifacts import ArtifactStore

    cost = costs.work("cpu:x86_64", "fp8/kv=none", 1000, 4096)
    busy = costs.record("quantize", 100.0, cost, others_cpu=0.5)
    assert costs.idle_seconds(busy) == pytest.approx(50.0)
    assert costs.idle_seconds(costs.record("quantize", 100.0, cost, others_cpu=0.05)) == 100.0  # below BUSY
    assert costs.idle_seconds(costs.record("quantize", 100.0, {**cost, "device": "cuda:H100"}, 0.5)) == 100.0
    assert costs.idle_seconds(costs.record("quantize", 100.0, cost)) == 100.0

    store = ArtifactStore(tmp_path / "c")
    store.get_or_build("quantize", "k1", lambda out: (out / "x").write_text("x") and {}, {}, cost=cost)
    manifest = next((tmp_path / "c").glob("quantize/*/manifest.json"))
    doc = read_json(manifest)
    doc["cost"].update(wall_time_s=100.0, others_cpu=0.5)  # as a build that shared the machine writes it
    manifest.write_text(__import__("json").dumps(doc))
    (hist,) = [c for c in costs.history(ArtifactStore(tmp_path / "c")) if c["stage"] == "quantize"]
    assert hist["wall_time_s"] == pytest.approx(50.0) and hist["measured_s"] == 100.0
    est = costs.estimate([hist], "quantize", cost)
    assert est.seconds == pytest.approx(50.0) and "other processes used the CPU" in est.basis


def test_busy_share_sees_another_process_burning_a_cpu():
    """busy_share from /proc/stat: a process spinning on one CPU for a second is at least most of one CPU's share
    (more when the machine is loaded otherwise); this process's own work, and its children's once waited for (a
    build's subprocesses), are not counted."""
    import os

    if costs.cpu_sample() is None:
        pytest.skip("no /proc/stat here")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<5: pass"])
    try:
        time.sleep(0.3)  # the interpreter started
        before = costs.cpu_sample()
        start = time.time()
        time.sleep(1.2)
        share = costs.busy_share(before, time.time() - start)  # before it is waited for: another process's time
    finally:
        spin.kill()
        spin.wait()
    assert share is not None and 0.6 / (os.cpu_count() or 1) <= share <= 1.0, share
    mine = costs.cpu_sample()
    t = time.time()
    while time.time() - t < 0.8:  # this process's own spinning
        pass
    own = costs.busy_share(mine, time.time() - t)
    assert own is not None and own < share, (own, share)


def test_an_evaluation_the_gate_ends_early_is_compared_at_the_windows_it_read(tiny_llama, tmp_path):
    """The plan prices a passing run's windows; a run that stops at another look is compared with the same
    estimate at the windows it read (planned_read_s), and error_shown keeps the figure the plan showed."""
    res = run_cli(["+precision=int4_awq", f"model.path={tiny_llama}", *FAST, "eval.max_windows=16",
                   "hydra.run.dir=outputs/a"], cwd=tmp_path, cache=tmp_path / "c")
    assert res.returncode in (0, 1), res.stderr[-2000:]
    run = read_json(tmp_path / "outputs" / "a" / "run.json")
    used = read_json(tmp_path / "outputs" / "a" / "metrics.json")["gate"]["design"]["windows_used"]
    row = run["plan"]["steps"]["evaluate:torch"]
    priced = row["priced"]["units"]
    if "planned_read_s" in row:
        assert row["windows_read"] == used
        assert row["error"] == pytest.approx(row["actual_s"] / row["planned_read_s"] - 1, abs=2e-3)
        assert row["error_shown"] == pytest.approx(row["actual_s"] / row["planned_s"] - 1, abs=2e-3)
        assert run["plan"]["shown_s"] != run["plan"]["planned_s"]
    else:  # it read what the plan priced
        assert priced["launches"] > 0 and "error_shown" not in row
    # the re-priced figure is the same model at fewer or more tokens: it moves with the windows read
    from quantlab.pipeline import plan_vs_actual

    plan = plan_vs_actual({"evaluate:torch": {"planned_s": 10.0, "planned_read_s": 4.0, "windows_read": 4},
                           "quantize": {"planned_s": 5.0}}, {"evaluate:torch": 5.0, "quantize": 5.0})
    assert plan["steps"]["evaluate:torch"]["error"] == pytest.approx(0.25)
    assert plan["steps"]["evaluate:torch"]["error_shown"] == pytest.approx(-0.5)
    assert plan["planned_s"] == 9.0 and plan["shown_s"] == 15.0 and plan["error"] == pytest.approx(10 / 9 - 1, abs=1e-3)


def test_logits_are_compared_in_groups_of_rows_with_identical_results():
    """compare_positions on a CPU works through a large vocabulary's logits a few rows at a time: the same numbers
    as all at once, bit for bit, and a broken candidate row still takes the float64 path."""
    import torch

    from quantlab.gate import metrics

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 9, 70000, generator=g) * 3
    cand = ref + 0.1 * torch.randn(ref.shape, generator=g)
    targets = torch.randint(0, 70000, (2, 9), generator=g)
    grouped = metrics.compare_positions(ref, cand, targets)
    whole = metrics._compare_rows(ref, cand, targets)
    assert metrics.COMPARE_ELEMENTS // 70000 < 18  # more than one group
    for k in whole:
        assert grouped[k].shape == whole[k].shape and torch.equal(grouped[k], whole[k]), k
    cand[1, 4, 5] = 1e30  # overflows the float32 form: that group goes through float64
    broken = metrics.compare_positions(ref, cand, targets)
    assert torch.isfinite(broken["kl"]).all() and broken["kl"][1, 4] > 1e29
    rows = metrics.COMPARE_ELEMENTS // 70000  # the groups without the broken row keep the float32 form's figures
    assert torch.equal(broken["kl"].reshape(-1)[:rows], whole["kl"].reshape(-1)[:rows])


def test_weight_statistics_match_the_direct_sums():
    """The audit's per-column sums in groups of rows equal the sums over the whole weight (float64 reference)."""
    import torch

    from quantlab.audit import weight_stats

    g = torch.Generator().manual_seed(1)
    a = torch.randn(3000, 1500, generator=g)
    b = a + 0.01 * torch.randn(a.shape, generator=g)
    got = weight_stats._column_dots(a, b)
    assert a.numel() > weight_stats.DOT_ELEMENTS  # more than one group
    want = (a.double() * b.double()).sum(0)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-3)
    stats = weight_stats.weight_stats(a, b)
    cos = float((a.double() * b.double()).sum() / (a.double().norm() * b.double().norm()))
    assert stats["cosine"] == pytest.approx(cos, abs=2e-6)
