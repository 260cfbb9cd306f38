"""audit: the silent-failure audit of the checkpoint that would ship (quantlab.audit), run on every export, ours or
one made elsewhere (engine.checkpoint=), before any evaluation.

A step of the export stage (stop_after=export includes it), stored under audit/ and keyed by the checkpoint's and
the model's fingerprints, the canary's settings and the library versions: an unchanged checkpoint is audited once.
Its value is the AuditReport; a report with error findings is what the pipeline stops on (exit 1).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

from quantlab import costs
from quantlab.artifacts import write_json_atomic
from quantlab.env import versions
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")

REPORT = "audit.json"
CANARY = {"canary": True, "windows": 2, "tokens": 128}  # the logits canary's settings (part of the key)


@functools.cache
def audit_code() -> str:
    """A digest of the code that decides an audit (quantlab/audit/*.py and the formats' bounds in precisions.py): a
    verdict stored by other audit code is not reused (a fix of a false alarm must reach the cached runs too)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((root / "audit").glob("*.py")) + [root / "precisions.py"]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def step(ctx: RunContext) -> Step:
    """The audit of r.value("export") against the unquantized model r.value("prepare")."""
    from quantlab.audit import AUDIT_SCHEMA

    def prefix(r) -> str:
        """The evaluation's prefix, resolved for the model (quantlab.conventions): the canary reads what the gate
        reads."""
        token = r.value("data:eval").prefix
        return (token.token or "none") if token is not None else "auto"

    def key(r) -> str:
        canary = CANARY if prefix(r) in ("none", "auto") else {**CANARY, "prefix": prefix(r)}
        return ctx.store.key("audit", export=r.fingerprint("export"), model=r.fingerprint("prepare"), canary=canary,
                             device=ctx.device.arch, dtype=str(ctx.dtype), schema=AUDIT_SCHEMA, versions=versions(),
                             code=audit_code())

    def build(out: Path, r) -> dict:
        from quantlab.audit import audit

        report = audit(r.value("export").path, r.value("prepare"), canary=CANARY["canary"],
                       canary_windows=CANARY["windows"], canary_tokens=CANARY["tokens"], device=ctx.device,
                       dtype=ctx.dtype, prefix_token=prefix(r))
        write_json_atomic(out / REPORT, report.to_dict())
        counts = report.summary()
        log.info("audit: %s (%d error(s), %d warning(s)) in %.1f s", "PASS" if report.passed else "FAIL",
                 counts["error"], counts["warning"], report.timings.get("total", 0.0))
        return {"passed": report.passed, "summary": counts}

    def load(art, _r, _built):
        from quantlab.audit import AuditReport

        return AuditReport.from_dict(json.loads((art.path / REPORT).read_text(encoding="utf-8")))

    def work(r) -> dict:
        from quantlab import first_run, prior

        shape, params, _ = first_run.model(r)
        return costs.work(costs.device_label(ctx.device), "audit", params,
                          units=shape and prior.audit(shape, CANARY["windows"], CANARY["tokens"]))

    return Step("audit", "export", key, load, build, needs=("export", "prepare", "data:eval"), work=work,
                manifest=lambda r: {"model": r.fingerprint("prepare"), "export": r.fingerprint("export"),
                                    "versions": versions()},
                store_stage="audit", describe="checkpoint audit")
