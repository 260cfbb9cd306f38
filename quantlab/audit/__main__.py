"""`python -m quantlab.audit CHECKPOINT [--reference MODEL_DIR] [--no-canary] [--json OUT]`: the audit's command line.

Exit 0 without an error finding, 1 with one, 2 when the input cannot be audited at all, 130 when interrupted."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from quantlab.audit.checks import _reference, audit, open_checkpoint
from quantlab.errors import EXIT_GATE_FAILED, EXIT_OK, QuantlabError, cli_guard


def main(argv: list[str] | None = None) -> int:
    """`python -m quantlab.audit CHECKPOINT [--reference MODEL_DIR] [--no-canary] [--json OUT]`: exit 0 without an
    error finding, 1 with one, 2 when the input cannot be audited, 130 when interrupted."""
    parser = argparse.ArgumentParser(
        prog="python -m quantlab.audit",
        description="Catch broken quantized exports in seconds: coverage, scales, dequantized weights vs the "
                    "reference, dropped tensors, metadata and a short logits canary.")
    parser.add_argument("checkpoint", help="the exported checkpoint directory (hf_quant_config.json + safetensors)")
    parser.add_argument("--reference", metavar="MODEL_DIR", help="the unquantized HF model the export was made from")
    parser.add_argument("--no-canary", action="store_true", help="skip the logits canary (tensor checks only)")
    parser.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    parser.add_argument("--device", default="auto", help="device of the canary: auto (default), cpu, cuda, cuda:N")
    parser.add_argument("--canary-windows", type=int, default=2, metavar="N", help="canary windows (default 2)")
    parser.add_argument("--canary-tokens", type=int, default=128, metavar="N", help="tokens per window (default 128)")
    parser.add_argument("--quiet", action="store_true", help="print errors and warnings only")
    args = parser.parse_args(argv)
    return cli_guard(_main, args, interrupted="\nquantlab audit: interrupted",
                     traceback_file="quantlab-audit-traceback.txt")


def _main(args) -> int:
    import warnings

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore")
    open_checkpoint(args.checkpoint)  # unusable input is refused before torch and transformers are imported
    if args.reference and not Path(args.reference).expanduser().exists():
        _reference(args.reference)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    report = audit(args.checkpoint, args.reference, canary=not args.no_canary, canary_windows=args.canary_windows,
                   canary_tokens=args.canary_tokens, device=args.device)
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


if __name__ == "__main__":
    sys.exit(main())
