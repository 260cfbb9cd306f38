"""Maintained kernels against quantlab's at the Llama-3.1-8B decode shapes (GPU), under the same numerics contract
(issue 41, item 5): is there a maintained kernel as exact and at least as fast as ours, shape by shape?

- W4A16, group 128, the AWQ export layout the engine serves, at bench/decode.py's SWEEP_SHAPES: quantlab's k8
  kernels as the engine runs them (int4.k8_launch with the shipped int4.CONFIGS) vs torch's own tinygemm
  (torch.ops.aten._weight_int4pack_mm on its packed layout, zero points 0: its dequantization (q - 8) * scale + 0 is
  one rounding of q * scale, as ours), torchao 0.18's Int4TilePackedTo4dTensor (a wrapper of that op) and gemlite
  0.6 (Triton; zeros = 8: (q - 8) * scale; its split-K atomics in bf16, its default on sm_90, and in fp32).
- FP8 E4M3 at bench/fp8_kernels.py's SHAPES (per-tensor static scales; the fused q|k|v and gate|up paths with fp32
  out and unit scales, as the engine calls them) and per-channel weight scales with per-token activation scales
  (FP8_PER_CHANNEL_PER_TOKEN): quantlab's one-row FP8 GEMV (kernels.fp8) and torch._scaled_mm as the engine calls
  it. torchao's float8 linear is torch._scaled_mm (plus its own activation quantize) unless mslk is installed: the
  run says which, and times nothing of it that the torch._scaled_mm rows do not already time.
- FlashInfer: only whether it imports (its wheel is over the device's carry limit and it compiles its kernels with
  nvcc at first use): never run here.

Every kernel's output is checked against the exact arithmetic (float64) of the same dequantized weights before it is
timed: the bound of int4.bound / fp8.bound (fp32 accumulation in any order plus one rounding of the output), what
quantlab's own kernels meet (int4.check, fp8.check). A kernel outside it is timed all the same and never preferred.
Times are CUDA-graph replays over weight copies larger than L2 (bench/decode.py's graph_us), microseconds per call;
"x ours" is ours' time over the kernel's (above 1: faster than ours). A maintained kernel is preferred at a shape and
row count where it meets the contract and is at least as fast as ours (--tolerance: within that fraction); the
"prefer" lines sum that up per op. Each kernel runs in its own try block (its failure is a row with the reason), a
budget in seconds bounds the run (what it leaves out is a row "not run: budget spent"), and the JSON is rewritten
after every section.

    python bench/maintained_kernels.py [--rows 1,16] [--ops w4a16,fp8_tensor,fp8_channel] [--budget-s 420]
                                       [--quick] [--gemlite-autotune] [--tolerance 0] [--exclude gemlite]
                                       [--out FILE] [--dry-run]

On the device machine: bash bench/maintained_kernels_device.sh (installs the carried wheels of .device/mk).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402 - the decode bench's timing helpers and shapes
import fp8_kernels  # noqa: E402 - the FP8 bench's shapes

from quantlab.engines import qlayers  # noqa: E402
from quantlab.engines.int4_codes import unpack_int4  # noqa: E402
from quantlab.engines.kernels import fp8, int4  # noqa: E402

GROUP = bench.GROUP
OPS = ("w4a16", "fp8_tensor", "fp8_channel")
TINYGEMM_TILES = (8, 4, 2)  # innerKTiles of torch's int4 packing (torchao uses 8)
NOT_RUN = float("nan")


# ------------------------------------------------------------------------------------------------ contract, decision
def contract(y: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype) -> dict:
    """The numerics contract of quantlab's kernels: every output within `bound` of the exact (float64) result, of the
    output dtype and shape. Returns max_abs_err, worst (largest error over its bound), meets and why."""
    if y.dtype != dtype or tuple(y.shape) != tuple(exact.shape):
        return {"max_abs_err": math.inf, "worst": math.inf, "meets": False,
                "why": f"wrong output: {str(y.dtype).removeprefix('torch.')} {tuple(y.shape)}, expected "
                       f"{str(dtype).removeprefix('torch.')} {tuple(exact.shape)}"}
    diff = (y.double() - exact.to(y.device)).abs()
    err, worst = float(diff.max()), float((diff / bound.to(y.device)).max())
    if not bool(torch.isfinite(y).all()):
        return {"max_abs_err": err, "worst": math.inf, "meets": False, "why": "non-finite outputs"}
    meets = worst <= 1.0
    why = (f"within the bound (worst/bound {worst:.3f})" if meets
           else f"outside the bound: worst/bound {worst:.2f} (fp32 accumulation + one rounding of the output)")
    return {"max_abs_err": err, "worst": worst, "meets": meets, "why": why}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _refusal(row: dict, ours_us: float, tolerance: float) -> str | None:
    """Why a maintained kernel's row is not preferred over ours (None: it is)."""
    if row.get("error"):
        return row["error"]
    if not row.get("meets"):
        return row.get("why") or "outside the contract"
    if not _finite(row.get("us")):
        return row.get("timing") or "not timed"
    if row["us"] > ours_us * (1 + tolerance):
        return f"slower: x ours {ours_us / row['us']:.2f}"
    return None


def decide(rows: list[dict], tolerance: float = 0.0) -> list[dict]:
    """Per (op, shape, M): the kernel to prefer. A maintained kernel is preferred where it meets the contract and takes
    at most ours' time (times 1 + tolerance); the fastest such one; else ours. No decision (prefer None) where ours
    was not measured or is outside the contract itself. Each decision says why every other kernel was not chosen."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["op"], r["shape"], r["m"]), []).append(r)
    out = []
    for (op, shape, m), rs in groups.items():
        ours = next((r for r in rs if r["role"] == "ours"), None)
        d = {"op": op, "shape": shape, "m": m, "ours": ours["kernel"] if ours else None, "prefer": None,
             "maintained": False, "refused": {}}
        if ours is None or not ours.get("meets") or not _finite(ours.get("us")):
            d["why"] = "ours " + ("not measured" if ours is None else
                                  ours.get("error") or ("not timed" if ours.get("meets") else ours.get("why", "")))
            out.append(d)
            continue
        qualified = []
        for r in (r for r in rs if r["role"] == "maintained"):
            why = _refusal(r, ours["us"], tolerance)
            if why is None:
                qualified.append(r)
            else:
                d["refused"][r["kernel"]] = why
        chosen = min(qualified, key=lambda r: r["us"]) if qualified else ours
        for r in qualified:
            if r is not chosen:
                d["refused"][r["kernel"]] = f"qualifies, but {chosen['kernel']} is faster"
        d.update(prefer=chosen["kernel"], maintained=chosen is not ours, prefer_us=chosen["us"], ours_us=ours["us"],
                 why=("meets the contract, x ours " + f"{ours['us'] / chosen['us']:.2f}") if chosen is not ours
                 else "no maintained kernel meets the contract at ours' speed or better")
        out.append(d)
    return out


def prefer_lines(decisions: list[dict]) -> list[str]:
    """One line per op: the maintained kernel where one is preferred (shape and M), else ours; undecided ones named."""
    lines = []
    for op in dict.fromkeys(d["op"] for d in decisions):
        ds = [d for d in decisions if d["op"] == op]
        taken = [d for d in ds if d["maintained"]]
        undecided = [d for d in ds if d["prefer"] is None]
        kept = len(ds) - len(taken) - len(undecided)
        parts = [f"{d['prefer']} at M={d['m']} {d['shape']} ({d['why']})" for d in taken]
        if kept:
            parts.append(f"ours at all {kept} (shape, M) measured" if kept == len(ds)
                         else f"ours at the other {kept} of {len(ds)} (shape, M)")
        parts += [f"undecided at M={d['m']} {d['shape']}: {d['why']}" for d in undecided]
        lines.append(f"prefer {op}: " + "; ".join(parts))
    return lines


def table(rows: list[dict]) -> list[str]:
    """The rows as a fixed-width table: kernel, shape, M, max |error|, worst/bound, contract, us/call, x ours."""
    head = (f"{'op':11s} {'kernel':44s} {'role':5s} {'shape':18s} {'M':>3s} {'max|err|':>9s} {'err/bnd':>8s} "
            f"{'contract':8s} {'us/call':>8s} {'x ours':>7s}  note")
    out = [head, "-" * len(head)]
    for r in rows:
        err = f"{r['max_abs_err']:.2e}" if _finite(r.get("max_abs_err")) else "-"
        worst = f"{r['worst']:.3f}" if _finite(r.get("worst")) else "-"
        us = f"{r['us']:.2f}" if _finite(r.get("us")) else "-"
        vs = f"{r['vs_ours']:.2f}" if _finite(r.get("vs_ours")) else "-"
        meets = "yes" if r.get("meets") else "no"
        note = r.get("error") or ("" if r.get("meets") else r.get("why", ""))
        if r.get("timing", "graph") != "graph":
            note = f"{r['timing']}; {note}" if note else r["timing"]
        role = "ours" if r["role"] == "ours" else "maint"
        out.append(f"{r['op']:11s} {r['kernel'][:44]:44s} {role:5s} {r['shape']:18s} {r['m']:3d} {err:>9s} "
                   f"{worst:>8s} {meets:8s} {us:>8s} {vs:>7s}  {note[:140]}")
    return out


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's vs_ours: ours' time over its own at the same (op, shape, M) (above 1: faster than ours)."""
    ours = {(r["op"], r["shape"], r["m"]): r["us"] for r in rows if r["role"] == "ours" and _finite(r.get("us"))}
    for r in rows:
        base = ours.get((r["op"], r["shape"], r["m"]))
        r["vs_ours"] = base / r["us"] if base is not None and _finite(r.get("us")) and r["us"] > 0 else NOT_RUN
    return rows


# ------------------------------------------------------------------------------------------------ layouts
def tinygemm_codes(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The export layout (uint8 [N/2, K], two's complement codes; scales [N, K/group]) -> what torch's int4 mm takes
    before packing: int32 codes [N, K] in 0..15 (q + 8: tinygemm dequantizes (u - 8) * scale + zero) and
    scales_and_zeros [K/group, N, 2] (scale, zero 0) in the scales' dtype."""
    codes = unpack_int4(packed).to(torch.int32) + 8
    sz = torch.stack([scales, torch.zeros_like(scales)], dim=-1).transpose(0, 1).contiguous()
    return codes, sz


def nibble_pairs(codes: torch.Tensor) -> torch.Tensor:
    """int32 codes [N, K] in 0..15 -> uint8 [N, K/2], input 2j in the high nibble and 2j+1 in the low: the input of
    torch.ops.aten._convert_weight_to_int4pack on CUDA (as torchao packs it)."""
    return ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()


def rowwise_bound(xq: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, bound) of (xq @ w^T) * scale_a[m] * scale_b[n] (per-token, per-channel): fp32 accumulation of exact
    products in any order (sqrt(K) roundings), two fp32 scalings, half an ulp of the output."""
    scale = scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    x64, w64 = xq.double(), w.double()
    exact = (x64 @ w64.t()) * scale
    eps32 = torch.finfo(torch.float32).eps
    acc = (x64.abs() @ w64.abs().t()) * 2 * math.sqrt(w.shape[1]) * eps32 * scale
    out = (exact.abs() + acc) * (eps32 + torch.finfo(dtype).eps / 2) * (1 + 1e-6)
    return exact, acc + out + 1e-30


# ------------------------------------------------------------------------------------------------ kernels
@dataclass
class Kernel:
    """One kernel of the comparison: `prepare(shape tensors) -> one state per weight copy` (states shared by the
    kernels of one `share` key), `call(inputs, state) -> y`; `role(m, n, k)`: "ours" (what the engine runs there) or
    "maintained"; `rows`: the row counts it is timed at (None: all); `lib`: the library it needs (None: torch and
    quantlab); `skip`: a reason it is not run at all (recorded as its row); `needs`: what it takes, for the report."""

    op: str
    name: str
    prepare: Callable
    call: Callable
    role: Callable = lambda m, n, k: "maintained"
    rows: tuple | None = None
    lib: str | None = None
    share: str | None = None
    skip: str | None = None
    needs: str = ""
    applies: Callable = lambda m, n, k: True


def _ours(_m: int, _n: int, _k: int) -> str:
    return "ours"


def _tinygemm_prepare(tiles: int):
    def prepare(t: dict) -> list:
        out = []
        for packed, scales, _, _ in t["layers"]:
            codes, sz = tinygemm_codes(packed, scales)
            out.append((torch.ops.aten._convert_weight_to_int4pack(nibble_pairs(codes), tiles), sz))
            del codes
        return out
    return prepare


def _torchao_prepare(t: dict) -> list:
    from torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor import Int4TilePackedTo4dTensor

    n, k = t["n"], t["k"]
    packs = t.get("states", {}).get("tinygemm8") or _tinygemm_prepare(8)(t)  # the iKT=8 packing, where prepared
    return [Int4TilePackedTo4dTensor(q, sz, [1, GROUP], torch.Size([n, k])) for q, sz in packs]


def _gemlite_prepare(t: dict) -> list:
    from gemlite import DType, GemLiteLinear

    out = []
    for packed, scales, _, _ in t["layers"]:
        layer = GemLiteLinear(4, group_size=GROUP, in_features=t["k"], out_features=t["n"], input_dtype=DType.BF16,
                              output_dtype=DType.BF16)
        codes = (unpack_int4(packed).to(torch.int16) + 8).to(torch.uint8)  # 0..15, zero point 8
        out.append(layer.pack(codes, scales, 8, None))
        del codes
    return out


def _gemlite_call(native_bf16_atomics: bool, manual: str | None = None):
    def call(a: tuple, layer):
        import gemlite

        gemlite.set_native_atomic_bfp16(native_bf16_atomics)  # read at each launch: set before this one
        return layer.forward_manual(a[0], manual) if manual else layer(a[0])
    return call


def w4a16_kernels() -> list[Kernel]:
    """The W4A16 kernels compared: ours, torch's tinygemm per innerKTiles, torchao's wrapper of it, gemlite."""
    tiny_needs = ("a CUDA build of torch (sm_80+), bf16, group 32-256, K a multiple of 16 x innerKTiles; its own "
                  "packed layout (_convert_weight_to_int4pack) and scales_and_zeros [K/g, N, 2] (zero 0): a repack "
                  "at load, as ours")
    out = [Kernel("w4a16", "quantlab k8 (shipped int4.CONFIGS)", lambda t: [(q, st) for _, _, q, st in t["layers"]],
                  lambda a, s: int4.k8_launch(a[0], s[0], s[1], None, GROUP), role=_ours, share="k8",
                  needs="Triton + NVRTC (the tensor-core kernel), the k8 layout (int4.repack at load)")]
    out += [Kernel("w4a16", f"torch _weight_int4pack_mm (tinygemm, iKT={t})", _tinygemm_prepare(t),
                   lambda a, s: torch.ops.aten._weight_int4pack_mm(a[0], s[0], GROUP, s[1]), share=f"tinygemm{t}",
                   needs=tiny_needs) for t in TINYGEMM_TILES]
    out.append(Kernel("w4a16", "torchao Int4TilePackedTo4dTensor (tinygemm)", _torchao_prepare,
                      lambda a, s: torch.nn.functional.linear(a[0], s), lib="torchao",
                      needs="torchao 0.18 (pure Python on this path: it pads K to 1024, calls the same aten op, "
                            "slices N); its default Int4WeightOnlyConfig formats (plain, preshuffled) call mslk"))
    gl = "gemlite 0.6 (Triton >= 3.6; its layout: codes 0..15 packed into int32 along K, zero point 8)"
    out += [Kernel("w4a16", "gemlite auto (bf16 atomics: sm_90 default)", _gemlite_prepare, _gemlite_call(True),
                   lib="gemlite", share="gemlite", needs=gl),
            Kernel("w4a16", "gemlite auto (fp32 atomics)", _gemlite_prepare, _gemlite_call(False), lib="gemlite",
                   share="gemlite", needs=gl),
            Kernel("w4a16", "gemlite GEMM (no split-K)", _gemlite_prepare, _gemlite_call(True, "GEMM"), rows=(16,),
                   lib="gemlite", share="gemlite", needs=gl)]
    return out


def _scaled_mm_role(m: int, n: int, k: int) -> str:
    """torch._scaled_mm is ours where the engine calls it (more rows, shapes without a measured GEMV configuration, a
    device where the GEMV failed its check), the maintained alternative where the engine runs its FP8 GEMV."""
    return "maintained" if fp8.applies(m, n, k, "cuda") else "ours"


def _scaled_mm(a: tuple, w: torch.Tensor) -> torch.Tensor:
    xq, sa, sb, dtype = a
    rows = xq.shape[0]
    return torch._scaled_mm(qlayers._pad_rows(xq, 16), w.t(), scale_a=sa, scale_b=sb, out_dtype=dtype)[:rows]


def _scaled_mm_rowwise(a: tuple, w: torch.Tensor) -> torch.Tensor:
    xq, sa, sb, dtype = a
    rows = xq.shape[0]
    return torch._scaled_mm(qlayers._pad_rows(xq, 16), w.t(), scale_a=qlayers._pad_rows(sa, 16), scale_b=sb,
                            out_dtype=dtype)[:rows]


def fp8_kernels_for(op: str, torchao_note: str) -> list[Kernel]:
    """The FP8 kernels compared for one op (fp8_tensor, fp8_channel): ours, torch._scaled_mm, torchao (a row saying
    what its float8 linear calls here)."""
    ws = lambda t: t["ws"]  # noqa: E731
    if op == "fp8_tensor":
        out = [Kernel(op, "quantlab fp8_gemv (shipped fp8.CONFIGS)", ws, lambda a, w: fp8.launch(a[0], w, *a[1:]),
                      role=_ours, rows=(1,), share="w", applies=lambda m, n, k: fp8.applies(m, n, k, "cuda"),
                      needs="Triton; one row; the shapes of fp8.CONFIGS"),
               Kernel(op, "torch._scaled_mm (as the engine calls it)", ws, _scaled_mm, role=_scaled_mm_role,
                      share="w", needs="sm_89+; rows padded to 16")]
    else:
        out = [Kernel(op, "torch._scaled_mm row-wise (as the engine)", ws, _scaled_mm_rowwise,
                      role=_ours, share="w", needs="sm_89+; bf16 out; rows padded to 16")]
    out.append(Kernel(op, "torchao Float8Tensor linear", ws, _scaled_mm, lib="torchao", skip=torchao_note,
                      needs="torchao 0.18; mslk for its own GEMM (f8f8bf16_rowwise)"))
    return out


# ------------------------------------------------------------------------------------------------ shape tensors
def int4_tensors(n: int, k: int, rows: int, g: torch.Generator) -> dict:
    """bench/decode.py's sweep tensors (export and k8 layouts, copies over L2, exact result and bound) for `rows`
    rows; each row count takes the first rows."""
    t = bench._sweep_tensors(rows, n, k, g)
    return {**t, "n": n, "k": k, "inputs": lambda m: (t["x"][:m],),
            "exact_for": lambda m: (t["exact"][:m], t["bound"][:m]), "dtype": torch.bfloat16}


def fp8_tensors(n: int, k: int, rows: int, dtype: torch.dtype, rowwise: bool, g: torch.Generator) -> dict:
    """E4M3 weight copies over L2 and activations of every magnitude (fp8.codes), static per-tensor scales (unit ones
    for fp32 out, as the fused paths) or per-token x per-channel ones, and the exact result with its bound."""
    copies = max(1, math.ceil(bench.L2_BYTES / (n * k)))
    ws = [fp8.codes((n, k), g, 0.25) for _ in range(copies)]
    xq = fp8.codes((rows, k), g)
    if rowwise:
        sa = torch.rand(rows, 1, device="cuda", generator=g) * 0.02 + 1e-3
        sb = torch.rand(1, n, device="cuda", generator=g) * 0.01 + 1e-4
        exact, bnd = rowwise_bound(xq, ws[0], sa, sb, dtype)
        inputs = lambda m: (xq[:m], sa[:m], sb, dtype)  # noqa: E731
    else:
        unit = dtype == torch.float32
        sa = torch.ones((), device="cuda") if unit else torch.tensor(0.013, device="cuda")
        sb = torch.ones((), device="cuda") if unit else torch.tensor(0.0021, device="cuda")
        exact, bnd = fp8.bound(xq, ws[0], float(sa * sb), dtype)
        inputs = lambda m: (xq[:m], sa, sb, dtype)  # noqa: E731
    return {"n": n, "k": k, "ws": ws, "copies": copies, "inputs": inputs,
            "exact_for": lambda m: (exact[:m], bnd[:m]), "dtype": dtype}


def shapes_for(op: str, quick: bool) -> list[tuple]:
    """(label, N, K, output dtype) of an op: the W4A16 sweep's shapes, or the FP8 bench's (with its out dtypes)."""
    if op == "w4a16":
        names = {(28672, 4096): "gate|up", (4096, 14336): "down", (6144, 4096): "q|k|v", (4096, 4096): "o"}
        out = [(f"{names.get((n, k), '')} {n}x{k}".strip(), n, k, torch.bfloat16) for n, k in bench.SWEEP_SHAPES]
    else:
        out = [(f"{label} {n}x{k}", n, k, dtype if op == "fp8_tensor" else torch.bfloat16)
               for n, k, label, dtype in fp8_kernels.SHAPES]
    return out[:2] if quick else out


# ------------------------------------------------------------------------------------------------ measuring
def _row(kern: Kernel, label: str, n: int, k: int, m: int, **extra) -> dict:
    return {"op": kern.op, "kernel": kern.name, "role": kern.role(m, n, k), "shape": label, "n": n, "k": k, "m": m,
            "needs": kern.needs, "max_abs_err": NOT_RUN, "worst": NOT_RUN, "meets": False, "us": NOT_RUN, **extra}


def _sync(a: tuple) -> None:
    if a[0].is_cuda:
        torch.cuda.synchronize()


def _host_us(fn, iters: int = 20) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def _time(kern: Kernel, a: tuple, states: list) -> tuple[float, str]:
    """Microseconds per call over every copy: CUDA-graph replays, else (capture failed) eager launches; the host
    clock for CPU tensors (the tests: nothing timed that matters)."""
    if not a[0].is_cuda:
        return _host_us(lambda: [kern.call(a, s) for s in states]) / len(states), "host clock (CPU)"
    try:
        return bench.graph_us(lambda: [kern.call(a, s) for s in states]) / len(states), "graph"
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured is timed eagerly, and says so
        why = f"{type(exc).__name__}: {str(exc)[:100]}"
    torch.cuda.synchronize()
    kern.call(a, states[0])
    return bench.cuda_ms(lambda: [kern.call(a, s) for s in states], 20) * 1e3 / len(states), (
        f"eager (CUDA-graph capture failed: {why})")


def measure(kern: Kernel, t: dict, states: list, m: int, label: str) -> dict:
    """One kernel at M rows: its output against the exact arithmetic, then its time (timed even outside the
    contract: the table says so)."""
    n, k = t["n"], t["k"]
    a = t["inputs"](m)
    try:
        y = kern.call(a, states[0])
        _sync(a)
        row = _row(kern, label, n, k, m, **contract(y, *t["exact_for"](m), t["dtype"]))
        del y
    except Exception as exc:  # noqa: BLE001 - one kernel's failure is its row, the rest still runs
        int4.reset_counters()
        fp8.reset_counters()
        return _row(kern, label, n, k, m, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    try:
        row["us"], row["timing"] = _time(kern, a, states)
    except Exception as exc:  # noqa: BLE001 - checked but not timed: the row keeps its check
        int4.reset_counters()
        fp8.reset_counters()
        row["timing"] = f"not timed: {type(exc).__name__}: {str(exc)[:200]}"
    return row


def _not_run(kern: Kernel, libs: dict, deadline: float) -> str | None:
    if kern.skip:
        return kern.skip
    if kern.lib and not libs.get(kern.lib, {}).get("imports"):
        return f"not run: {kern.lib} does not import ({libs.get(kern.lib, {}).get('error', 'not probed')})"
    if time.time() > deadline:
        return "not run: budget spent"
    return None


def run_shape(kernels: list[Kernel], t: dict, label: str, rows: list[int], libs: dict, deadline: float) -> list[dict]:
    """Every kernel at one shape and each row count it takes; states of one share key prepared once."""
    n, k = t["n"], t["k"]
    out, states = [], {}
    t["states"] = states  # what one kernel's prepare may reuse of another's
    for kern in kernels:
        ms = [m for m in rows if (kern.rows is None or m in kern.rows) and kern.applies(m, n, k)]
        if not ms:
            continue
        why = _not_run(kern, libs, deadline)
        if why:
            out += [_row(kern, label, n, k, m, error=why) for m in ms]
            continue
        key = kern.share or kern.name
        t0 = time.time()
        try:
            if key not in states:
                states[key] = kern.prepare(t)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot take these weights is a row saying why
            out += [_row(kern, label, n, k, m, error=f"prepare: {type(exc).__name__}: {str(exc)[:200]}") for m in ms]
            continue
        prepare_s = time.time() - t0
        for m in ms:
            row = (measure(kern, t, states[key], m, label) if time.time() <= deadline
                   else _row(kern, label, n, k, m, error="not run: budget spent"))
            row["prepare_s"] = round(prepare_s, 2)
            out.append(row)
            print("    " + table([row])[2], flush=True)
    states.clear()
    t.pop("states")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def excluded(kernels: list[Kernel], substrings: list[str]) -> list[Kernel]:
    """The kernels, those whose name holds one of `substrings` marked not to run (--exclude)."""
    for kern in kernels:
        hit = next((e for e in substrings if e in kern.name), None)
        if hit is not None and not kern.skip:
            kern.skip = f"not run: --exclude {hit}"
    return kernels


def run_op(op: str, args, libs: dict, deadline: float, g: torch.Generator):
    """One op over its shapes, yielding each shape's rows: tensors built once per shape (for the most rows), every
    kernel at every row count it takes."""
    kernels = excluded(w4a16_kernels() if op == "w4a16" else fp8_kernels_for(op, libs.get("torchao", {}).get(
        "float8", "not run: torchao was not probed")), args.excluded)
    rows = sorted(args.row_counts)
    for label, n, k, dtype in shapes_for(op, args.quick):
        if time.time() > deadline:
            yield [_row(kern, label, n, k, m, error="not run: budget spent") for kern in kernels for m in rows
                   if kern.rows is None or m in kern.rows]
            continue
        print(f"== {op} {label} (out {str(dtype).removeprefix('torch.')})", flush=True)
        t = (int4_tensors(n, k, rows[-1], g) if op == "w4a16"
             else fp8_tensors(n, k, rows[-1], dtype, op == "fp8_channel", g))
        out = run_shape(kernels, t, label, rows, libs, deadline)
        del t
        torch.cuda.empty_cache()
        yield out


# ------------------------------------------------------------------------------------------------ libraries
_TORCHAO_SO_PROBE = """
import json, logging
msgs = []
class H(logging.Handler):
    def emit(self, r):
        msgs.append(r.getMessage()[:300])
logging.getLogger("torchao").addHandler(H(logging.WARNING))
import torch, torchao
ops = {}
for op in ("rowwise_scaled_linear_sparse_cutlass_f8f8", "mx_fp8_bf16"):
    try:
        ops[op] = torch._C._dispatch_has_kernel_for_dispatch_key("torchao::" + op, "CUDA")
    except Exception as exc:
        ops[op] = repr(exc)[:200]
print(json.dumps({"load_messages": msgs, "compiled_ops_cuda": ops}))
"""


def _torchao_compiled() -> dict:
    """torchao's compiled ops loaded in a child process first (a library that fails to load can take the process
    with it): what loaded, what it said, and whether the child survived."""
    import os
    import subprocess

    try:
        done = subprocess.run([sys.executable, "-c", _TORCHAO_SO_PROBE], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "the import took over 120 s in a child process"}
    if done.returncode != 0:
        return {"ok": False, "error": f"the import exited {done.returncode} in a child process: "
                                      f"{done.stderr.strip()[-300:]}"}
    try:
        return {"ok": True, **json.loads(done.stdout.strip().splitlines()[-1])}
    except (ValueError, IndexError):
        return {"ok": False, "error": f"unreadable child output: {done.stdout[-200:]!r}"}


def probe_torchao() -> dict:
    """Whether torchao imports (its compiled ops tried in a child process first: where that fails, imported here
    without them, which the paths compared do not use), whether mslk is there, and what its int4 and float8 linears
    call on this machine."""
    import os

    compiled = _torchao_compiled()
    if not compiled["ok"]:
        os.environ["TORCHAO_FORCE_SKIP_LOADING_SO_FILES"] = "1"
    try:
        import torchao
        from torchao.utils import _is_mslk_available
    except Exception as exc:  # noqa: BLE001 - recorded: the torchao rows say it does not import
        return {"imports": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "compiled": compiled}
    mslk = bool(_is_mslk_available())
    float8 = ("not run: torchao's Float8Tensor linear calls torch._scaled_mm here (mslk is not installed), after its "
              "own activation quantize: the torch._scaled_mm rows are its GEMM" if not mslk else
              "not run: mslk is installed (torchao would call mslk.f8f8bf16_rowwise): not compared by this bench")
    return {"imports": True, "version": torchao.__version__, "mslk": mslk, "compiled": compiled, "float8": float8,
            "int4": "Int4TilePackedTo4dTensor calls torch.ops.aten._weight_int4pack_mm (timed); the plain and "
                    "preshuffled int4 formats call mslk" + ("" if mslk else " (not installed)") + "; torchao 0.18 has "
                    "no Marlin kernel; its compiled ops (sparse FP8 CUTLASS, MX FP8) are not dense decode kernels"}


def probe_gemlite(autotune: bool) -> dict:
    """Whether gemlite imports, and the autotune cache it starts from (its shipped one for this GPU, else, unless
    --gemlite-autotune, the H100's: autotuning every shape would take much of the budget)."""
    try:
        import gemlite
        from gemlite import core
    except Exception as exc:  # noqa: BLE001 - recorded: the gemlite rows say it does not import
        return {"imports": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    out = {"imports": True, "version": gemlite.__version__, "config": core.selected_tag}
    if core.selected_tag is None and not autotune:
        h100 = Path(core.__file__).parent / "configs" / "h100.json"
        out["config"] = f"{h100} (no cache shipped for this GPU; --gemlite-autotune autotunes instead)"
        out["config_loaded"] = bool(gemlite.load_config(str(h100)))
    return out


def probe_flashinfer() -> dict:
    """Whether FlashInfer is installed; never run here (it compiles its kernels with nvcc at first use, and its
    wheel is over the device's carry limit)."""
    import importlib.metadata
    import importlib.util

    why = "it compiles its kernels with nvcc at first use; its wheel (101 MB) is over the device's carry limit"
    if importlib.util.find_spec("flashinfer") is None:
        return {"imports": False, "error": "not installed", "not_run": why}
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"imports": True, "version": version, "not_run": why}


def environment() -> dict:
    """The device, versions, and whether quantlab's own kernels passed their startup checks here."""
    out = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        out["triton"] = f"does not import: {exc}"
    for name, fn in (("k8_usable", lambda: int4.k8_usable("cuda", torch.bfloat16)),
                     ("fp8_gemv_usable", lambda: fp8.usable("cuda"))):
        try:
            out[name] = bool(fn())
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


# ------------------------------------------------------------------------------------------------ main
def plan(args) -> list[str]:
    """What a run would do (--dry-run): per op its shapes, row counts and kernels with what each needs."""
    lines = [f"budget {args.budget_s:.0f}s; rows {args.row_counts}; tolerance {args.tolerance}"]
    for op in args.op_list:
        kernels = excluded(w4a16_kernels() if op == "w4a16" else fp8_kernels_for(op, "torchao: decided at run time"),
                           args.excluded)
        lines.append(f"{op}: shapes " + ", ".join(s[0] for s in shapes_for(op, args.quick)))
        for kern in kernels:
            rows = [m for m in args.row_counts if kern.rows is None or m in kern.rows]
            lines.append(f"  {kern.name:46s} M={rows} needs: {kern.needs}" + (f" [{kern.skip}]" if kern.skip else ""))
    lines.append("flashinfer: import probed only, never run")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16", help="row counts M (comma-separated)")
    p.add_argument("--ops", default=",".join(OPS), help=f"ops to compare, of {', '.join(OPS)}")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting kernels after this many seconds")
    p.add_argument("--quick", action="store_true", help="the first two shapes of each op")
    p.add_argument("--gemlite-autotune", action="store_true", help="autotune gemlite where it ships no cache")
    p.add_argument("--tolerance", type=float, default=0.0, help="a maintained kernel within this fraction of ours' "
                   "time counts as at least as fast")
    p.add_argument("--exclude", default="", help="comma-separated substrings: kernels whose name holds one are not "
                   "run (a row says so), e.g. gemlite after a fault that took the CUDA context")
    p.add_argument("--out", default=None, help="JSON results (rewritten after every section)")
    p.add_argument("--dry-run", action="store_true", help="list what would run (no GPU needed)")
    args = p.parse_args(argv)
    try:
        args.row_counts = sorted({int(v) for v in args.rows.split(",")})
    except ValueError:
        p.error(f"--rows takes comma-separated integers, got {args.rows!r}")
    args.op_list = [o for o in args.ops.split(",") if o]
    args.excluded = [e for e in args.exclude.split(",") if e]
    bad = [o for o in args.op_list if o not in OPS] + [str(m) for m in args.row_counts if m < 1]
    if bad:
        p.error(f"unknown op or row count: {', '.join(bad)} (ops: {', '.join(OPS)}; rows >= 1)")
    return args


def save(res: dict, out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=1, default=str))


def summarize(res: dict, tolerance: float) -> None:
    """The table, the decisions and the prefer lines, printed and kept in res."""
    rows = with_ratios(res["rows"])
    res["decisions"] = decide(rows, tolerance)
    res["prefer"] = prefer_lines(res["decisions"])
    print("\n".join(table(rows)), flush=True)
    print("\n".join(res["prefer"]), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print("\n".join(plan(args)))
        libs = {"torchao": probe_torchao(), "gemlite": probe_gemlite(True), "flashinfer": probe_flashinfer()}
        print("libraries here: " + json.dumps(libs, indent=1, default=str))
        return 0
    if not torch.cuda.is_available():
        print("maintained_kernels: needs a CUDA GPU (--dry-run lists what would run)", file=sys.stderr)
        return 2
    t0 = time.time()
    deadline = t0 + args.budget_s
    res = {"env": environment(), "libraries": {}, "rows": [], "errors": {}, "args": vars(args)}
    res["libraries"] = {"torchao": probe_torchao(), "gemlite": probe_gemlite(args.gemlite_autotune),
                        "flashinfer": probe_flashinfer()}
    print(json.dumps({"env": res["env"], "libraries": res["libraries"]}, indent=1, default=str), flush=True)
    save(res, args.out)
    g = torch.Generator(device="cuda").manual_seed(0)
    for op in args.op_list:
        try:
            for shape_rows in run_op(op, args, res["libraries"], deadline, g):
                res["rows"] += shape_rows
                save(res, args.out)  # a run cut off mid-op keeps the shapes it finished
        except Exception as exc:  # noqa: BLE001 - one op's failure (its tensors, say) must not hide the others
            res["errors"][op] = traceback.format_exc()[-3000:]
            print(f"FAILED {op}: {type(exc).__name__}: {exc}\n{res['errors'][op]}", flush=True)
        summarize(res, args.tolerance)
        save(res, args.out)
    res["seconds"] = time.time() - t0
    print(f"done in {res['seconds']:.0f}s", flush=True)
    save(res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
