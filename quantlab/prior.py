"""A-priori build times: what a step costs on this machine before any build of it exists here, from the model's
shape (layers, hidden, MLP width, heads, vocabulary, parameters), the tokens it processes, and this machine's
speed measured once (a matrix multiply, a vocabulary-wide elementwise pass, a kernel launch, a file hash).

    seconds = fixed + flops / (matmul rate x efficiency) + vocabulary elements / elementwise rate
              + forward batches x layers x launches per layer x launch time + bytes / file rate

The efficiencies and fixed costs per stage and device type (`COEFFICIENTS`) were fitted once to measured builds:
the default model and Gemma-3-270M on this project's 2-core CPU, an 8B-shaped model on an H100
(bench/RESULTS.md, "The plan from the model's size"). Once a build of a step exists on this machine, quantlab.costs
predicts from it instead (scaled by these same work units), so the a-priori figure is only ever a first estimate.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

log = logging.getLogger("quantlab")

SPEED_FILE = "machine_speed.json"
SPEED_VERSION = 1


# --------------------------------------------------------------------------------------------- the model's shape
@dataclass(frozen=True)
class Shape:
    """What a forward pass costs per token depends on: the decoder's shape and its parameter count."""
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int

    @classmethod
    def of(cls, config: dict | None, params: int | None) -> Shape | None:
        """The shape from a transformers config (its text_config for multimodal wrappers); None when it says too
        little. An MoE counts its active experts' MLP width."""
        text = (config or {}).get("text_config") if isinstance((config or {}).get("text_config"), dict) else config
        text = text or {}
        get = text.get
        hidden, layers, heads, vocab = get("hidden_size"), get("num_hidden_layers"), get("num_attention_heads"), \
            get("vocab_size")
        if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, heads, vocab)):
            return None
        inter = get("moe_intermediate_size") or get("intermediate_size") or 4 * hidden
        experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts")
        active = get("num_experts_per_tok") if (get("moe_intermediate_size") or experts) else None
        inter = inter * (active or 1) + (get("shared_expert_intermediate_size") or 0)
        head_dim = get("head_dim") or hidden // heads
        kv = get("num_key_value_heads") or heads
        return cls(layers, hidden, int(inter), heads, kv, int(head_dim), vocab, int(params or 0))

    def _layer_weights(self) -> int:
        """Weights of one decoder layer's linear layers: q, o, k, v; gate, up, down."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads) + 3 * self.hidden * self.inter

    def body_macs(self, seq_len: int) -> float:
        """Multiply-adds per token of the decoder layers over a causal window of seq_len (attention over half of it
        on average), without the head."""
        attention = 2 * self.heads * self.head_dim * (seq_len / 2)
        return self.layers * (self._layer_weights() + attention)

    def linear_params(self) -> float:
        """Weights of the decoder's linear layers (what a precision quantizes; the embedding and head stay)."""
        return float(self.layers * self._layer_weights())

    def head_macs(self) -> float:
        """Multiply-adds per token of the output head."""
        return float(self.hidden * self.vocab)


# ------------------------------------------------------------------------------------------- this machine's speed
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device, repeats: int = 3) -> float:
    fn()
    _sync(device)
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return min(out)


def measure(device, dtype) -> dict:
    """This machine's speed in the model's dtype (about 0.5 s on a 2-core CPU): GEMM rate at a decoder's shape,
    a log-softmax over a vocabulary-wide row, one small kernel's launch, and hashing a file. device: a
    quantlab.env.Device."""
    import hashlib

    import torch

    device = torch.device(device.torch)

    m, k, n = (512, 1024, 2048) if device.type == "cpu" else (4096, 4096, 8192)
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    gemm = _best(lambda: a @ b, device, repeats=8)  # the best of 8 (~0.1 s on a 2-core CPU): of 3, 12% apart
    rows = torch.randn(64 if device.type == "cpu" else 1024, 65536, device=device, dtype=torch.float32)
    soft = _best(lambda: torch.log_softmax(rows, -1), device, repeats=5)
    x = torch.zeros(16, device=device, dtype=dtype)

    def launches():
        for _ in range(200):
            x.add_(1)
    launch = _best(launches, device, repeats=10) / 200  # of 3: 6.9 and 9.7 us on one H100 host
    blob = os.urandom(8 << 20)
    hashed = _best(lambda: hashlib.sha256(blob).digest(), torch.device("cpu"))
    elements = rows.numel()
    a = b = rows = x = None  # noqa: F841 - released before the run allocates
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the run's memory is its own
    return {"matmul_flops": 2 * m * k * n / gemm, "elementwise_per_s": elements / soft, "launch_s": launch,
            "hash_bytes_per_s": len(blob) / hashed}


_measured: dict[str, dict] = {}  # this process's measurements
FIELDS = ("matmul_flops", "elementwise_per_s", "launch_s", "hash_bytes_per_s")


def _valid(entry) -> bool:
    """A machine_speed.json entry quantlab can price with: the four figures, finite and positive."""
    import math

    return isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) and math.isfinite(entry[k])
                                           and entry[k] > 0 for k in FIELDS)


def _fastest(a: dict, b: dict) -> dict:
    """The faster of two measurements, field by field (a busy machine measures slow: the plan predicts an idle one)."""
    return {k: (max if k != "launch_s" else min)(a.get(k, b[k]), b[k]) for k in b}


def speed(root: Path | None, device, dtype, machine: str) -> dict | None:
    """This machine's speed for device and dtype: measured once per process and kept in the cache root
    (machine_speed.json) as the fastest seen, since a machine measured while busy reads slow; None when it cannot be
    measured. machine: the cost records' names of this machine and device (quantlab.costs.machine_id, device_label)."""
    import torch

    threads = torch.get_num_threads() if device.type == "cpu" else device.index
    key = f"{machine}|{dtype}|{os.cpu_count()}x{threads}|v{SPEED_VERSION}"
    path = Path(root) / SPEED_FILE if root else None
    known = {}
    if path is not None and path.is_file():
        try:
            known = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = {}
    known = {k: v for k, v in known.items() if _valid(v)} if isinstance(known, dict) else {}
    if key in _measured:
        return _fastest(known[key], _measured[key]) if key in known else _measured[key]
    try:
        _measured[key] = measure(device, dtype)
    except Exception as exc:  # noqa: BLE001 - the speed is advice for a plan; never fail a run over it
        log.debug("machine speed not measured: %s", exc)
        return known.get(key)
    value = _fastest(known[key], _measured[key]) if key in known else _measured[key]
    if path is not None and value != known.get(key):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**known, key: value}, indent=1), encoding="utf-8")
            tmp.replace(path)
        except OSError:
            pass
    return value


# ------------------------------------------------------------------------------------------------ the work units
@dataclass
class Units:
    """What one build does, in units whose cost the machine's speed gives: matmul FLOPs (qflops: those of the
    decoder's quantized linear layers, which the precision's engine or fake-quant slows down; flops: the rest, the
    head's included), vocabulary-wide elementwise values, kernel launches, bytes hashed or written, and searches:
    AWQ's candidate scales tried on one quantized linear layer for one calibration batch (each a fake-quantization
    of the layer's weight and a forward through it, driven from Python: priced in launch times, it bounds a large
    model's search on a GPU where the few calibration tokens' matmuls do not)."""
    flops: float = 0.0
    elements: float = 0.0
    launches: float = 0.0
    bytes: float = 0.0
    qflops: float = 0.0
    searches: float = 0.0

    def to_dict(self) -> dict:
        """For a work() record."""
        return {k: round(v, 1) for k, v in asdict(self).items() if v}


LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down: the layers AWQ searches a scale for
LAUNCHES_PER_LAYER = 24  # kernels of one decoder layer's forward in eager mode (norms, projections, rotary, SDPA)


def forward(shape: Shape, tokens: float, seq_len: int, batch: int, head: bool = True, passes: float = 1.0,
            quantized: bool = False) -> Units:
    """passes forward passes over tokens in windows of seq_len, batch windows at a time (the head computed when
    head is set: its logits, and the vocabulary-wide log-softmax over them); quantized: the decoder's layers are
    the quantized model's (qflops)."""
    body = 2 * shape.body_macs(seq_len) * tokens * passes
    head_flops = 2 * shape.head_macs() * tokens * passes if head else 0.0
    batches = tokens / max(1, seq_len * batch)
    return Units(flops=head_flops + (0.0 if quantized else body), qflops=body if quantized else 0.0,
                 elements=(shape.vocab * tokens * passes) if head else 0.0,
                 launches=batches * shape.layers * LAUNCHES_PER_LAYER * passes)


# Per stage and device type: fixed seconds and the multipliers of each unit's time at the measured speed
# (1.0: as fast as the microbenchmark). Fitted to the builds in this module's docstring; see bench/RESULTS.md.
COEFFICIENTS = {
    "cpu": {
        "data": {"fixed": 0.2, "flops": 0.0, "elements": 0.0, "launches": 0.0, "bytes": 1600.0},
        "prepare": {"fixed": 4.0, "flops": 0.0, "elements": 0.0, "launches": 0.0, "bytes": 400.0},
        "quantize": {"fixed": 3.0, "flops": 1.23, "elements": 1.0, "launches": 1.0, "bytes": 1.0,
                     "searches": 2300.0},
        "export": {"fixed": 0.5, "flops": 1.0, "elements": 1.0, "launches": 1.0, "bytes": 1.0},
        "audit": {"fixed": 2.0, "flops": 1.6, "elements": 2.0, "launches": 1.0, "bytes": 1.0},
        "reference": {"fixed": 8.0, "flops": 1.3, "elements": 1.0, "launches": 1.0, "bytes": 1.0},
        "evaluate": {"fixed": 10.0, "flops": 1.3, "elements": 6.0, "launches": 1.0, "bytes": 1.0},
    },
    # bytes: loading and writing checkpoints dominate at 8B; launches: small models. Tokenizing and the GGUF
    # conversion run on the CPU whatever the device (their records say so): they have CPU entries only.
    "cuda": {
        # searches: one AWQ candidate on one layer and batch costs ~2300 launch times (2026-12-07, an 8B shape on
        # two H100s: int4_awq's calibration 101.6 s at 7.0 us a launch, 59.0 s at 4.9 us; fp8's 15.6 s and 7.6 s)
        "quantize": {"fixed": 6.0, "flops": 3.0, "elements": 1.0, "launches": 4.0, "bytes": 0.33,
                     "searches": 2300.0},
        "export": {"fixed": 1.0, "flops": 1.0, "elements": 1.0, "launches": 1.0, "bytes": 1.7},
        "audit": {"fixed": 3.0, "flops": 3.0, "elements": 2.0, "launches": 4.0, "bytes": 1.0},
        "reference": {"fixed": 2.0, "flops": 3.0, "elements": 1.0, "launches": 4.0, "bytes": 0.1},
        "evaluate": {"fixed": 6.0, "flops": 3.0, "elements": 6.0, "launches": 4.0, "bytes": 0.5},
    },
}
# The quantized layers' matmul time against the unquantized ones', per precision (fake-quant during calibration,
# quantlab's engine during evaluation): on a CPU the engine emulates FP8 around float32 GEMMs. Fitted to the default
# sweep on an idle 2-core EPYC (2026-12-07, bench/RESULTS.md; int4_awq's evaluation refitted the same day, fourth
# session: its blocks took 0.80 of fp8's, 9.2 s against 11.5 s); on a busy machine the engines slow down unevenly.
PRECISION_FACTOR = {
    "cpu": {"quantize": {"int8_sq": 1.4},
            "evaluate": {"fp8": 1.75, "fp8_pc_pt": 1.75, "int8_sq": 1.3, "int4_awq": 1.2, "w4a8_awq": 1.1}},
    "cuda": {"quantize": {}, "evaluate": {}},
}


# Seconds a precision adds once per build: on a GPU the engine's INT4 kernels are compiled by Triton for each of
# the model's layer shapes and batch sizes when first used (2026-12-07, an 8B shape on an H100: int4_awq's
# evaluation of 8 windows 25.0 s, fp8's 11-12 s; Triton keeps them on disk, so a warm machine pays less).
PRECISION_FIXED = {"cpu": {}, "cuda": {"evaluate": {"int4_awq": 15.0, "w4a8_awq": 15.0}}}
# The fixed seconds above are Python-side work (loading, dispatch, compiling): they were fitted on machines of these
# launch times and scale with the machine's own (a GPU host's CPU made the same step 1.4-1.7x faster, 2026-12-07).
REFERENCE_LAUNCH_S = {"cpu": 1.75e-6, "cuda": 7.0e-6}


def _precision(variant: str) -> str:
    """The precision of a cost record's variant ("torch:fp8/kv=none", "int4_awq/kv=fp8")."""
    return variant.split(":")[-1].split("/")[0]


def seconds(stage: str, units: dict, device_type: str, machine: dict, variant: str = "") -> float | None:
    """A-priori seconds of one build of stage doing units (Units.to_dict()) on a machine of that speed; variant:
    the cost record's (its precision scales the matmul time of calibration and evaluation)."""
    kind = "cuda" if device_type.startswith("cuda") else "cpu"
    c = COEFFICIENTS[kind].get(stage)
    if c is None or not machine:
        return None
    factor = PRECISION_FACTOR[kind].get(stage, {}).get(_precision(variant), 1.0)
    fixed = c["fixed"] + PRECISION_FIXED[kind].get(stage, {}).get(_precision(variant), 0.0)
    out = fixed * machine["launch_s"] / REFERENCE_LAUNCH_S[kind]  # Python-side work: as fast as this machine's launches
    out += (units.get("flops", 0.0) + units.get("qflops", 0.0) * factor) / machine["matmul_flops"] * c["flops"]
    out += units.get("elements", 0.0) / machine["elementwise_per_s"] * c["elements"]
    out += units.get("launches", 0.0) * machine["launch_s"] * c["launches"]
    out += units.get("bytes", 0.0) / machine["hash_bytes_per_s"] * c["bytes"]
    out += units.get("searches", 0.0) * machine["launch_s"] * c.get("searches", 0.0)
    return out


# ------------------------------------------------------------------------------------------------ per stage
def calibration(shape: Shape, tokens: int, seq_len: int, batch: int, passes: float | None,
                searches: float = 0.0) -> dict:
    """A calibration's units: its forward passes without the head (quantlab.costs.calibration_passes), reading the
    model in float32, and `searches` candidates tried on every quantized linear layer (quantlab.costs.searches:
    AWQ's scale search)."""
    units = forward(shape, tokens, seq_len, batch, head=False, passes=passes or 1.0, quantized=True)
    units.bytes = 4.0 * shape.params
    units.searches = searches * shape.layers * LINEARS_PER_LAYER
    return units.to_dict()


def export(shape: Shape, weight_bits: float = 16.0) -> dict:
    """An export's units: quantizing every weight once and writing the checkpoint, its linear layers at weight_bits
    (the precision's stored width) and the rest in 16 bits."""
    return Units(elements=4.0 * shape.params, bytes=checkpoint_bytes(shape, weight_bits)).to_dict()


def audit(shape: Shape, canary_windows: int, canary_tokens: int) -> dict:
    """The audit's units: every quantized weight rebuilt and compared with the reference (a few elementwise passes
    over each), and the canary's forward passes of the reference and the export."""
    units = forward(shape, canary_windows * canary_tokens, canary_tokens, canary_windows, head=True, passes=2.0)
    units.elements += 8.0 * shape.params
    units.bytes = 4.0 * shape.params
    return units.to_dict()


def _decode(shape: Shape, models: int, generate: tuple[int, int], quantized: bool = False) -> Units:
    """Greedy generation by `models` models (generate: prompts, steps; all prompts at once, launch-bound)."""
    prompts, steps = generate
    if not prompts:
        return Units()
    body = models * 2 * shape.body_macs(64) * prompts * steps
    return Units(flops=models * 2 * shape.head_macs() * prompts * steps + (0.0 if quantized else body),
                 qflops=body if quantized else 0.0, launches=models * steps * shape.layers * LAUNCHES_PER_LAYER)


def _sum(*parts: Units) -> Units:
    return Units(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(Units)})


def reference(shape: Shape, tokens: int, seq_len: int, batch: int, generate: tuple[int, int] = (0, 0)) -> dict:
    """The reference's units: loading the model, its forward passes with the head over the windows read, and its
    greedy generations (generate: prompts, steps)."""
    return _sum(forward(shape, tokens, seq_len, batch), _decode(shape, 1, generate),
                Units(bytes=4.0 * shape.params)).to_dict()


def checkpoint_bytes(shape: Shape, weight_bits: float = 16.0) -> float:
    """Bytes of an exported checkpoint: the decoder's linear layers at weight_bits, the rest in 16 bits."""
    linear = min(shape.linear_params(), float(shape.params)) if shape.params else shape.linear_params()
    return linear * weight_bits / 8 + 2.0 * max(0.0, shape.params - linear)


def evaluation(shape: Shape, tokens: int, seq_len: int, batch: int, look_tokens: int,
               generate: tuple[int, int], weight_bits: float = 16.0) -> dict:
    """A candidate's evaluation units: the candidate over the windows read (the reference, which the same step
    builds when it is not cached, is priced on its own: reference()), the reference's logits recomputed from its
    cached hidden states for the KL (a head and two vocabulary-wide passes a token), the first look again for the
    numerics check, the candidate's greedy generations (generate: prompts, steps) and loading its checkpoint (its
    linear layers at weight_bits)."""
    cand = forward(shape, tokens + look_tokens, seq_len, batch, quantized=True)
    kl = Units(flops=2 * shape.head_macs() * tokens, elements=2.0 * shape.vocab * tokens)
    return _sum(cand, kl, _decode(shape, 1, generate, quantized=True),
                Units(bytes=checkpoint_bytes(shape, weight_bits))).to_dict()
