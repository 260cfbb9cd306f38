"""Command line: --help (quantlab.help), argv checks with "did you mean", then @hydra.main -> to_object ->
api.execute.

Exit codes: 0 every run may ship, 1 a gate failed, 2 bad config or input, 3 internal error (a bug: the
traceback is written to the run directory), 130 interrupted, 143 terminated (SIGTERM while a started server
lived: engine=served). A sweep exits with the largest code of its runs,
read from each job's status.json after Hydra returns (jobs may run in other processes).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
import traceback
import typing
from pathlib import Path

from quantlab.artifacts import write_json_atomic
from quantlab.compose import group_options, normalize, register_configs
from quantlab.config import Config, conf_dir
from quantlab.engines.registry import ENGINE_SCHEMAS
from quantlab.errors import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED, QuantlabError
from quantlab.gate.metrics import GATEABLE
from quantlab.precisions import PRECISION_SCHEMAS
from quantlab.registry import did_you_mean
from quantlab.report.sweep import exit_codes
from quantlab.rundir import STATUS, RunDirBusy

LOCAL_LAUNCHERS = ("basic", "joblib", "submitit_local")  # jobs run on this machine
HYDRA_FLAGS = ("--cfg", "-c", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")  # --help is quantlab's
GROUPS = ("precision", "kv_cache", "engine", "gate", "model", "search")
log = logging.getLogger("quantlab")


def _fields(tp) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(tp)
    return {f.name: hints[f.name] for f in dataclasses.fields(tp)}


class _Choices:
    """The group options this command line selects (several in a sweep)."""

    def __init__(self, chosen: dict[str, list[str]]):
        self.precision = chosen.get("precision", [])
        self.engine = chosen.get("engine", ["torch"])


def _dict_keys(path: list[str]) -> list[str] | None:
    """Allowed keys of the dict-valued node at path (None: free-form)."""
    if path == ["gate", "thresholds"] or (len(path) == 3 and path[:2] == ["gate", "per_precision"]):
        return GATEABLE
    if path == ["gate", "per_precision"]:
        return list(PRECISION_SCHEMAS)
    return None


def _group_node(group: str, options: list[str], part: str, full: str) -> typing.Any:
    """The schema of `group` for a key below it: every chosen option must have the key."""
    schemas = PRECISION_SCHEMAS if group == "precision" else ENGINE_SCHEMAS
    for option in options:
        fields = _fields(schemas[option])
        if part not in fields:
            having = [name for name, schema in schemas.items() if part in _fields(schema)]
            if having:
                raise QuantlabError(f"{full} does not apply to {group}={option}: only {', '.join(having)} "
                                    f"{'has' if len(having) == 1 else 'have'} {part!r}",
                                    fix=f"drop {full} for {option}" + (" (block_size=auto, the default, picks one "
                                                                        "per model)" if part == "block_size" else ""))
            raise QuantlabError(f"unknown config key {full!r}: {group}={option} has no {part!r}"
                                f"{did_you_mean(part, fields)}",
                                fix=f"valid keys there: {', '.join(sorted(fields)) or '(none)'}")
    return _fields(schemas[options[0]])[part] if options else typing.Any


def _check_key(path: list[str], full: str, choices: _Choices) -> None:
    """Walk the schema along path; raise with the closest sibling name on a miss."""
    node: typing.Any = Config
    for depth, part in enumerate(path):
        origin = typing.get_origin(node)
        if origin is typing.Union:  # Optional[X]
            node = next(a for a in typing.get_args(node) if a is not type(None))
            origin = typing.get_origin(node)
        if origin in (dict, typing.Dict):
            allowed = _dict_keys(path[:depth])
            if allowed is not None and part not in allowed:
                raise QuantlabError(f"unknown name {part!r} in {full!r}{did_you_mean(part, allowed)}",
                                    fix=f"valid names there: {', '.join(allowed)}")
            node = typing.get_args(node)[1]
            continue
        if depth == 1 and path[0] in ("precision", "engine"):
            node = _group_node(path[0], getattr(choices, path[0]), part, full)
            continue
        if not dataclasses.is_dataclass(node):
            return  # a leaf value or free-form node
        fields = _fields(node)
        if part not in fields:
            where = ".".join(path[:depth]) or "the top level"
            raise QuantlabError(f"unknown config key {full!r}: {where} has no {part!r}{did_you_mean(part, fields)}",
                                fix=f"valid keys there: {', '.join(sorted(fields))}")
        node = fields[part]


def check_argv(args: list[str]) -> list[str]:
    """Validate overrides before Hydra composes; returns them normalized (quantlab.compose.normalize)."""
    from quantlab.compose import implied

    args = normalize(args)
    args = args + implied([a for a in args if not a.startswith("-")])
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:  # noqa: BLE001 - let Hydra report syntax errors in its own words
        return args
    chosen: dict[str, list[str]] = {}
    keyed = []
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
                    raise QuantlabError(f"unknown {group} {value!r}{did_you_mean(value, options)}",
                                        fix=f"choose one of: {', '.join(options)}")
            chosen[group] = values
            continue
        keyed.append(ov)
    if "precision" not in chosen:
        raise QuantlabError("no precision chosen", fix=f"add +precision=fp8 (or one of {', '.join(PRECISION_SCHEMAS)})")
    choices = _Choices(chosen)
    optional = {f.name for f in dataclasses.fields(Config) if f.default is None and f.name in GROUPS}
    for ov in keyed:
        key = ov.key_or_group
        top = key.split(".")[0]
        if top in optional and top not in chosen:  # a key of an optional group nobody chose: Hydra has no node
            options = group_options(top)
            raise QuantlabError(f"{key} sets an option of +{top}, which this command does not choose",
                                fix=f"add +{top}={options[0]} (choices: {', '.join(options)}), or drop {key}")
        _check_key(key.split("."), key, choices)
    return args


def check_output_dir(args: list[str], multirun: bool | None = None) -> None:
    """The run / sweep directory must be creatable (otherwise Hydra fails with a traceback wall), and a fixed run
    directory free (check_run_dir_free)."""
    if multirun is None:
        multirun = "-m" in args or "--multirun" in args
    if not multirun:
        check_run_dir_free(args)
    key = "hydra.sweep.dir=" if multirun else "hydra.run.dir="
    target = next((a.split("=", 1)[1] for a in args if a.lstrip("+").startswith(key)), "outputs")
    if not target.strip():
        raise QuantlabError(f"{key[:-1]} is empty", fix=f"give {key[:-1]} a directory, or leave it out")
    static = Path(target.split("${")[0] or ".").expanduser()
    probe = static if static.is_absolute() else Path.cwd() / static
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise QuantlabError(f"the output directory {target} cannot be created: {probe} is not a writable directory",
                            fix="run from a writable directory, or set hydra.run.dir=/a/writable/path "
                                "(hydra.sweep.dir for sweeps)")


def check_run_dir_free(args: list[str]) -> None:
    """A fixed hydra.run.dir that another run holds is refused before Hydra writes its .hydra/ files and log there
    (quantlab.rundir.claim is the authoritative check, made again when the run starts)."""
    given = next((a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("hydra.run.dir=")), None)
    if not given or "${" in given:
        return
    from filelock import FileLock, Timeout

    from quantlab.rundir import LOCK, claim

    lock_path = Path(given).expanduser() / LOCK
    if not lock_path.exists():
        return
    probe = FileLock(str(lock_path))
    try:
        probe.acquire(timeout=0)
    except Timeout:
        with claim(Path(given).expanduser()):  # raises RunDirBusy naming the holder
            pass
    else:
        probe.release()


def check_config_first(args: list[str]) -> None:
    """A single run's pure config checks (quantlab.preflight.check_config), made before Hydra creates the run
    directory or writes its .hydra/ files and log there: a refused run leaves no directory named like a run, and a
    refused rerun into a static hydra.run.dir changes nothing of the run that is there. A config that does not
    compose is left to Hydra, which says why before it writes anything. Searches check their own config."""
    task = [a for a in args if not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]
    if any(a.lstrip("+").startswith("search=") for a in task):
        return
    from quantlab import preflight
    from quantlab.compose import compose

    try:
        cfg, _ = compose(task)
    except QuantlabError as exc:
        if "does not compose" in str(exc):
            return
        raise
    preflight.check_config(cfg)


def _refused_dir(run_dir: Path) -> Path:
    """A run refused after Hydra made its default (timestamped) directory: the directory is renamed with a
    "_refused" suffix, so that nothing named like a run holds a run that never ran; its run.json and log say why.
    A directory the user named (hydra.run.dir=...) or a sweep's job directory keeps its name."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    given = any(o.lstrip("+").startswith("hydra.run.dir=") for o in hc.overrides.hydra)
    if given or hc.mode.name == "MULTIRUN" or not run_dir.is_dir():
        return run_dir
    target = run_dir.with_name(run_dir.name + "_refused")
    try:
        run_dir.rename(target)
    except OSError:
        return run_dir
    print(f"quantlab: the refused run's log and run.json: {target}", file=sys.stderr)
    return target


def _pin_sweep_dir(args: list[str]) -> tuple[list[str], Path]:
    """Fix the sweep directory before Hydra launches, so that the exit codes of its jobs can be read back."""
    given = next((a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("hydra.sweep.dir=")), None)
    sweep = given if given and "${" not in given else time.strftime("outputs/sweep_%Y-%m-%d_%H-%M-%S")
    if given and "${" in given:
        import hydra.core.utils  # noqa: F401 - registers the ${now:} resolver
        from omegaconf import OmegaConf

        sweep = OmegaConf.create({"d": given}).d
    args = [a for a in args if not a.lstrip("+").startswith("hydra.sweep.dir=")] + [f"hydra.sweep.dir={sweep}"]
    return args, Path(sweep)


_outcomes: list[int] = []  # exit codes of jobs run in this process


def _task(dict_cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from quantlab.api import execute

    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    error = None
    try:
        cfg = OmegaConf.to_object(dict_cfg)
        snapshot = OmegaConf.to_container(dict_cfg, resolve=True)
        code = execute(cfg, run_dir, snapshot, sys.argv[1:]).exit_code
    except RunDirBusy as exc:  # the directory is another run's: write nothing there
        print(f"\nquantlab: error: {exc}", file=sys.stderr)
        _outcomes.append(exc.exit_code)
        return
    except QuantlabError as exc:
        print(f"\nquantlab: error: {exc}", file=sys.stderr)
        code, error = exc.exit_code, str(exc)
        if code == EXIT_BAD_INPUT:
            run_dir = _refused_dir(run_dir)
    except KeyboardInterrupt:
        print("\nquantlab: interrupted; finished artifacts are kept, rerun the same command to resume", file=sys.stderr)
        code, error = EXIT_INTERRUPTED, "interrupted"
    except SystemExit as exc:
        if exc.code != EXIT_TERMINATED:
            raise
        print("\nquantlab: terminated (SIGTERM); the server it started is stopped, finished artifacts are kept, rerun "
              "the same command to resume", file=sys.stderr)
        code, error = EXIT_TERMINATED, "terminated"
    except Exception as exc:  # noqa: BLE001 - a bug: keep the traceback, show one paragraph
        trace = run_dir / "traceback.txt"
        trace.write_text(traceback.format_exc())
        print(f"\nquantlab: internal error: {type(exc).__name__}: {exc}\n  traceback: {trace}", file=sys.stderr)
        code, error = EXIT_INTERNAL, f"{type(exc).__name__}: {exc}"
    # Launchers may run this in another process: the exit code also travels through the run directory.
    write_json_atomic(run_dir / STATUS, {"exit_code": code, "error": error})
    _outcomes.append(code)
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    """The command line: exit 0 may ship, 1 a gate failed, 2 bad input, 3 a bug, 130 interrupted, 143 terminated."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("\nquantlab: interrupted; finished artifacts are kept, rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED


def _checked_before_hydra(args: list[str], plan_only: bool, multirun: bool) -> list[str]:
    """What can be refused before Hydra makes a run directory: the overrides' syntax, the output directory, and
    (one run) the composed config's values (preflight.check_config). Raises QuantlabError."""
    hydra_flag = any(a in HYDRA_FLAGS for a in args)
    if not hydra_flag:
        args = check_argv(args)
    if not plan_only:
        check_output_dir(args, multirun)
        if not multirun and not hydra_flag:
            check_config_first(args)
    return args


def _main(args: list[str]) -> int:
    import hydra

    from quantlab import help as quantlab_help

    if quantlab_help.wants_help(args):  # before Hydra, whose --help needs a composable config
        print(quantlab_help.text(args))
        return 0
    plan_only = "--plan" in args
    args = [a for a in args if a != "--plan"]
    multirun = ("-m" in args or "--multirun" in args) and not any(a in HYDRA_FLAGS for a in args)
    try:
        args = _checked_before_hydra(args, plan_only, multirun)
    except QuantlabError as exc:
        print(f"quantlab: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if plan_only and any(a.lstrip("+").startswith("search=") for a in args):
        print("quantlab: error: --plan prices declared runs; a search chooses its candidates from its own evaluations "
              "-- run it (every export and evaluation is cached, so a rerun costs nothing)", file=sys.stderr)
        return EXIT_BAD_INPUT
    launcher = next((a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("hydra/launcher=")), "basic")
    if plan_only or multirun:
        from quantlab.plan import print_plan

        if not plan_only and launcher not in LOCAL_LAUNCHERS:
            # the cache state and the times depend on the device: this machine may not be like the jobs' nodes
            print(f"quantlab plan: not printed, the jobs run elsewhere (hydra/launcher={launcher}); "
                  "run the same command with --plan on a node like theirs")
        else:
            code = print_plan(args, strict=plan_only)
            if plan_only:
                return code
    sweep_dir = None
    if multirun:
        args, sweep_dir = _pin_sweep_dir(args)
    sys.argv = [sys.argv[0]] + args
    register_configs()
    _outcomes.clear()
    try:
        hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_task)()
    except SystemExit as exc:
        if exc.code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            return exc.code
        if exc.code not in (0, None):
            if not _outcomes and not (sweep_dir and sweep_dir.is_dir() and exit_codes(sweep_dir)):
                return EXIT_BAD_INPUT  # Hydra rejected the config before any run started (message already printed)
            return max(_outcomes + (exit_codes(sweep_dir) if sweep_dir and sweep_dir.is_dir() else [])
                       + [EXIT_INTERNAL])
    codes = list(_outcomes)
    if sweep_dir is not None and sweep_dir.is_dir():
        codes += exit_codes(sweep_dir)
    return max(codes, default=0)
