"""FP8 model passes over the torch engine's layers (qlayers.Fp8Linear): one activation quantize shared by the layers
that read one input (q/k/v: SharedActivation, and natively one GEMM over their concatenated weights for decode
steps), the SiLU MLP as one gate|up GEMM with SiLU * up and down's quantize in one kernel (Fp8GatedMLP), and the
one-row FP8 GEMV where it was measured faster than torch._scaled_mm (use_fp8_gemv). Each computes the values the
unfused layers compute, in fewer passes. A pass over a model, not a format: the layers stay in qlayers.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from quantlab.engines import qlayers
from quantlab.engines.qlayers import DECODE_ROWS, Fp8Linear, _fp8_quantize_eager, _pad_rows, _run_fused


class SharedActivation:
    """One FP8 quantize for sibling layers that read the same activation with the same input scale (q/k/v):
    the first sibling called quantizes and holds the result, the others take it, and it is dropped once every
    sibling has.

    The held result is matched to the sibling's input by object identity: the modeling code hands q_proj, k_proj
    and v_proj the very same tensor object, and holding that object keeps it alive, so no other tensor can be
    mistaken for it (storage addresses and version counters, which an earlier version compared, can be reused and
    cannot be read by torch.compile). Under CUDA graph capture and under torch.compile's tracing the Python runs
    once: the hand-over is then plain data flow - one quantize kernel feeding three GEMMs - and replays need no
    Python at all. A sibling called with another tensor (another order, an input moved between devices) simply
    quantizes its own input: never wrong, only not shared."""

    def __init__(self, inv_scale: torch.Tensor, siblings: int):
        self.inv_scale, self.siblings = inv_scale, siblings
        self._held = None  # (the input object, its quantized rows, takers left)
        self.weight = None  # native siblings: their weights concatenated, one GEMM up to DECODE_ROWS rows
        self._held_gemm = None
        self.gemv = False  # one row through quantlab::fp8_gemv (use_fp8_gemv)

    def quantize(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """rows = x reshaped to [M, K]: its FP8 quantize, computed once for the siblings reading x."""
        held = self._held
        if held is None or held[0] is not x:
            held = (x, qlayers.fp8_quantize(rows, self.inv_scale), self.siblings)
        left = held[2] - 1
        self._held = None if left == 0 else (held[0], held[1], left)
        return held[1]

    def concatenate(self, layers: list[Fp8Linear]) -> None:
        """Hold the native siblings' weights as one [sum N, K] tensor (theirs become views of it) for `output`."""
        self.weight = torch.cat([m.weight.view(torch.uint8) for m in layers]).view(torch.float8_e4m3fn)
        self.bounds, self.alphas, start = [], [], 0
        for m in layers:
            m.weight = self.weight[start: start + m.out_features]
            self.bounds.append((start, start + m.out_features))
            self.alphas.append((m.input_scale * m.weight_scale).reshape(1, 1))
            start += m.out_features
        self.one = torch.ones((), device=self.weight.device)

    def output(self, x: torch.Tensor, rows: torch.Tensor, index: int, out_dtype: torch.dtype) -> torch.Tensor:
        """Sibling `index`'s output for a few rows: one quantize and one per-tensor GEMM (fp32 out, unit scales)
        for every sibling, then this sibling's columns times its input and weight scales, rounded to out_dtype (the
        value its own scaled GEMM writes)."""
        held = self._held_gemm
        if held is None or held[0] is not x:
            xq = qlayers.fp8_quantize(rows, self.inv_scale)
            if self.gemv and rows.shape[0] == 1:
                acc = torch.ops.quantlab.fp8_gemv(xq, self.weight, self.one, self.one, torch.float32)
            else:
                acc = torch._scaled_mm(_pad_rows(xq, 16), self.weight.t(), scale_a=self.one, scale_b=self.one,
                                       out_dtype=torch.float32)
            held = (x, acc, self.siblings)
        left = held[2] - 1
        self._held_gemm = None if left == 0 else (held[0], held[1], left)
        lo, hi = self.bounds[index]
        return (held[1][: rows.shape[0], lo:hi] * self.alphas[index]).to(out_dtype)


def _silu_mul_quantize_eager(y: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """[M, 2I] gate|up -> fp8(silu(gate) * up / scale), rounding through y's dtype as the unfused ops do."""
    half = y.shape[-1] // 2
    h = torch.nn.functional.silu(y[:, :half]) * y[:, half:]
    return _fp8_quantize_eager(h, inv_scale)


def silu_mul_quantize(y: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """One kernel on GPUs for what is three passes over [M, I] unfused."""
    return _run_fused("silu_mul_quantize", _silu_mul_quantize_eager, y, inv_scale)


def _scale_silu_mul_quantize_eager(acc: torch.Tensor, row_scale: torch.Tensor, inv_scale: torch.Tensor,
                                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp32 GEMM accumulators [M, 2I] -> each column times its scale, rounded to bf16 (what a scaled GEMM writes),
    then as _silu_mul_quantize_eager."""
    return _silu_mul_quantize_eager((acc * row_scale).to(dtype), inv_scale)




@functools.cache
def _fp32_scaled_mm(device: str) -> bool:
    """Whether this GPU's torch._scaled_mm writes float32 with per-tensor scales (probed once, eagerly)."""
    try:
        a = torch.zeros(16, 32, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except Exception:  # noqa: BLE001 - not supported here: the row-wise path serves every size
        return False


class Fp8GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with FP8 gate/up/down: one quantize of x, one GEMM for gate and up together
    (row-wise weight scales keep each weight's own scale), then SiLU, the product and the quantize for down in
    one kernel, then the down GEMM. The same arithmetic as the three Fp8Linear layers, in fewer passes.

    Up to DECODE_ROWS rows (decode steps) the gate|up GEMM is a per-tensor scaled GEMM writing fp32 (unit
    scales), and each column's scale is applied in the SiLU kernel before the bf16 rounding a scaled GEMM does:
    the same values, at the per-tensor GEMM's speed (the row-wise GEMM is markedly slower at a few rows)."""

    kernel = "torch._scaled_mm (fp8): gate|up one GEMM, silu*up+quantize fused, down"

    def __init__(self, gate: Fp8Linear, up: Fp8Linear, down: Fp8Linear):
        super().__init__()
        self.native = gate.native
        if not self.native:
            self.kernel = "fp8 emulation: gate|up one GEMM, silu*up+quantize, down"
        weight = torch.cat([gate.weight.view(torch.uint8), up.weight.view(torch.uint8)]).view(torch.float8_e4m3fn)
        self.register_buffer("weight", weight)  # [2I, K]
        self.register_buffer("inv_input_scale", gate.inv_input_scale)
        rows = torch.cat([(gate.input_scale * gate.weight_scale).expand(gate.out_features),
                          (up.input_scale * up.weight_scale).expand(up.out_features)])
        self.register_buffer("row_scale", rows.float().reshape(1, -1).contiguous())
        if not self.native:
            self.register_buffer("weight_f32", weight.float())
        self.down = down
        self.fp32_gemm = self.native and _fp32_scaled_mm(str(weight.device))
        self.register_buffer("one", torch.ones((), device=weight.device))
        self.gemv = False  # one row of gate|up through quantlab::fp8_gemv (use_fp8_gemv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) with the FP8 arithmetic of three Fp8Linear layers."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        xq = qlayers.fp8_quantize(x2, self.inv_input_scale)
        if self.native and self.fp32_gemm and rows <= DECODE_ROWS:
            if self.gemv and rows == 1:
                acc = torch.ops.quantlab.fp8_gemv(xq, self.weight, self.one, self.one, torch.float32)
            else:
                acc = torch._scaled_mm(_pad_rows(xq, 16), self.weight.t(), scale_a=self.one, scale_b=self.one,
                                       out_dtype=torch.float32)
            hq = _run_fused("scale_silu_mul_quantize", _scale_silu_mul_quantize_eager, acc, self.row_scale,
                            self.down.inv_input_scale)
        else:
            if self.native:
                padded = _pad_rows(xq, 16)
                ones = torch.ones(padded.shape[0], 1, device=x.device, dtype=torch.float32)
                y = torch._scaled_mm(padded, self.weight.t(), scale_a=ones, scale_b=self.row_scale,
                                     out_dtype=torch.bfloat16)  # fuse_shared_inputs fuses bf16 models only
            else:
                y = ((xq.float() @ self.weight_f32.t()) * self.row_scale).to(x.dtype)
            hq = silu_mul_quantize(y, self.down.inv_input_scale)  # rows padded like y's on the native path
        if self.down.gemv and rows == 1:
            hq = hq[:1]  # the one real row (cuBLAS's GEMMs above write 16)
        out = self.down.gemm(hq, torch.bfloat16)[:rows]
        return out.to(x.dtype).reshape(*shape[:-1], self.down.out_features)


def fuse_shared_inputs(model: nn.Module, dtype: torch.dtype) -> int:
    """Share one activation quantize among q/k/v (native bf16 models: and one GEMM over their concatenated weights
    for up to DECODE_ROWS rows), and fuse every SiLU MLP of FP8 layers into Fp8GatedMLP.
    Siblings are fused only when export gave them one input scale (it does for shared inputs). Native MLPs are
    fused in bf16 models only (row-wise scaled FP8 GEMMs write bf16). Returns the number of groups fused."""
    fused = 0
    for name, module in list(model.named_modules()):
        qkv = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if all(isinstance(m, Fp8Linear) for m in qkv) and len({float(m.input_scale) for m in qkv}) == 1:
            shared = SharedActivation(qkv[0].inv_input_scale, len(qkv))
            for i, m in enumerate(qkv):
                m.shared, m.shared_index = shared, i
            if (all(m.native and m.bias is None for m in qkv) and dtype == torch.bfloat16
                    and _fp32_scaled_mm(str(qkv[0].weight.device))):
                shared.concatenate(qkv)  # decode steps: one GEMM for q/k/v
            fused += 1
        gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        act = getattr(module, "act_fn", None)
        if (all(isinstance(m, Fp8Linear) for m in (gate, up, down)) and float(gate.input_scale) == float(up.input_scale)
                and type(act).__name__ in ("SiLU", "SiLUActivation") and len({gate.native, up.native, down.native}) == 1
                and not any(m.bias is not None for m in (gate, up, down))
                and (not gate.native or dtype == torch.bfloat16)):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, Fp8GatedMLP(gate, up, down))
            fused += 1
    return fused


def use_fp8_gemv(model: nn.Module) -> int:
    """Send one-row FP8 GEMMs to quantlab::fp8_gemv where it applies (kernels.fp8.applies: a configuration
    measured faster than torch._scaled_mm for the shape, and the kernel checked on the layer's device; otherwise,
    e.g. without Triton, torch._scaled_mm stays and the reason is logged once): native Fp8Linear layers, fused q|k|v
    GEMMs (SharedActivation) and fused gate|up GEMMs (Fp8GatedMLP). Returns how many GEMMs it sent there."""
    from quantlab.engines.kernels import fp8

    count = 0
    shared_done: set[int] = set()
    for module in list(model.modules()):
        if isinstance(module, Fp8Linear) and module.native:
            module.gemv = fp8.applies(1, *module.weight.shape, module.weight.device)
            shared = module.shared
            if shared is not None and shared.weight is not None and id(shared) not in shared_done:
                shared_done.add(id(shared))
                shared.gemv = fp8.applies(1, *shared.weight.shape, shared.weight.device)
                count += shared.gemv
        elif isinstance(module, Fp8GatedMLP) and module.native and module.fp32_gemm:
            module.gemv = fp8.applies(1, *module.weight.shape, module.weight.device)
        else:
            continue
        if module.gemv:
            count += 1
            module.kernel += ("; one row: quantlab FP8 GEMV (triton)" if isinstance(module, Fp8Linear)
                              else "; one row of gate|up: quantlab FP8 GEMV (triton)")
    return count
