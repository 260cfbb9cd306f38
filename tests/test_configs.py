"""Every config option of every group composes into a typed Config, and the registries agree with conf/.

Config-only bad input is checked here in-process (no subprocess): the CLI's argv checks and preflight raise the
same QuantlabError the CLI turns into exit 2 (tests/test_cli.py runs two bad commands through the real CLI)."""
from __future__ import annotations

import itertools

import pytest
from conftest import FAST, compose

from quantlab.cli import check_argv
from quantlab.compose import group_options
from quantlab.engines.registry import ENGINE_SCHEMAS, ENGINES, engine_of
from quantlab.errors import EXIT_BAD_INPUT, QuantlabError
from quantlab.gate.metrics import GATEABLE, METRICS
from quantlab.precisions import KV_FORMATS, PRECISION_SCHEMAS, PRECISIONS, precision_of
from quantlab.preflight import check_config


def test_groups_match_registries():
    assert group_options("precision") == sorted(PRECISIONS)
    assert group_options("engine") == sorted(ENGINE_SCHEMAS)
    assert group_options("kv_cache") == sorted(KV_FORMATS)


@pytest.mark.parametrize("precision,engine", list(itertools.product(sorted(PRECISIONS), sorted(ENGINE_SCHEMAS))))
def test_every_precision_and_engine_composes_typed(precision, engine):
    cfg, snapshot = compose([f"precision={precision}", f"engine={engine}"])
    assert type(cfg.precision) is PRECISION_SCHEMAS[precision]
    assert precision_of(cfg.precision).name == precision
    assert engine_of(cfg.engine).name == engine
    assert "name" not in snapshot["precision"]  # what runs is the type, not a settable name


@pytest.mark.parametrize("group", ["kv_cache", "gate", "model"])
def test_every_option_of_the_other_groups_composes(group):
    for option in group_options(group):
        extra = ["model.path=/some/dir"] if (group, option) == ("model", "local") else []
        cfg, _ = compose(["+precision=fp8", f"{group}={option}", *extra])
        assert cfg is not None


def test_every_calibration_recipe_composes_for_both_roles():
    for recipe in group_options("calib_data"):
        for role in ("calib", "eval"):
            cfg, _ = compose(["+precision=fp8", f"calib_data@{role}={recipe}"])
            assert getattr(cfg, role).seq_len > 0


def test_plus_and_plain_precision_spellings_are_the_same():
    a, _ = compose(["+precision=int4_awq"])
    b, _ = compose(["precision=int4_awq"])
    assert a == b and a.precision.block_size == "auto"


def test_default_gate_passes_its_own_validation():
    for name, precision in PRECISIONS.items():
        engine = "torch" if ENGINES["torch"].supports(precision.quant_algo) else "fakequant"
        cfg, _ = compose([f"+precision={name}", f"engine={engine}"])
        if name == "mixed":  # per-layer formats exist only in a checkpoint (the search's): refused without one
            with pytest.raises(QuantlabError, match="quantlab makes one only through the search"):
                check_config(cfg)
            continue
        if name == "external":  # another tool's checkpoint: nothing to quantize without engine.checkpoint
            with pytest.raises(QuantlabError, match="evaluates a checkpoint made elsewhere"):
                check_config(cfg)
            continue
        check_config(cfg)


@pytest.mark.parametrize("argv,message", [
    (["+precision=fp9"], "unknown precision 'fp9'; did you mean 'fp8'"),
    (["+precision=fp8", "engine=torhc"], "did you mean 'torch'"),
    (["+precision=fp8", "precision.name=int4_awq"], "has no 'name'"),
    (["+precision=fp8", "precision.block_size=64"], "only int4_awq, w4a8_awq have 'block_size'"),
    (["-m", "+precision=fp8,int4_awq", "precision.block_size=64"], "does not apply to precision=fp8"),
    (["+precision=fp8", "engine=fakequant", "engine.checkpoint=/x"], "only torch, trtllm have 'checkpoint'"),
    (["+precision=fp8", "engine.tensor_parallel_size=2"], "only trtllm has 'tensor_parallel_size'"),
    (["+precision=fp8", "calib.num_sample=3"], "did you mean 'num_samples'"),
    (["+precision=fp8", "gate.thresholds.top1_agrement.min=0.5"], "did you mean 'top1_agreement'"),
    (["+precision=fp8", "gate.per_precision.fp9.ppl_ratio.max=1.2"], "did you mean 'fp8'"),
    ([], "no precision chosen"),
    (["+precision=fp8", "search.latency_repeats=5"], "search.latency_repeats sets an option of .search"),
])
def test_argv_checks(argv, message):
    with pytest.raises(QuantlabError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_argv(argv)


@pytest.mark.parametrize("argv,message", [
    (["+precision=fp8", "eval.max_window=3"], "did you mean 'max_windows'"),
    (["+precision=fp8", "kv_cache=fp16"], "unknown kv_cache 'fp16'"),
    (["+precision=int4_awq", "precision.blok_size=64"], "did you mean 'block_size'"),
    (["+precision=fp8", "calib.num_samples=0"], "calib.num_samples=0 must be a positive number"),
    (["+precision=fp8", "eval.prefix_token=cls"], "eval.prefix_token='cls' is not supported"),
    (["+precision=fp8", "eval.seq_len=1"], "a window needs 2 tokens or more"),
    (["+precision=fp8", "model.device_map=everywhere"], "model.device_map='everywhere' is not supported"),
])
def test_command_line_config_errors(argv, message):
    """What the CLI does before any compute, in-process: argv checks, compose, config checks (with the small eval
    settings the CLI tests run with); each bad command is refused (exit 2) with its message."""
    def refuse():
        args = check_argv(argv + [a for a in FAST if not any(a.split("=")[0] == b.split("=")[0] for b in argv)])
        check_config(compose(args)[0])

    with pytest.raises(QuantlabError) as err:
        refuse()
    assert err.value.exit_code == EXIT_BAD_INPUT and message in str(err.value), str(err.value)


def test_sweep_over_precisions_needs_no_block_size_override():
    assert check_argv(["-m", "+precision=fp8,int8_sq,int4_awq"]) == ["-m", "precision=fp8,int8_sq,int4_awq"]


@pytest.mark.parametrize("overrides,message", [
    (["gate.thresholds.ppl_ratio.min=1.1"], "ppl_ratio.min bounds ppl_ratio from the wrong side"),
    (["gate.thresholds.top1_agreement.max=0.9"], "top1_agreement.max bounds top1_agreement from the wrong side"),
    (["gate.thresholds.top1_agreement.min=1.5"], "outside top1_agreement's range"),
    (["++gate.thresholds.kl_mean.max=-0.1"], "outside kl_mean's range"),
    (["gate.statistical.alpha=0"], "strictly between 0 and 1"),
    (["gate.statistical.beta=1.5"], "strictly between 0 and 1"),
    (["gate.baseline_alpha=1"], "strictly between 0 and 1"),
    (["precision=int4_awq", "precision.block_size=abc"], "neither auto nor a positive integer"),
    (["model.path="], "model.path is empty"),
    (["gate.baseline="], "gate.baseline is empty"),
    (["eval.path="], "eval.path is empty"),
    (["stop_after=nowhere"], "is not a stage"),
    (["eval.gen_prompt_len=0"], "needs a prompt of 1 token"),
    (["++gate.thresholds.kl_mean.bucket=2k-8k"], "reaches only the buckets 0-128, 128-512"),
    (["++gate.thresholds.kl_mean.bucket=nearby"], "reaches only the buckets"),
    (["eval.max_windows=4"], "smaller than one look"),
    (["gate.statistical.look_windows=1"], "a look needs 2 windows"),
    (["gate.statistical.spending=linear"], "gate.statistical.spending='linear' is unknown"),
    (["++gate.thresholds.gen_exact_match.min=0.5", "++gate.thresholds.gen_exact_match.bucket=worst"],
     "generation metrics have no positions"),
])
def test_config_checks(overrides, message):
    base = [] if any(o.startswith("precision=") for o in overrides) else ["+precision=fp8"]
    cfg, _ = compose(base + overrides)
    with pytest.raises(QuantlabError, match=message):
        check_config(cfg)


def test_empty_gate_is_refused():
    cfg, _ = compose(["+precision=fp8"])
    cfg.gate.thresholds, cfg.gate.per_precision = {}, {}
    with pytest.raises(QuantlabError, match="the gate has no checks"):
        check_config(cfg)


def test_every_gateable_metric_has_a_direction_and_ideal_or_none():
    for name in GATEABLE:
        spec = METRICS[name]
        assert isinstance(spec.higher_is_better, bool)
        if spec.ideal is not None:
            assert spec.range[0] <= spec.ideal <= spec.range[1]


def test_engine_registry_facts():
    assert {e.runs for e in ENGINES.values()} == {"checkpoint", "calibrated", "model"}
    assert ENGINES["torch"].supports("FP8") and not ENGINES["torch"].supports("NOT_A_FORMAT")
    assert ENGINES["reference"].available() is None
