"""One audit's shared state: its inputs (checkpoint, what each loader reads of it, declared quantization, tensors,
reference), the findings so far, and what one check hands another (the reference probe's activations and
norm -> Linear relation, norms a fold of AWQ scales explains, the 1-D tensors of each block).
Each family of checks is a module of functions over it (index, declarations, metadata, tokenizer, coverage, head,
scales, activations, weights, tensors, canary)."""
from __future__ import annotations

from pathlib import Path

from quantlab.audit.layout import Layout, _layout
from quantlab.audit.report import Finding, _natural
from quantlab.checkpoint import (
    QUANTIZED_DTYPES,
    CheckpointTensors,
    QuantConfig,
    read_headers,
    read_json_file,
    tensor_index,
)
from quantlab.errors import QuantlabError

SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "output_scale", "k_scale",
                  "v_scale")
KV_SUFFIXES = ("k_scale", "v_scale", "k_bias", "v_bias")


class AuditState:
    """One audit: the inputs, the findings so far, and the state checks share."""

    def __init__(self, ckpt: Path, quant: QuantConfig, config: dict, tensors: CheckpointTensors, ref, device, dtype,
                 views=None):
        self.ckpt, self.quant, self.config, self.t = ckpt, quant, config, tensors
        self.views = views  # index.LoaderViews: the files on disk and what each loader reads
        self.ref = ref  # ModelRef or None
        self.device, self.dtype = device, dtype
        self.ref_headers = read_headers(ref.path) if ref else None
        self.ref_index = tensor_index(ref.path) if ref else None
        self.layout = self._layout_of(ckpt)
        self.findings: list[Finding] = []
        self.layers: list[dict] = []
        self.activations: list[dict] = []
        self.canary: dict | None = None
        self.prefix_token = "auto"  # the canary's and probe's prefix (quantlab.conventions); resolved on first use
        self.prefix = None  # conventions.Prefix
        self.probe = None  # probe.ProbeResult: the reference forward's activations, norm -> Linear relation, logits
        self.skipped: list[str] = []
        self.folded: set[str] = set()  # 1-D tensors whose change a fold of AWQ scales explains
        self._vectors: dict[str, list] = {}  # block -> its 1-D tensors that differ from the reference
        self._like: dict[tuple, str | None] = {}  # (declared, tensor suffix, stored dtype) -> format the tensors fit
        self.declared = {m: quant.format_of(m) for m in self.layout.linears}
        self.stored = {m: self._stored_state(m) for m in self.layout.linears}

    def _layout_of(self, ckpt: Path) -> Layout:
        """The model's structure, built from the checkpoint's config.json (quantlab.audit.foreign: another source)."""
        return _layout(ckpt)

    def add(self, severity: str, check: str, modules, message: str, cause: str = "", *, consequence: str = "",
            fix: str = "") -> None:
        """Record a finding (modules sorted naturally, duplicates dropped): what is wrong, its likely cause, what a
        serving engine does with such a checkpoint and the fix."""
        self.findings.append(Finding(severity, check, sorted(set(modules), key=_natural), message, cause,
                                     consequence, fix))

    def _stored_state(self, module: str) -> str:
        dtype = self.t.dtype_of(f"{module}.weight")
        if dtype is None:
            return "missing"
        return "quantized" if dtype in QUANTIZED_DTYPES else "float"

    def ref_tensor(self, name: str):
        """The reference's tensor of that name, or None (no reference, or no such tensor)."""
        return self.ref_index[name].get_tensor(name) if self.ref_index and name in self.ref_index else None

    def quantized_modules(self) -> list[str]:
        """Linear modules declared quantized and stored with quantized codes."""
        return [m for m in self.layout.linears if self.declared[m] is not None and self.stored[m] == "quantized"]


def read_json(path: Path, what: str) -> dict | None:
    """A JSON object file, None when absent; a damaged one is a QuantlabError naming it."""
    if not path.is_file():
        return None
    doc = read_json_file(path, what)
    if not isinstance(doc, dict):
        raise QuantlabError(f"{what} {path} is not a JSON object", fix="re-export or re-save the checkpoint")
    return doc
