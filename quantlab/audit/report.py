"""What an audit reports: findings (severity, check, modules, message, likely cause, what a serving engine does with
such a checkpoint, the fix) and the AuditReport with per-check timings, per-layer weight and activation-scale
statistics and the canary's figures; module names abbreviated for messages."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from quantlab.errors import QuantlabError

AUDIT_SCHEMA = "quantlab.audit/2"
READABLE_SCHEMAS = ("quantlab.audit/1", AUDIT_SCHEMA)  # /1: no consequence, fix or activation rows
ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)
CHECKS = ("index", "declarations", "metadata", "tokenizer", "coverage", "head", "scales", "kv_cache", "activations",
          "format", "weights", "tensors", "canary")


@dataclass
class Finding:
    """One thing the audit found: how bad it is, which check found it, the modules (or tensors) concerned, what is
    wrong, what most likely caused it, what a serving engine (vLLM, SGLang, TensorRT-LLM, transformers) does with
    such a checkpoint, and how to fix it."""

    severity: str  # error | warning | info
    check: str  # one of CHECKS
    modules: list[str]
    message: str
    cause: str = ""
    consequence: str = ""  # what an engine loading this checkpoint does: loads the wrong tensor, fails, clips, ...
    fix: str = ""

    def to_dict(self) -> dict:
        """Plain JSON types."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        """The inverse of to_dict."""
        return cls(d["severity"], d["check"], list(d.get("modules") or []), d["message"], d.get("cause", ""),
                   d.get("consequence", ""), d.get("fix", ""))


@dataclass
class AuditReport:
    """What an audit found, with per-check timings, per-layer weight statistics and the canary's figures."""

    checkpoint: str
    reference: str | None
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    findings: list[Finding] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per check, and "total"
    layers: list[dict] = field(default_factory=list)  # module, format, cosine, sqnr_db, gain, fold
    activations: list[dict] = field(default_factory=list)  # module, kind, format, observed, covered, ratio
    canary: dict | None = None  # windows, tokens, positions, top1, kl_mean, kl_p99, nll ratio, bounds, seconds
    skipped: list[str] = field(default_factory=list)  # checks not run, with why
    cpu_timings: dict[str, float] = field(default_factory=dict)  # CPU seconds (all threads) per check, and "total"

    @property
    def errors(self) -> list[Finding]:
        """The error findings: any of them fails the audit (exit 1, the pipeline stops)."""
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        """The warning findings: worth a look, never a failure."""
        return [f for f in self.findings if f.severity == WARNING]

    @property
    def passed(self) -> bool:
        """No error finding."""
        return not self.errors

    def summary(self) -> dict[str, int]:
        """Number of findings per severity: {"error": n, "warning": n, "info": n}."""
        return {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}

    def find(self, check: str, severity: str | None = None) -> list[Finding]:
        """The findings of one check (and severity)."""
        return [f for f in self.findings if f.check == check and (severity is None or f.severity == severity)]

    def to_dict(self) -> dict:
        """The report as plain JSON types (audit.json, --json): schema, checkpoint, reference, quant_algo,
        kv_cache_quant_algo, passed, summary, findings, timings, layers, activations, canary, skipped,
        cpu_timings."""
        return {"schema": AUDIT_SCHEMA, "checkpoint": self.checkpoint, "reference": self.reference,
                "quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo,
                "passed": self.passed, "summary": self.summary(), "findings": [f.to_dict() for f in self.findings],
                "timings": self.timings, "layers": self.layers, "activations": self.activations,
                "canary": self.canary, "skipped": self.skipped, "cpu_timings": self.cpu_timings}

    @classmethod
    def from_dict(cls, d: dict) -> AuditReport:
        """The inverse of to_dict; a report of a schema version this one cannot read is refused (version 1, without
        consequences, fixes and activation rows, reads with those empty)."""
        if d.get("schema") not in READABLE_SCHEMAS:
            raise QuantlabError(f"audit report schema {d.get('schema')!r} is not {AUDIT_SCHEMA}",
                                fix="rerun the audit with this version of quantlab")
        return cls(d["checkpoint"], d.get("reference"), d.get("quant_algo"), d.get("kv_cache_quant_algo"),
                   [Finding.from_dict(f) for f in d.get("findings", [])], dict(d.get("timings", {})),
                   list(d.get("layers", [])), list(d.get("activations") or []), d.get("canary"),
                   list(d.get("skipped", [])), dict(d.get("cpu_timings") or {}))

    def render(self, show_info: bool = True) -> str:
        """Plain text for a terminal: findings grouped by severity, each with its modules and likely cause."""
        lines = [f"quantlab audit of {self.checkpoint}",
                 f"  format: {self.quant_algo}, kv cache: {self.kv_cache_quant_algo or 'not quantized'}; "
                 f"reference: {self.reference or 'none'}"]
        for severity in SEVERITIES:
            found = [f for f in self.findings if f.severity == severity]
            if not found or (severity == INFO and not show_info):
                continue
            lines.append(f"\n{severity.upper()}S ({len(found)})" if severity != INFO else f"\nINFO ({len(found)})")
            for f in found:
                lines.append(f"  [{f.check}] {f.message}")
                if f.modules:
                    lines.append(f"      modules: {abbreviate(f.modules)}")
                if f.cause:
                    lines.append(f"      likely cause: {f.cause}")
                if f.consequence:
                    lines.append(f"      in deployment: {f.consequence}")
                if f.fix:
                    lines.append(f"      fix: {f.fix}")
        for why in self.skipped:
            lines.append(f"  skipped: {why}")
        counts = self.summary()
        verdict = "FAIL" if counts[ERROR] else "PASS"
        lines.append(f"\nquantlab audit: {verdict}: {counts[ERROR]} error(s), {counts[WARNING]} warning(s), "
                     f"{counts[INFO]} info in {self.timings.get('total', 0.0):.1f} s")
        return "\n".join(lines)


def _natural(name: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _ranges(values: list[int]) -> str:
    values = sorted(set(values))
    spans, start = [], values[0]
    for prev, cur in zip(values, values[1:] + [None], strict=True):
        if cur is None or cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return spans[0] if len(spans) == 1 and "-" not in spans[0] else "{" + ",".join(spans) + "}"


def abbreviate(names: list[str], limit: int = 8) -> str:
    """Module names for a message: all of them when few, else one pattern per module class with the indices
    compressed (model.layers.{0-29}.mlp.down_proj (30))."""
    names = sorted(set(names), key=_natural)
    if len(names) <= limit:
        return ", ".join(names)
    groups: dict[tuple, list[list[int]]] = {}
    for name in names:
        parts = name.split(".")
        template = tuple("#" if p.isdigit() else p for p in parts)
        groups.setdefault(template, []).append([int(p) for p in parts if p.isdigit()])
    out = []
    for template, indices in groups.items():
        columns = iter(zip(*indices, strict=True)) if indices and indices[0] else iter(())
        parts = [_ranges(list(next(columns))) if p == "#" else p for p in template]
        text = ".".join(parts)
        out.append(f"{text} ({len(indices)})" if len(indices) > 1 else text)
    shown = out[:limit]
    return "; ".join(shown) + (f"; and {len(out) - limit} more module classes" if len(out) > limit else "")


def module_class(name: str) -> str:
    """The class of a module name: model.layers.3.mlp.experts.5.w1 -> model.layers.*.mlp.experts.*.w1."""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))
