"""`python -m quantlab --help`: quantlab's own help, built from the registries, conf/ and the config schemas (so it
cannot drift from what the command accepts). `--help +precision=NAME` adds that precision's own keys. Hydra's help
stays available as `--hydra-help`."""
from __future__ import annotations

import dataclasses
import typing

from quantlab.compose import group_options
from quantlab.config import Config
from quantlab.engines.registry import ENGINES
from quantlab.precisions import PRECISIONS

HELP_FLAGS = ("--help", "-h")

# The keys a newcomer needs, with what they mean; the default is read from the schema at print time.
MAIN_KEYS = (
    ("model.path", "a local HF checkpoint (safetensors); unset: the embedded SmolLM2-135M"),
    ("model.device", "auto (cuda if present, else cpu) | cpu | cuda | cuda:N"),
    ("model.dtype", "auto: float32 on CPU, bfloat16 on GPU"),
    ("calib.num_samples", "calibration windows"),
    ("calib.seq_len", "tokens per calibration window"),
    ("calib.batch_size", "windows per calibration forward pass"),
    ("calib.path", "your calibration text (.txt .jsonl .csv .parquet); unset: Python's docs"),
    ("eval.path", "your evaluation text; unset: the held-out part of Python's docs"),
    ("eval.seq_len", "tokens per evaluation window"),
    ("eval.max_windows", "cap on evaluation windows (null: all); the gate often stops earlier"),
    ("eval.attribution", "split the loss into quantization / export / engine"),
    ("engine.checkpoint", "evaluate a checkpoint exported elsewhere instead of quantizing"),
    ("gate.thresholds.METRIC.max", "a release threshold (.min for higher-is-better metrics)"),
    ("gate.baseline", "an earlier run's metrics.json: fail on a significant regression"),
    ("gate.statistical.look_windows", "windows per look of the sequential test"),
    ("cache_dir", "artifact store; null: $QUANTLAB_CACHE or ~/.cache/quantlab"),
    ("stop_after", "prepare | data | quantize | export | build: end the run early"),
)

EXAMPLES = (
    ("python -m quantlab +precision=fp8", "the default model in FP8, gated against the unquantized model"),
    ("python -m quantlab +precision=int4_awq kv_cache=fp8", "INT4 AWQ weights and an FP8 KV cache"),
    ("python -m quantlab -m +precision=fp8,int8_sq", "a sweep; summary.md names the ship candidate"),
    ("python -m quantlab --plan -m +precision=fp8,int4_awq", "what a sweep would build and how long, nothing run"),
    ("python -m quantlab +precision=fp8 model.path=/models/llama", "any local HF checkpoint"),
    ("python -m quantlab.audit outputs/RUN", "audit the checkpoint of a run again"),
    ("python -m quantlab.summary outputs/sweep_*", "rebuild a sweep summary from its run directories"),
)

EXIT_CODES = (
    (0, "every run passed every gate: may ship"),
    (1, "a gate failed, the checkpoint audit found an error (nothing evaluated), or a search found nothing"),
    (2, "bad config or input: one paragraph naming the problem and the fix, nothing computed"),
    (3, "internal error (a bug): one line, the traceback in RUN_DIR/traceback.txt"),
    (130, "interrupted: finished artifacts are kept, rerun the same command to resume"),
)


def wants_help(args: list[str]) -> bool:
    """Whether the command line asks for quantlab's help."""
    return any(a in HELP_FLAGS for a in args)


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0].rstrip(".") if (doc or "").strip() else ""


def _default(path: str) -> str:
    """The schema default of a dotted key ("-" when it is not a plain field of the schemas; engine keys: the default
    engine's schema)."""
    from quantlab.engines.registry import ENGINE_SCHEMAS

    node: typing.Any = Config
    if path.startswith("engine."):
        node, path = ENGINE_SCHEMAS["torch"], path.removeprefix("engine.")
    value: typing.Any = None
    for part in path.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return "-"
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return "-"
        f = fields[part]
        hints = typing.get_type_hints(node)
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        node = hints[part]
        if typing.get_origin(node) is typing.Union:
            node = next(a for a in typing.get_args(node) if a is not type(None))
    if dataclasses.is_dataclass(value) or value == "???":
        return "-"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _groups() -> list[tuple[str, str, str]]:
    """(group, choices, what) for every config group."""
    precisions = (", ".join(n for n, p in PRECISIONS.items() if p.modelopt_cfg) + ", mixed (from +search), "
                  "external (engine.checkpoint= of another tool: implied)")
    engines = ", ".join(n for n, e in ENGINES.items() if e.public)
    return [
        ("+precision=", precisions, "required: the quantization format"),
        ("kv_cache=", ", ".join(group_options("kv_cache")), "KV cache format; default: none"),
        ("engine=", engines, "what runs the candidate; default: torch, on the exported checkpoint"),
        ("gate=", ", ".join(group_options("gate")), "release gate (or conf/gate/NAME.yaml of yours); default: default"),
        ("model=", ", ".join(group_options("model")), "default: smollm2_135m (embedded); local needs model.path"),
        ("calib_data@calib=", ", ".join(group_options("calib_data")),
         "calibration data recipe (calib_data@eval=: evaluation); default: pydoc"),
        ("+search=", ", ".join(group_options("search")), "the cheapest per-layer mix that passes the gate"),
    ]


def _precision_keys(name: str) -> list[str]:
    entry = PRECISIONS.get(name)
    lines = [f"Precision {name}: {_first_line(entry.schema.__doc__)}",
             f"  ModelOpt preset {entry.modelopt_cfg or '(none: made by +search)'}, exported as {entry.quant_algo}; "
             f"GPU kernels need: {entry.gpu_generation}"]
    fields = dataclasses.fields(entry.schema)
    if not fields:
        lines.append("  no keys of its own")
    for f in fields:
        default = "null" if f.default is None else f.default
        lines.append(f"  precision.{f.name:<20} default {default}")
    return lines


def text(args: list[str]) -> str:
    """The help text for this command line (with +precision=NAME: that precision's keys too)."""
    lines = ["quantlab: quantize a Hugging Face causal LM with NVIDIA ModelOpt, export it, audit the export, evaluate",
             "it against the unquantized model with paired sequential tests, and say whether it may ship.", "",
             "usage: python -m quantlab +precision=NAME [group=option ...] [key=value ...]",
             "       python -m quantlab -m +precision=A,B [...]      a sweep (one run per combination) and its summary",
             "       python -m quantlab --plan [-m] ...              what would be built or reused, how long; no run",
             "       python -m quantlab --help [+precision=NAME]     this help (with a precision: its own keys)",
             "", "Config groups (choose with group=option):"]
    width = max(len(g) for g, _, _ in _groups())
    for group, choices, what in _groups():
        lines.append(f"  {group:<{width}}  {choices}")
        lines.append(f"  {'':<{width}}  {what}")
    lines += ["", "Main keys (key=value; default from the schema):"]
    for key, what in MAIN_KEYS:
        lines.append(f"  {key:<30} {_default(key):<6} {what}")
    lines.append("  every key is checked: a typo fails at once with a suggestion; all keys: quantlab/config.py")
    chosen = [a.lstrip("+").split("=", 1)[1] for a in args if a.lstrip("+").startswith("precision=")]
    for value in chosen:
        for name in value.split(","):
            lines.append("")
            lines += (_precision_keys(name) if name in PRECISIONS
                      else [f"unknown precision {name!r}: choose one of {', '.join(PRECISIONS)}"])
    lines += ["", "Examples:"]
    lines += [f"  {cmd}\n      {what}" for cmd, what in EXAMPLES]
    lines += ["", "Exit codes (a sweep exits with the largest of its runs):"]
    lines += [f"  {code:<4} {what}" for code, what in EXIT_CODES]
    lines += ["", "Each run writes outputs/<time>_<precision>_kv-<kv>/: report.md, report.html, metrics.json,",
              "junit.xml, run.json and checkpoint (the export that would ship). Hydra's own options: --hydra-help;",
              "the composed config: --cfg job. Long steps report progress on stderr; libraries' output goes to the",
              "run's log file."]
    return "\n".join(lines)
