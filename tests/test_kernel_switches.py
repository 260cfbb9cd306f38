"""engine.kernels end to end on the CPU: the switches a run was given are in run.json, in metrics.json's run section,
in the engine's plan (with the kernel each INT4 layer shape was given and why the others refused it) and in both
reports; the speed section says which decode path its figures came from."""
from __future__ import annotations

from conftest import FAST, read_json, run_api


def test_kernel_switches_are_recorded_in_run_json_metrics_and_reports(tiny_llama, shared_cache, tmp_path):
    out = tmp_path / "run"
    code = run_api(["+precision=int4_awq", f"model.path={tiny_llama}", f"cache_dir={shared_cache}",
                    "engine.kernels.disabled=[all]", "engine.kernels.pdl=false", *FAST], out)
    assert code in (0, 1), code  # a verdict (pass or fail), not a refusal
    switches = {"disabled": ["all"], "pdl": False, "compile_edges": True, "combo_kernels": True}
    assert read_json(out / "run.json")["engine"]["kernels"] == switches
    doc = read_json(out / "metrics.json")
    assert doc["run"]["kernels"] == switches
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "- engine.kernels: disabled all; pdl False, compile_edges True, combo_kernels True" in md
    assert "<td>engine.kernels</td><td>disabled all; pdl False" in html
    # the engine manifest of this run's build (a key of its own: non-default switches are part of it)
    plans = [read_json(p) for p in shared_cache.glob("engine/*/engine.json")]
    mine = [p for p in plans if p.get("kernel_switches", {}).get("disabled") == ["all"]]
    assert mine and all(p["kernel_choices"] for p in mine), [p.get("kernel_switches") for p in plans]
    for choice in (c for p in mine for c in p["kernel_choices"].values()):
        assert choice == {"kernel": "torch", "refused": dict.fromkeys(
            ("int4_tma", "int4_mma", "int4_k8", "int4_export"), "disabled (engine.kernels.disabled)")}
