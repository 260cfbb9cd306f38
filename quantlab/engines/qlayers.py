"""Linear layers with deployment numerics, built from exported tensors (never from the ModelOpt model).

- Fp8Linear:    W8A8 FP8 E4M3, static per-tensor scales. torch._scaled_mm on GPUs with FP8 (sm_89+);
                elsewhere exact emulation: fp8 products are exact in fp32, accumulation in fp32.
- Int8SqLinear: SmoothQuant W8A8: x * pre_quant_scale, static per-tensor int8 activations, per-channel int8
                weights, int32 accumulation with torch._int_mm.
- Int4AwqLinear: W4A16: int4 unpacked once, group scales along the input dimension, pre_quant_scale.
"""
from __future__ import annotations

import torch
from torch import nn

FP8_MAX = 448.0


def _fp8_quantize_eager(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


_fused: dict = {}


def fp8_quantize(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """x / scale -> E4M3 with saturation (a plain cast would turn |v| > 448 into NaN).

    On GPUs the three elementwise steps are fused into one kernel by torch.compile when it works there
    (the unfused version moves ~4x the bytes and costs about as much as the FP8 GEMM it feeds)."""
    if x.is_cuda and _fused.get("ok", True):
        try:
            if "fn" not in _fused:  # compile once; creating the wrapper per call costs milliseconds
                _fused["fn"] = torch.compile(_fp8_quantize_eager, dynamic=True)
            return _fused["fn"](x, inv_scale)
        except Exception:  # noqa: BLE001 - no Triton / compiler on this machine: same math, unfused
            _fused["ok"] = False
    return _fp8_quantize_eager(x, inv_scale)


def fp8_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 cache stores and hands back: quantize with `scale`, dequantize on read."""
    return (fp8_quantize(x, 1.0 / scale).float() * scale).to(x.dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N/2, K] (rows 2r in the low nibble, 2r+1 in the high nibble, two's complement) -> int8 [N, K]."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    low = torch.where(low >= 8, low - 16, low)
    high = torch.where(high >= 8, high - 16, high)
    out = torch.stack([low, high], dim=1)  # [N/2, 2, K]
    return out.reshape(packed.shape[0] * 2, packed.shape[1]).to(torch.int8)


def _pad_rows(x: torch.Tensor, multiple: int, minimum: int = 0) -> torch.Tensor:
    rows = max(x.shape[0], minimum)
    rows = (rows + multiple - 1) // multiple * multiple
    return x if rows == x.shape[0] else torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))


class _QuantLinear(nn.Module):
    kernel = "?"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


class Fp8Linear(_QuantLinear):
    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                 bias: torch.Tensor | None, native: bool):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.native = native
        self.kernel = "torch._scaled_mm (fp8)" if native else "fp8 emulation (fp32 accumulate)"
        self.register_buffer("weight", weight)  # float8_e4m3fn [N, K], row-major
        self.register_buffer("weight_scale", weight_scale.float().reshape(()))
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.register_buffer("inv_input_scale", 1.0 / self.input_scale)
        if not native:
            self.register_buffer("weight_f32", weight.float())  # exact: every E4M3 value is an fp32 value

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq = fp8_quantize(x, self.inv_input_scale)
        if self.native:
            rows = x.shape[0]
            out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
            out = torch._scaled_mm(_pad_rows(xq, 16), self.weight.t(), scale_a=self.input_scale,
                                   scale_b=self.weight_scale, out_dtype=out_dtype)
            return out[:rows]
        return (xq.float() @ self.weight_f32.t()) * (self.input_scale * self.weight_scale)


class Int8SqLinear(_QuantLinear):
    kernel = "torch._int_mm (int8, int32 accumulate)"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                 pre_quant_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)  # int8 [N, K]; .t() is the column-major B _int_mm wants
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1))
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.register_buffer("inv_input_scale", 1.0 / self.input_scale)
        self.register_buffer("pre_quant_scale", pre_quant_scale.float().reshape(-1))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.float() * self.pre_quant_scale
        xq = torch.round(xs * self.inv_input_scale).clamp(-128, 127).to(torch.int8)
        rows = xq.shape[0]
        if xq.is_cuda:
            xq = _pad_rows(xq, 8, minimum=17)  # cuBLASLt int8 GEMM needs M > 16
        acc = torch._int_mm(xq, self.weight.t())[:rows]
        return acc.float() * (self.input_scale * self.weight_scale)


class Int4AwqLinear(_QuantLinear):
    kernel = "int4 dequantize (W4A16)"

    def __init__(self, packed: torch.Tensor, weight_scale: torch.Tensor, block: int,
                 pre_quant_scale: torch.Tensor | None, bias: torch.Tensor | None, compute_dtype: torch.dtype):
        q = unpack_int4(packed)
        super().__init__(q.shape[1], q.shape[0], bias)
        scales = weight_scale.float().repeat_interleave(block, dim=1)
        self.register_buffer("weight", (q.float() * scales).to(compute_dtype))
        self.block = block
        self.register_buffer("pre_quant_scale",
                             None if pre_quant_scale is None else pre_quant_scale.to(compute_dtype).reshape(-1))

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        return (x @ self.weight.t()).float()
