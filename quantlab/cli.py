"""Command line: argv checks with "did you mean", then @hydra.main -> to_object -> run_pipeline.

Exit codes: 0 every run may ship, 1 a gate failed, 2 bad config or input, 3 internal error (a bug: the
traceback is written to the run directory). A sweep exits with the largest code of its runs.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import sys
import traceback
import typing
from pathlib import Path

from quantlab.artifacts import write_json_atomic
from quantlab.config import PRECISION_SCHEMAS, Config, calib_data_dir, conf_dir, register_configs
from quantlab.errors import EXIT_BAD_INPUT, QuantlabError

EXIT_INTERNAL = 3
LOCAL_LAUNCHERS = ("basic", "joblib", "submitit_local")  # jobs run on this machine
HYDRA_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")
STATUS = "status.json"
GROUPS = ("precision", "kv_cache", "engine", "gate", "model")
_outcomes: list[int] = []
log = logging.getLogger("quantlab")


def group_options(group: str) -> list[str]:
    if group == "calib_data":
        return sorted(p.stem for p in calib_data_dir().glob("*.yaml"))
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _fields(tp) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(tp)
    return {f.name: hints[f.name] for f in dataclasses.fields(tp)}


def _dict_keys(path: list[str]) -> list[str] | None:
    """Allowed keys of the dict-valued node at path (None: free-form)."""
    from quantlab.metrics import REGISTRY

    metric_names = [m for m, info in REGISTRY.items() if info.gateable]
    if path == ["gate", "thresholds"] or (len(path) == 3 and path[:2] == ["gate", "per_precision"]):
        return metric_names
    if path == ["gate", "per_precision"]:
        return list(PRECISION_SCHEMAS)
    return None


def _check_key(path: list[str], full: str) -> None:
    """Walk the dataclass schema along path; raise with the closest sibling name on a miss."""
    node: typing.Any = Config
    for depth, part in enumerate(path):
        origin = typing.get_origin(node)
        if origin is typing.Union:  # Optional[X]
            node = next(a for a in typing.get_args(node) if a is not type(None))
            origin = typing.get_origin(node)
        if origin in (dict, typing.Dict):
            allowed = _dict_keys(path[:depth])
            if allowed is not None and part not in allowed:
                raise QuantlabError(f"unknown name {part!r} in {full!r}{_did_you_mean(part, allowed)}",
                                    fix=f"valid names there: {', '.join(allowed)}")
            node = typing.get_args(node)[1]
            continue
        if node is typing.Any and path[depth - 1] == "precision":
            fields: dict = {}
            for schema in PRECISION_SCHEMAS.values():
                fields.update(_fields(schema))
        elif dataclasses.is_dataclass(node):
            fields = _fields(node)
        else:
            return  # a leaf value or free-form node
        if part not in fields:
            where = ".".join(path[:depth]) or "the top level"
            raise QuantlabError(f"unknown config key {full!r}: {where} has no {part!r}{_did_you_mean(part, fields)}",
                                fix=f"valid keys there: {', '.join(sorted(fields))}")
        node = fields[part]


def check_argv(args: list[str]) -> list[str]:
    """Validate overrides before Hydra composes; returns argv with `precision=X` spelled `+precision=X`."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:  # noqa: BLE001 - let Hydra report syntax errors in its own words
        return args
    out = list(args)
    for ov in parsed:
        key = ov.key_or_group
        if key.startswith("hydra") or ov.is_delete():
            continue
        group = key.split("@")[0]
        if group in GROUPS or group == "calib_data":
            values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [str(ov.value())]
            options = group_options(group)
            for value in values:
                if value not in options:
                    raise QuantlabError(f"unknown {group} {value!r}{_did_you_mean(value, options)}",
                                        fix=f"choose one of: {', '.join(options)}")
            if group == "precision" and not ov.is_add():
                out[out.index(ov.input_line)] = "+" + ov.input_line
            continue
        _check_key(key.split("."), key)
        if key.startswith(("gate.thresholds.", "gate.per_precision.")) and not ov.is_add() and not ov.is_force_add():
            out[out.index(ov.input_line)] = "++" + ov.input_line  # add or override a dict entry
    return out


def check_output_dir(args: list[str]) -> None:
    """The run / sweep directory must be creatable; otherwise Hydra fails with a traceback wall."""
    import os

    multirun = "-m" in args or "--multirun" in args
    key = "hydra.sweep.dir=" if multirun else "hydra.run.dir="
    target = next((a.split("=", 1)[1] for a in args if a.lstrip("+").startswith(key)), "outputs")
    static = Path(target.split("${")[0] or ".").expanduser()
    probe = static if static.is_absolute() else Path.cwd() / static
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise QuantlabError(f"the output directory {target} cannot be created: {probe} is not a writable directory",
                            fix="run from a writable directory, or set hydra.run.dir=/a/writable/path "
                                "(hydra.sweep.dir for sweeps)")


def _task(dict_cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from quantlab.pipeline import run_pipeline

    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    error = None
    try:
        cfg = OmegaConf.to_object(dict_cfg)
        code = run_pipeline(cfg, run_dir, OmegaConf.to_container(dict_cfg, resolve=True), sys.argv[1:])
    except QuantlabError as exc:
        print(f"\nquantlab: error: {exc}", file=sys.stderr)
        code, error = exc.exit_code, str(exc)
    except Exception as exc:  # noqa: BLE001 - a bug: keep the traceback, show one paragraph
        trace = run_dir / "traceback.txt"
        trace.write_text(traceback.format_exc())
        print(f"\nquantlab: internal error: {type(exc).__name__}: {exc}\n  traceback: {trace}", file=sys.stderr)
        code, error = EXIT_INTERNAL, f"{type(exc).__name__}: {exc}"
    # Launchers may run this in another process: the exit code also travels through the run directory.
    write_json_atomic(run_dir / STATUS, {"exit_code": code, "error": error})
    _outcomes.append(code)


def main(argv: list[str] | None = None) -> int:
    import hydra

    args = list(sys.argv[1:] if argv is None else argv)
    plan_only = "--plan" in args
    args = [a for a in args if a != "--plan"]
    try:
        args = check_argv(args)
        if not plan_only:
            check_output_dir(args)
    except QuantlabError as exc:
        print(f"quantlab: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    launcher = next((a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("hydra/launcher=")), "basic")
    if plan_only or (("-m" in args or "--multirun" in args) and not any(a in HYDRA_FLAGS for a in args)):
        from quantlab.plan import print_plan

        if not plan_only and launcher not in LOCAL_LAUNCHERS:
            # the cache state and the times depend on the device: this machine may not be like the jobs' nodes
            print(f"quantlab plan: not printed, the jobs run elsewhere (hydra/launcher={launcher}); "
                  "run the same command with --plan on a node like theirs")
        else:
            code = print_plan(args, strict=plan_only)
            if plan_only:
                return code
    sys.argv = [sys.argv[0]] + args
    register_configs()
    _outcomes.clear()
    try:
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_task)()
    except SystemExit as exc:
        if exc.code not in (0, None) and not _outcomes:
            return EXIT_BAD_INPUT  # Hydra rejected the config before any run started (message already printed)
        if exc.code not in (0, None):
            return max(_outcomes + [EXIT_INTERNAL])
    return max(_outcomes, default=0)
