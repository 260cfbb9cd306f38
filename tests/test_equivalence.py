"""Equivalence transforms are not faults (quantlab.audit.equivalence): checkpoints built here from the documented
layouts (llm-compressor's AWQ smoothing with its recipe.yaml, compressed-tensors' pack-quantized W4A16 and its
transform_config) from the tiny random GQA Llama of tests/test_formats.py. A smoothing moved between v_proj -> o_proj
and up_proj -> down_proj (on top of the norm folds) audits clean and names the transforms; the same checkpoint with
one side of one smoothing undone, or the inverse put on gate_proj, is an audit error naming the pair; a transform
declared to run online is refused (exit 2) naming it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_formats
import torch
from test_formats import (
    GROUP,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    _ct_config,
    _linear_weights,
    _plain_tensors,
    _save,
    _weight_args,
)

reference = test_formats.reference  # the tiny reference Llama (a module-scoped fixture)

RECIPE = """default_stage:
  default_modifiers:
    AWQModifier:
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: false, group_size: GROUP_SIZE, strategy: group}
      ignore: [lm_head]
      mappings:
      - smooth_layer: re:.*input_layernorm$
        balance_layers: ['re:.*q_proj$', 're:.*k_proj$', 're:.*v_proj$']
      - smooth_layer: re:.*v_proj$
        balance_layers: ['re:.*o_proj$']
      - smooth_layer: re:.*post_attention_layernorm$
        balance_layers: ['re:.*gate_proj$', 're:.*up_proj$']
      - smooth_layer: re:.*up_proj$
        balance_layers: ['re:.*down_proj$']
      duo_scaling: true
""".replace("GROUP_SIZE", str(GROUP))


def _pack_w4a16(weights: dict[str, torch.Tensor], tensors: dict) -> None:
    """pack-quantized int4, asymmetric, group GROUP (tests/test_formats.py's pack_w4a16)."""
    test_formats.pack_w4a16(weights, tensors, symmetric=False)


def _value_to_output_columns(s: torch.Tensor) -> torch.Tensor:
    """A factor per v_proj output row (KV_HEADS x HEAD_DIM) as o_proj's input columns see it (HEADS x HEAD_DIM):
    each query head reads its group's value head."""
    return s.view(KV_HEADS, 1, HEAD_DIM).expand(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM).reshape(-1)


def build_smoothed(reference: Path, out: Path, fault: str | None = None) -> Path:
    """AWQ as llm-compressor applies it (modifiers/transform/awq: balance layers' input columns times s, the smooth
    layer divided by s: a norm's weight, or a Linear's output rows), for its four Llama mappings, then W4A16 asym
    group GROUP. fault: "consumer undone" (block 1's down_proj columns not multiplied), "producer undone"
    (block 0's v_proj rows not divided), "wrong producer" (block 1's gate_proj rows divided instead of up_proj's),
    "not reciprocal" (block 1's down_proj columns multiplied by other factors than up_proj's rows were divided by);
    not faults: "mild" (every factor drawn 7.5x narrower, as narrow as llm-compressor's real AWQ factors of the
    default model), "v_proj -> o_proj skipped" (that mapping left out, as llm-compressor does where grouped-query
    attention makes the widths differ, while recipe.yaml still declares it)."""
    gen = torch.Generator().manual_seed(7)
    w, plain = _linear_weights(reference), _plain_tensors(reference)

    def scale(n: int) -> torch.Tensor:  # "mild": factors as narrow as real AWQ's (a log spread of 0.04-0.2)
        return torch.exp((0.08 if fault == "mild" else 0.6) * torch.randn(n, generator=gen))

    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        s = scale(w[f"{p}.self_attn.q_proj"].shape[1])
        plain[f"{p}.input_layernorm.weight"] = plain[f"{p}.input_layernorm.weight"] / s
        for m in ("q_proj", "k_proj", "v_proj"):
            w[f"{p}.self_attn.{m}"] = w[f"{p}.self_attn.{m}"] * s[None, :]
        s = scale(KV_HEADS * HEAD_DIM) if fault != "v_proj -> o_proj skipped" else torch.ones(KV_HEADS * HEAD_DIM)
        if not (fault == "producer undone" and layer == 0):
            w[f"{p}.self_attn.v_proj"] = w[f"{p}.self_attn.v_proj"] / s[:, None]
        w[f"{p}.self_attn.o_proj"] = w[f"{p}.self_attn.o_proj"] * _value_to_output_columns(s)[None, :]
        s = scale(w[f"{p}.mlp.up_proj"].shape[1])
        plain[f"{p}.post_attention_layernorm.weight"] = plain[f"{p}.post_attention_layernorm.weight"] / s
        for m in ("gate_proj", "up_proj"):
            w[f"{p}.mlp.{m}"] = w[f"{p}.mlp.{m}"] * s[None, :]
        s = scale(w[f"{p}.mlp.up_proj"].shape[0])
        producer = "gate_proj" if fault == "wrong producer" and layer == 1 else "up_proj"
        w[f"{p}.mlp.{producer}"] = w[f"{p}.mlp.{producer}"] / s[:, None]
        if fault == "not reciprocal" and layer == 1:
            s = scale(s.shape[0])  # the consumer multiplied by another calibration's factors
        if not (fault == "consumer undone" and layer == 1):
            w[f"{p}.mlp.down_proj"] = w[f"{p}.mlp.down_proj"] * s[None, :]
    _pack_w4a16(w, plain)
    _save(out, reference, plain, _ct_config("pack-quantized", _weight_args(4, "int", "group", False, GROUP), None))
    (out / "recipe.yaml").write_text(RECIPE)
    return out


@pytest.fixture(scope="module")
def smoothed(reference, tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(fault: str | None = None) -> Path:
        if fault not in cache:
            cache[fault] = build_smoothed(reference, tmp_path_factory.mktemp("smoothed") / str(fault), fault)
        return cache[fault]
    return get


@pytest.mark.parametrize("variant", [None, "mild"])
def test_smoothing_between_linear_pairs_is_accepted_and_named(variant, smoothed, reference):
    """v_proj -> o_proj (grouped-query: a value row feeds one column per query head of its group) and
    up_proj -> down_proj smoothed on top of the norm folds: no error, no warning on the weights, an info finding
    naming both transforms and the recipe that declares them, every pair's layers compared through the scale. Also
    with factors as narrow as a real AWQ's ("mild": below the format's column-spread warning, where a fixed gate
    once left them to the per-layer checks' errors)."""
    from quantlab.audit.bounds import weight_bounds
    from quantlab.audit.checks import audit

    report = audit(smoothed(variant), reference, canary=False, device="cpu")
    assert not report.errors, [f.message for f in report.errors]
    assert not [f for f in report.warnings if f.check == "weights"], [f.message for f in report.warnings]
    named = [f for f in report.findings if "equivalence transforms accepted" in f.message]
    assert len(named) == 1, [f.message for f in report.findings]
    text = named[0].message
    assert "v_proj -> o_proj in 2 block(s)" in text and "up_proj -> down_proj in 2 block(s)" in text, text
    assert "recipe.yaml" in text, text
    from quantlab.pipeline import audit_record

    kept = [f["message"] for f in audit_record(report)["findings"] if f["severity"] == "info"]
    assert kept == [text], kept  # run.json and the run's report name the accepted transforms
    rows = {r["module"]: r for r in report.layers}
    for layer in range(LAYERS):
        for m in ("self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            row = rows[f"model.layers.{layer}.{m}"]
            assert row.get("transform", "").startswith("smoothing "), row
            bounds = weight_bounds(row["format"])  # the format's own bounds, as for any layer
            assert row["sqnr_db"] > bounds.sqnr_warn_db and row["column_spread"] < bounds.column_spread_warn, row


@pytest.mark.parametrize("fault, pair, words", [
    ("consumer undone", ("model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"), "output rows are scaled"),
    ("producer undone", ("model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj"),
     "input columns are scaled"),
    ("wrong producer", ("model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"), "model.layers.1.mlp.gate_proj"),
    ("not reciprocal", ("model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"), "not by reciprocal factors"),
])
def test_one_sided_or_misplaced_smoothing_is_an_error_naming_the_pair(fault, pair, words, smoothed, reference):
    """One side of one smoothing undone, or its inverse put on a layer that feeds the consumer through SiLU: an
    audit error naming the pair (the other block's pairs are still accepted)."""
    from quantlab.audit.checks import audit

    report = audit(smoothed(fault), reference, canary=False, device="cpu")
    named = [f for f in report.errors if "smoothing pair" in f.message]
    assert len(named) == 1, [f.message for f in report.errors]
    text = named[0].message
    assert f"{pair[0]} -> {pair[1]}" in text and words in text, text
    assert set(pair) <= set(named[0].modules)
    accepted = [f for f in report.findings if "equivalence transforms accepted" in f.message]
    assert accepted and "in 1 block(s)" in accepted[0].message, [f.message for f in report.findings]


def test_a_declared_smoothing_left_out_is_named_not_a_fault(smoothed, reference):
    """recipe.yaml declares v_proj -> o_proj but the tool skipped it (widths differ under grouped-query attention):
    no error, up_proj -> down_proj still accepted, and an info finding says that no pair carries the declared
    factors and why."""
    from quantlab.audit.checks import audit

    report = audit(smoothed("v_proj -> o_proj skipped"), reference, canary=False, device="cpu")
    assert not report.errors, [f.message for f in report.errors]
    accepted = [f.message for f in report.findings if "equivalence transforms accepted" in f.message]
    assert accepted and "up_proj -> down_proj in 2 block(s)" in accepted[0] and "v_proj" not in accepted[0].split(
        "recipe.yaml")[0], accepted
    left = [f.message for f in report.findings if "declares the smoothing re:.*v_proj$" in f.message]
    assert len(left) == 1 and "none of the 2 v_proj -> o_proj pair(s)" in left[0] and "widths differ" in left[0], left


def test_recipe_mappings_are_read(smoothed):
    from quantlab.formats.compressed_tensors import recipe_mappings

    assert recipe_mappings(smoothed(None)) == [
        ("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
        ("re:.*v_proj$", ["re:.*o_proj$"]),
        ("re:.*post_attention_layernorm$", ["re:.*gate_proj$", "re:.*up_proj$"]),
        ("re:.*up_proj$", ["re:.*down_proj$"])]


# --------------------------------------------------------------------------------------- declared transforms
SPINQUANT_R4 = {"config_groups": {"R4": {"type": "hadamard", "randomize": False, "requires_grad": False,
                                         "head_dim": None, "precision": "float32",
                                         "apply": [{"targets": ["re:.*mlp.down_proj$"], "location": "input",
                                                    "inverse": False, "ignore": []},
                                                   {"targets": ["re:.*mlp.down_proj$"],
                                                    "location": "weight_input", "inverse": True, "ignore": []}]}}}
SPINQUANT_R3 = {"config_groups": {"R3": {"type": "hadamard", "head_dim": HEAD_DIM,
                                         "apply": [{"targets": ["re:.*self_attn$"], "location": "q_attn"},
                                                   {"targets": ["re:.*self_attn$"], "location": "k_cache"}]}}}


def _with_transform(source: Path, ckpt: Path, transform: dict) -> Path:
    """A copy of a checkpoint whose quantization_config declares this transform_config."""
    shutil.copytree(source, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["transform_config"] = transform
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


@pytest.mark.parametrize("transform, named", [(SPINQUANT_R4, "config_groups.R4"), (SPINQUANT_R3, "config_groups.R3")])
def test_an_online_transform_is_refused_with_exit_2_naming_it(transform, named, smoothed, tmp_path, capsys):
    """A run-time Hadamard (SpinQuant R4 before down_proj, R3 on the queries and keys): the checkpoint computes
    another function without it, so opening it, auditing it and `python -m quantlab.audit` are exit 2 naming the
    transform and its location."""
    from quantlab.audit.__main__ import main
    from quantlab.errors import QuantlabError
    from quantlab.formats import open_checkpoint

    ckpt = _with_transform(smoothed(None), tmp_path / "online", transform)
    with pytest.raises(QuantlabError) as exc:
        open_checkpoint(ckpt)
    assert exc.value.exit_code == 2 and named in str(exc.value) and "at run time" in str(exc.value), str(exc.value)
    assert "vLLM" in exc.value.fix
    assert main([str(ckpt), "--no-canary"]) == 2
    assert named in capsys.readouterr().err


SPINQUANT_R1 = {"config_groups": {"R1": {"type": "hadamard", "head_dim": None, "apply": [
    {"targets": ["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$"], "location": "weight_output"},
    {"targets": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$", "re:.*up_proj$", "re:.*gate_proj$", "lm_head"],
     "location": "weight_input", "inverse": True}]}}}


def test_an_offline_rotation_is_refused_naming_it_not_audited_as_faults(smoothed, tmp_path):
    """SpinQuant R1 fused into the weights (weight_input / weight_output only): the checkpoint computes the
    reference's function, but the audit cannot compare through a rotation, so it is exit 2 naming the transform
    (not a battery of per-layer faults, not a pass)."""
    from quantlab.errors import QuantlabError
    from quantlab.formats import open_checkpoint

    ckpt = _with_transform(smoothed(None), tmp_path / "rotated", SPINQUANT_R1)
    with pytest.raises(QuantlabError) as exc:
        open_checkpoint(ckpt)
    text = str(exc.value)
    assert exc.value.exit_code == 2 and "config_groups.R1" in text and "weight_output" in text, text
    assert "rotat" in text and "SpinQuantModifier" in exc.value.fix


def test_one_side_within_what_healthy_exports_show_is_no_fault():
    """The spreads measured on real checkpoints (2026-12-07): ModelOpt's healthy int8_sq export of the default model,
    layer 11 up_proj -> down_proj (producer rows 0.0004, consumer columns 0.0459, product 0.0813: nothing moved,
    within SmoothQuant's healthy column spread) is no fault; llm-compressor's AWQ with block 12's down_proj
    unsmoothed (producer rows 0.0858, consumer columns 0.0041) is "producer only"; reciprocal sides are accepted."""
    from quantlab.audit.bounds import weight_bounds
    from quantlab.audit.equivalence import _classify

    sq, w4 = weight_bounds("W8A8_SQ_PER_CHANNEL"), weight_bounds("W4A16_AWQ")
    assert _classify(0.0004, 0.0459, 0.0813, 0.0, sq) is None
    assert _classify(0.0858, 0.0041, 0.204, 0.0, w4) == "producer only"
    assert _classify(0.0041, 0.0858, 0.204, 0.0, w4) == "consumer only"
    assert _classify(0.2, 0.2, 0.0085, 0.0, w4) == "accepted"
