"""`python -m quantlab.audit CHECKPOINT_OR_RUN_DIR [--reference MODEL_DIR] [--no-canary] [--json OUT]`: the audit's
command line. Given a run directory (outputs/RUN), the checkpoint and its reference are read from the run's record.

Exit 0 without an error finding, 1 with one, 2 when the input cannot be audited at all, 130 when interrupted."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from quantlab.audit.checks import _reference, audit, open_checkpoint
from quantlab.errors import EXIT_GATE_FAILED, EXIT_OK, QuantlabError, cli_guard
from quantlab.rundir import RUN_JSON, read_record

log = logging.getLogger("quantlab")


def main(argv: list[str] | None = None) -> int:
    """`python -m quantlab.audit CHECKPOINT [--reference MODEL_DIR] [--no-canary] [--json OUT]`: exit 0 without an
    error finding, 1 with one, 2 when the input cannot be audited, 130 when interrupted."""
    parser = argparse.ArgumentParser(
        prog="python -m quantlab.audit",
        description="Catch broken quantized exports in seconds: coverage, scales, dequantized weights vs the "
                    "reference, dropped tensors, metadata and a short logits canary.")
    parser.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN_DIR",
                        help="an exported checkpoint directory (hf_quant_config.json + safetensors), or a quantlab run "
                             "directory (outputs/RUN: its checkpoint and reference are read from its run.json)")
    parser.add_argument("--reference", metavar="MODEL_DIR", help="the unquantized HF model the export was made from "
                                                                  "(default for a run directory: the run's own)")
    parser.add_argument("--no-canary", action="store_true", help="skip the logits canary (tensor checks only)")
    parser.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    parser.add_argument("--device", default="auto", help="device of the canary: auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--canary-windows", type=int, default=2, metavar="N", help="canary windows (default 2)")
    parser.add_argument("--canary-tokens", type=int, default=128, metavar="N", help="tokens per window (default 128)")
    parser.add_argument("--prefix-token", default="auto", choices=["auto", "bos", "eos", "none"],
                        help="the token before each canary window (default auto: what the model expects, from its "
                             "tokenizer, chat template or family)")
    parser.add_argument("--quiet", action="store_true", help="print errors and warnings only")
    args = parser.parse_args(argv)
    return cli_guard(_main, args, interrupted="\nquantlab audit: interrupted",
                     traceback_file="quantlab-audit-traceback.txt")


def _main(args) -> int:
    import warnings

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore")
    args.checkpoint, reference = resolve_target(args.checkpoint)
    if args.reference is None and reference is not None:
        args.reference = reference
        print(f"quantlab audit: checkpoint and reference from the run directory: {args.checkpoint}, {reference}")
    open_checkpoint(args.checkpoint)  # unusable input is refused before torch and transformers are imported
    if args.reference and not Path(args.reference).expanduser().exists():
        _reference(args.reference)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        hf_logging = None
    if hf_logging is not None:  # quiet while the audit runs; the caller's settings come back after (in-process use)
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    try:
        report = audit(args.checkpoint, args.reference, canary=not args.no_canary,
                       canary_windows=args.canary_windows, canary_tokens=args.canary_tokens, device=args.device,
                       prefix_token=args.prefix_token)
    finally:
        if hf_logging is not None:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
    if args.json:
        out = Path(args.json).expanduser()
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n", encoding="utf-8")
        except OSError as exc:
            raise QuantlabError(f"cannot write the report to {out}: {exc.strerror or exc}",
                                fix="pass --json a path in a writable directory") from None
    print(report.render(show_info=not args.quiet))
    return EXIT_GATE_FAILED if report.errors else EXIT_OK


def resolve_target(target: str) -> tuple[str, str | None]:
    """(checkpoint directory, reference directory or None) for a checkpoint or a quantlab run directory. A run
    directory without a checkpoint (it stopped before exporting, or exported nothing) is exit 2 with the fix."""
    path = Path(target).expanduser()
    record_path = path / RUN_JSON
    if (path / "hf_quant_config.json").is_file():  # a checkpoint; RUN/checkpoint: its run says the reference
        if path.name == "checkpoint" and (path.parent / RUN_JSON).is_file():
            record, _ = read_record(path.parent / RUN_JSON)
            reference = (((record or {}).get("artifacts") or {}).get("prepare") or {}).get("path")
            return target, reference if reference and Path(reference).is_dir() else None
        return target, None
    if not record_path.is_file():
        return target, None
    record, problem = read_record(record_path)
    artifacts = (record or {}).get("artifacts") or {}
    export = (artifacts.get("export") or {}).get("path")
    reference = (artifacts.get("prepare") or {}).get("path")
    link = path / "checkpoint"
    checkpoint = str(link.resolve()) if link.is_dir() else (export if export and Path(export).is_dir() else None)
    if checkpoint is None:
        why = (f"its run.json is {problem}" if problem else
               f"the run stopped before exporting ({_why_stopped(record)})" if record.get("exit_code") not in (0, 1)
               else "the run exported nothing (a reference or fake-quant run, or stop_after before export)")
        raise QuantlabError(f"{path} is a quantlab run directory without a checkpoint to audit: {why}",
                            fix="rerun it to export a checkpoint, or pass a checkpoint directory (hf_quant_config.json "
                                "+ safetensors) and --reference MODEL_DIR")
    if reference and not Path(reference).is_dir():
        log.warning("the run's reference %s is no longer there: auditing without it (pass --reference MODEL_DIR)",
                    reference)
        reference = None
    return checkpoint, reference


def _why_stopped(record: dict) -> str:
    error = str(record.get("error") or "").strip()
    code = record.get("exit_code")
    return (f"exit {code}: {error.splitlines()[0]}" if error else
            "no exit code: it is still running or was killed" if code is None else f"exit {code}")


if __name__ == "__main__":
    sys.exit(main())
