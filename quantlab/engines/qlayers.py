"""Linear layers with deployment numerics, built from exported tensors (never from the ModelOpt model), and the
registry QLAYERS: quant_algo -> layer class. Each class knows how to load itself from a checkpoint
(`from_checkpoint`) and how to give back its dequantized weight (`dequantized_weight`), so the engine, the weight
report and the audit never branch on format names.

- Fp8Linear:    W8A8 FP8 E4M3, static per-tensor scales. torch._scaled_mm on GPUs with FP8 (sm_89+), and at one
                row quantlab's FP8 GEMV (kernels.fp8) at the shapes where it was measured faster (use_fp8_gemv);
                elsewhere exact emulation: fp8 products are exact in fp32, accumulation in fp32.
- Int8SqLinear: SmoothQuant W8A8: x * pre_quant_scale, static per-tensor int8 activations, per-channel int8
                weights, int32 accumulation with torch._int_mm.
- Int4AwqLinear: W4A16: int4 with group scales along the input dimension, pre_quant_scale; packed on GPUs
                (quantlab's Triton kernel), dequantized once elsewhere.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from quantlab.checkpoint import CheckpointTensors, LayerFormat
from quantlab.engines.int4_codes import in_x_order, unpack_int4
from quantlab.errors import QuantlabError
from quantlab.registry import Registry

FP8_MAX = 448.0


def _fp8_quantize_eager(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


_fused: dict = {}


def _run_fused(name: str, eager, x: torch.Tensor, *args):
    """eager(x, *args) as one generated kernel on GPUs (torch.compile), the eager ops elsewhere.

    Compiled once per function (creating the wrapper per call costs milliseconds). Only the row count is
    dynamic: a symbolic feature dimension makes the generated kernel ~2.6x slower (measured on an H200).
    emulate_precision_casts keeps the eager ops' intermediate roundings, so fused and unfused agree bit for bit.
    Inside a region torch.compile is tracing (the decode path's compiled layers) the eager ops are returned
    as they are: the enclosing compilation fuses them with their neighbours."""
    if torch.compiler.is_compiling():
        return eager(x, *args)
    if x.is_cuda and _fused.get("ok", True):
        try:
            if name not in _fused:
                _fused[name] = torch.compile(eager, options={"emulate_precision_casts": True})
            torch._dynamo.maybe_mark_dynamic(x, 0)
            for dim in range(1, x.dim()):
                torch._dynamo.mark_static(x, dim)
            return _fused[name](x, *args)
        except Exception:  # noqa: BLE001 - no Triton / compiler on this machine: same math, unfused
            _fused["ok"] = False
    return eager(x, *args)


def fp8_quantize(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """x / scale -> E4M3 with saturation (a plain cast would turn |v| > 448 into NaN).

    On GPUs the three elementwise steps are one kernel (unfused they move ~4x the bytes and cost about as
    much as the FP8 GEMM they feed)."""
    return _run_fused("quantize", _fp8_quantize_eager, x, inv_scale)


def fp8_qdq(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 cache stores and hands back: quantize with `scale`, dequantize on read."""
    flat = x.reshape(-1, x.shape[-1])  # rows vary, the head dimension does not: one compiled kernel
    return (fp8_quantize(flat, 1.0 / scale).float() * scale).to(x.dtype).reshape(x.shape)


def checked_group_size(name: str, in_features: int, block: int | None) -> int:
    """The declared group size of a blockwise layer, which must divide its input width (exit 2 otherwise)."""
    if not block or in_features % block:
        raise QuantlabError(f"{name}: group_size {block} does not divide its input width {in_features}",
                            fix="re-export the checkpoint; its hf_quant_config.json does not match the tensors")
    return block


def _pad_rows(x: torch.Tensor, multiple: int, minimum: int = 0) -> torch.Tensor:
    rows = max(x.shape[0], minimum)
    rows = (rows + multiple - 1) // multiple * multiple
    return x if rows == x.shape[0] else torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))


def checked_scale(name: str, t: CheckpointTensors, shape: tuple) -> torch.Tensor:
    """A scale tensor of the checkpoint: present, of this shape, floating point, positive and finite."""
    value = t.get(name, shape=shape)
    if not torch.is_floating_point(value) or not torch.isfinite(value.float()).all() or (value.float() <= 0).any():
        raise QuantlabError(f"tensor {name} holds non-positive or non-finite values",
                            fix="re-export the checkpoint; calibration did not produce usable scales")
    return value


@dataclass(frozen=True)
class LayerContext:
    """Where and how a quantized layer runs: its device, whether that device has native FP8 GEMMs, and the
    dtype of the activations around it."""

    device: str
    native_fp8: bool
    compute_dtype: torch.dtype


class QuantLinear(nn.Module):
    """A Linear with deployment numerics. Subclasses implement _matmul, from_checkpoint and dequantized_weight."""

    kernel = "?"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_checkpoint(cls, name: str, out_features: int, in_features: int, has_bias: bool, t: CheckpointTensors,
                        fmt: LayerFormat, ctx: LayerContext) -> QuantLinear:
        """Build the layer `name` from the exported tensors (dtype and shape checked, scales positive and finite)."""
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """The stored weight dequantized [out, in], fp32, before the layer's pre_quant_scale buffer (if it has one; the
        engine multiplies the input by it): the weight seen by the unsmoothed input is that times pre_quant_scale."""
        raise NotImplementedError

    @staticmethod
    def _bias(name: str, out_features: int, has_bias: bool, t: CheckpointTensors) -> torch.Tensor | None:
        return t.get(f"{name}.bias", shape=(out_features,)).float() if has_bias else None

    @staticmethod
    def _scale(name: str, t: CheckpointTensors, shape: tuple) -> torch.Tensor:
        return checked_scale(name, t, shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> y [..., N] in x's dtype: the format's matmul on the rows, then the bias."""
        shape = x.shape
        y = self._matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """Widths and kernel, for print(model)."""
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


class Fp8Linear(QuantLinear):
    """FP8 E4M3 W8A8 with static per-tensor weight and input scales. torch._scaled_mm on GPUs with FP8, exact
    emulation (fp32 accumulate) elsewhere. Siblings reading one input (q/k/v) may share its quantize
    (SharedActivation)."""

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
        self.shared: SharedActivation | None = None  # set when siblings read the same activation
        self.shared_index = 0
        self.gemv = False  # one row through quantlab::fp8_gemv (use_fp8_gemv)

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, _fmt, ctx):
        """E4M3 weight [N, K], per-tensor weight_scale and input_scale, bias."""
        return cls(t.get(f"{name}.weight", torch.float8_e4m3fn, (out_features, in_features)),
                   cls._scale(f"{name}.weight_scale", t, ()), cls._scale(f"{name}.input_scale", t, ()),
                   cls._bias(name, out_features, has_bias, t), ctx.native_fp8)

    def dequantized_weight(self) -> torch.Tensor:
        """weight x weight_scale."""
        return self.weight.float() * self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> y [..., N]; siblings sharing the input share its quantize (and, natively, one GEMM)."""
        if self.shared is None:
            return super().forward(x)
        shape = x.shape  # siblings are handed the same input object: the shared quantize matches on it
        rows = x.reshape(-1, shape[-1])
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        if self.shared.weight is not None and rows.shape[0] <= DECODE_ROWS:
            y = self.shared.output(x, rows, self.shared_index, out_dtype)
        else:
            y = self.gemm(self.shared.quantize(x, rows), out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq = fp8_quantize(x, self.inv_input_scale)
        return self.gemm(xq, x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32)

    def gemm(self, xq: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """An already quantized activation [M, K] times the weight, both scales applied (fp32 when emulated)."""
        if self.native:
            rows = xq.shape[0]
            if self.gemv and rows == 1:  # the same products and fp32 sums, scaled and rounded the same way
                return torch.ops.quantlab.fp8_gemv(xq, self.weight, self.input_scale, self.weight_scale, out_dtype)
            out = torch._scaled_mm(_pad_rows(xq, 16), self.weight.t(), scale_a=self.input_scale,
                                   scale_b=self.weight_scale, out_dtype=out_dtype)
            return out[:rows]
        return (xq.float() @ self.weight_f32.t()) * (self.input_scale * self.weight_scale)


class Fp8PcPtLinear(QuantLinear):
    """FP8 E4M3 weights with one scale per output channel; activations quantized per token at run time
    (scale = amax(|x_row|) / 448, a zero row keeps scale 1). torch._scaled_mm with row-wise scales on GPUs with
    FP8, exact emulation elsewhere."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, native: bool):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.native = native
        self.kernel = ("torch._scaled_mm (fp8, row-wise scales)" if native
                       else "fp8 per-token emulation (fp32 accumulate)")
        self.register_buffer("weight", weight)  # float8_e4m3fn [N, K]
        self.register_buffer("weight_scale", weight_scale.float().reshape(1, -1))
        if not native:
            self.register_buffer("weight_f32", weight.float())

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, _fmt, ctx):
        """E4M3 weight [N, K] with one weight_scale per output channel, bias."""
        return cls(t.get(f"{name}.weight", torch.float8_e4m3fn, (out_features, in_features)),
                   cls._scale(f"{name}.weight_scale", t, (out_features,)), cls._bias(name, out_features, has_bias, t),
                   ctx.native_fp8)

    def dequantized_weight(self) -> torch.Tensor:
        """weight x its output channel's scale."""
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.float().abs().amax(-1, keepdim=True)
        amax = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
        inv = FP8_MAX / amax
        xq = (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if self.native:
            rows = xq.shape[0]
            out = torch._scaled_mm(_pad_rows(xq, 16), self.weight.t(), scale_a=_pad_rows(1.0 / inv, 16),
                                   scale_b=self.weight_scale, out_dtype=torch.bfloat16)
            return out[:rows].float()
        return (xq.float() @ self.weight_f32.t()) * (1.0 / inv) * self.weight_scale


class Int8SqLinear(QuantLinear):
    """SmoothQuant W8A8: the input times pre_quant_scale, rounded to int8 with a static per-tensor scale; int8
    weights with one scale per output channel; int32 accumulation with torch._int_mm."""

    kernel = "torch._int_mm (int8, int32 accumulate)"

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
                 pre_quant_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)  # int8 [N, K]; .t() is the column-major B _int_mm wants
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1))
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.register_buffer("inv_input_scale", 1.0 / self.input_scale)
        self.register_buffer("pre_quant_scale", pre_quant_scale.float().reshape(-1))

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, _fmt, _ctx):
        """int8 weight [N, K], per-channel weight_scale, per-tensor input_scale, pre_quant_scale [K], bias."""
        n, k = out_features, in_features
        return cls(t.get(f"{name}.weight", torch.int8, (n, k)), cls._scale(f"{name}.weight_scale", t, (n,)),
                   cls._scale(f"{name}.input_scale", t, ()), cls._scale(f"{name}.pre_quant_scale", t, (k,)),
                   cls._bias(name, n, has_bias, t))

    def dequantized_weight(self) -> torch.Tensor:
        """weight x its output channel's scale (before pre_quant_scale)."""
        return self.weight.float() * self.weight_scale[:, None]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.float() * self.pre_quant_scale
        xq = torch.round(xs * self.inv_input_scale).clamp(-128, 127).to(torch.int8)
        rows = xq.shape[0]
        if xq.is_cuda:
            xq = _pad_rows(xq, 8, minimum=17)  # cuBLASLt int8 GEMM needs M > 16
        acc = torch._int_mm(xq, self.weight.t())[:rows]
        return acc.float() * (self.input_scale * self.weight_scale)


class Int4AwqLinear(QuantLinear):
    """AWQ W4A16: int4 weights (packed two per byte along the output dimension) with one scale per group of
    `block` inputs, held in the compute dtype as W4A16 kernels take them. The input is multiplied by
    pre_quant_scale when the checkpoint has one; each weight is q * scale rounded to the compute dtype and the GEMM
    accumulates in fp32.

    On GPUs (where Triton is) the weights stay packed - N*K/2 bytes - and quantlab's W4A16 kernel
    (quantlab.engines.kernels.int4) dequantizes them in registers; elsewhere they are dequantized once at load
    into the compute dtype and the GEMM is torch's. Both compute the same values."""

    def __init__(self, packed: torch.Tensor, weight_scale: torch.Tensor, block: int,
                 pre_quant_scale: torch.Tensor | None, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                 packed_kernel: bool = False):
        super().__init__(packed.shape[1], packed.shape[0] * 2, bias)
        self.block = block
        scales = weight_scale.to(compute_dtype)
        self.packed_kernel = packed_kernel
        self.layout = "dense"
        if packed_kernel:
            from quantlab.engines.kernels import int4  # noqa: F401 - registers quantlab's W4A16 ops

            self.kernel = "triton int4 GEMM (W4A16, weights kept packed: export layout)"
            self.layout = "export"
            self.register_buffer("weight_packed", packed.contiguous())  # uint8 [N/2, K]; k8: int32 [N, K/8]
            self.register_buffer("weight_scale", scales.contiguous())  # [N, K/block]; k8: [K/block, N]
            self.weight = None
        else:
            self.kernel = "int4 dequantize (W4A16)"
            q = unpack_int4(packed)
            self.register_buffer("weight", (q.float() * scales.float().repeat_interleave(block, dim=1))
                                 .to(compute_dtype))
        self.register_buffer("pre_quant_scale",
                             None if pre_quant_scale is None else pre_quant_scale.to(compute_dtype).reshape(-1))
        self.siblings: SiblingGemm | None = None  # q/k/v fused into one GEMM (fuse_int4_siblings)
        self.sibling_index = 0
        # pre_quant_scale applied inside the op (the kernel scales x as it loads it) rather than by torch before it:
        # for layers whose input comes from an op torch.compile cannot fuse into (the attention output's projection;
        # fuse_int4_siblings sets it), where the product would otherwise be a kernel of its own
        self.pqs_in_op = False
        self.ordered = False  # k8, one row: x handed to the kernel in its input order (in_x_order; set at repack)

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, fmt, ctx):
        """int4 codes packed [N/2, K], group scales [N, K/group_size], optional pre_quant_scale [K], bias."""
        from quantlab.engines.kernels import int4

        n, k, block = out_features, in_features, checked_group_size(name, in_features, fmt.group_size)
        pqs = t.optional(f"{name}.pre_quant_scale", shape=(k,))
        return cls(t.get(f"{name}.weight", torch.uint8, (n // 2, k)),
                   cls._scale(f"{name}.weight_scale", t, (n, k // block)),
                   block, pqs, cls._bias(name, n, has_bias, t), ctx.compute_dtype,
                   packed_kernel=ctx.device.startswith("cuda") and int4.available())

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as dequantized at load (before pre_quant_scale)."""
        if self.layout == "k8":
            from quantlab.engines.kernels import int4

            return int4.k8_dequantized(self.weight_packed, self.weight_scale, self.block).float()
        if self.packed_kernel:
            scales = self.weight_scale.float().repeat_interleave(self.block, dim=1)
            return (unpack_int4(self.weight_packed).float() * scales).to(self.weight_scale.dtype).float()
        return self.weight.float()

    def repack(self) -> bool:
        """Rewrite the packed codes and scales into the k8 layout the split-K kernels read (on their device, once),
        where those kernels take this layer and passed their check on the device; returns whether it did."""
        from quantlab.engines.kernels import int4

        if (self.layout != "export" or not int4.k8_supported(self.out_features, self.in_features, self.block)
                or not int4.k8_usable(str(self.weight_packed.device), self.weight_scale.dtype)):
            return False
        self.weight_packed, self.weight_scale = int4.repack(self.weight_packed, self.weight_scale)
        self.layout = "k8"
        device, dtype = self.weight_packed.device, self.weight_scale.dtype
        self.ordered = int4.ordered_on(device, dtype) and int4.mma_applies(1, self.out_features, self.in_features,
                                                                           self.block, dtype)
        self.kernel = int4.k8_kernels(str(self.weight_packed.device), self.weight_scale.dtype)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> y [..., N]: q/k/v siblings share one GEMM (SiblingGemm), others their own."""
        if self.siblings is None:
            return super().forward(x)
        shape = x.shape  # one GEMM for q/k/v: the siblings are handed the same input object
        y = self.siblings.output(x, x.reshape(-1, shape[-1]), self.sibling_index).float()
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_kernel:
            return w4a16(x, self.weight_packed, self.weight_scale, self.pre_quant_scale, self.block,
                         self.pqs_in_op, self.ordered).float()
        x = x.to(self.weight.dtype)
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        return (x @ self.weight.t()).float()


QLAYERS: Registry[type[QuantLinear]] = Registry("quantized layer format", "a checkpoint's quant_algo")
QLAYERS.add("FP8", Fp8Linear)
QLAYERS.add("W8A8_SQ_PER_CHANNEL", Int8SqLinear)
QLAYERS.add("FP8_PER_CHANNEL_PER_TOKEN", Fp8PcPtLinear)
QLAYERS.add("W4A16_AWQ", Int4AwqLinear)


def plain_linear(t: CheckpointTensors, name: str, out_features: int, in_features: int, dtype, device) -> nn.Linear:
    """An unquantized Linear read from the checkpoint (an expert projection the export left in high precision)."""
    layer = nn.Linear(in_features, out_features, bias=f"{name}.bias" in t, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(t.get(f"{name}.weight", shape=(out_features, in_features)))
        if layer.bias is not None:
            layer.bias.copy_(t.get(f"{name}.bias", shape=(out_features,)))
    return layer.requires_grad_(False)


# ------------------------------------------------------------------------------- shared-input fusion
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
            held = (x, fp8_quantize(rows, self.inv_scale), self.siblings)
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
            xq = fp8_quantize(rows, self.inv_scale)
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


DECODE_ROWS = 64  # up to this many rows the gate|up GEMM runs per-tensor (fp32 out), row-wise scaled above


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
        xq = fp8_quantize(x2, self.inv_input_scale)
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


# ------------------------------------------------------------------------------- W4A16 sibling fusion
def w4a16(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
          block: int, pqs_in_op: bool = False, ordered: bool = False) -> torch.Tensor:
    """The packed W4A16 GEMM on x [M, K] in the scales' dtype -> [M, N] in that dtype: quantlab::w4a16_k8 on the
    k8 layout (int32 codes), quantlab::w4a16_mm on the export layout (uint8 codes). k8: pre_quant_scale multiplies
    x before the op (torch.compile fuses it into the producer, a norm or the activation), or inside it where
    pqs_in_op (the same product, rounded once to the compute dtype). One row where `ordered` (set at repack where
    the tensor-core kernel runs): x in the kernel's input order (in_x_order: views torch.compile folds into the
    producer) and quantlab::w4a16_k8_ordered (the same sums)."""
    if packed.dtype == torch.int32:
        x = x.to(scales.dtype)
        if pqs is not None and not pqs_in_op:
            x, pqs = x * pqs, None
        if ordered and pqs is None and x.shape[0] == 1:
            return torch.ops.quantlab.w4a16_k8_ordered(in_x_order(x), packed, scales, block)
        return torch.ops.quantlab.w4a16_k8(x, packed, scales, pqs, block)
    return torch.ops.quantlab.w4a16_mm(x.to(scales.dtype), packed, scales, pqs, block)


def _cat_packed(layers: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed siblings' codes and scales concatenated along the outputs (both layouts; k8 scales are [K/g, N])."""
    k8 = layers[0].layout == "k8"
    return (torch.cat([m.weight_packed for m in layers]),
            torch.cat([m.weight_scale for m in layers], dim=1 if k8 else 0))


class SiblingGemm:
    """Packed W4A16 siblings reading one input (q/k/v, one pre_quant_scale after export's resmoothing) as one GEMM
    over their concatenated codes and scales: the first sibling called computes every output, the others take
    theirs, matched by input identity as SharedActivation matches. Each output is the same dot product, in the
    same order, as its own layer's GEMM (the kernels tile N, never K, across programs): one launch, wider N,
    identical values (the k8 kernels: where the wider N is given the same configuration - split and mode - as each
    layer's own; another split only reorders the fp32 accumulation). The siblings' codes and scales are views into
    the concatenation (no copy is kept)."""

    def __init__(self, layers: list[Int4AwqLinear]):
        self.packed, self.scales = _cat_packed(layers)
        self.pqs, self.block, self.ordered = layers[0].pre_quant_scale, layers[0].block, layers[0].ordered
        self.bounds, start = [], 0
        k8 = layers[0].layout == "k8"
        for m in layers:
            end = start + m.out_features
            self.bounds.append((start, end))
            m.weight_packed = self.packed[start: end] if k8 else self.packed[start // 2: end // 2]
            m.weight_scale = self.scales[:, start: end] if k8 else self.scales[start: end]
            start = end
        self.count = len(layers)
        self._held = None  # (the input object, the fused output, takers left)

    def output(self, x: torch.Tensor, rows: torch.Tensor, index: int) -> torch.Tensor:
        """Sibling `index`'s output for input x (rows: x as [M, K]): one GEMM for every sibling, held until each
        took its columns."""
        held = self._held
        if held is None or held[0] is not x:
            held = (x, w4a16(rows, self.packed, self.scales, self.pqs, self.block, ordered=self.ordered), self.count)
        left = held[2] - 1
        self._held = None if left == 0 else (held[0], held[1], left)
        lo, hi = self.bounds[index]
        return held[1][:, lo:hi]


class Int4GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with packed W4A16 gate/up as one GEMM over their concatenated codes (the same
    values as the two layers', see SiblingGemm), then the activation and product in the compute dtype as the
    modeling code computes them, then down.

    Where the activation is SiLU and the one-row tensor-core kernel reads x in its input order here (gate.ordered), the
    gate|up rows are interleaved (int4.interleave_gated) and one row runs the kernel's gated epilogue
    (quantlab::w4a16_k8_gated: silu(gate) * up, times down's pre_quant_scale, in down's input order), then down's GEMM
    on that as is; more rows take the plain GEMM's output apart (int4.deinterleave_gated). QUANTLAB_INT4_EPILOGUE=0
    keeps the rows and the activation as they are."""

    @property
    def layout(self) -> str:
        """k8 (int32 codes) or export (uint8 codes)."""
        return "k8" if self.weight_packed.dtype == torch.int32 else "export"

    def __init__(self, gate: Int4AwqLinear, up: Int4AwqLinear, down: nn.Module, act_fn):
        super().__init__()
        packed, scales = _cat_packed([gate, up])
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scales)
        self.register_buffer("pre_quant_scale", gate.pre_quant_scale)
        self.block, self.inter, self.ordered = gate.block, gate.out_features, gate.ordered
        self.down, self.act_fn = down, act_fn
        self.kernel = f"{gate.kernel}: gate|up one GEMM, down"
        self.gated = self._gated_epilogue(gate, down)
        if self.gated:
            from quantlab.engines.kernels import int4

            self.weight_packed, self.weight_scale = int4.interleave_gated(self.weight_packed, self.weight_scale)
            self.kernel = f"{gate.kernel}: gate|up one GEMM (one row: SiLU * up in its epilogue), down"

    def _gated_epilogue(self, gate: Int4AwqLinear, down: nn.Module) -> bool:
        """Whether one row takes the gated epilogue: the input-order kernels here (gate.ordered: k8 layout, a 16-bit
        dtype, the tensor-core kernel checked), the switch on, 8-row groups, an activation that computes SiLU (probed:
        its values equal torch's silu over [-20, 20]), and a down projection that is a packed k8 layer reading its input
        as given (no bias, its pre_quant_scale not in its op)."""
        from quantlab.engines.kernels import cuda_rtc

        if not gate.ordered or self.inter % 8 or not cuda_rtc.switch("QUANTLAB_INT4_EPILOGUE"):
            return False
        if not (isinstance(down, Int4AwqLinear) and down.layout == "k8" and down.bias is None and not down.pqs_in_op
                and down.in_features == self.inter):
            return False
        probe = torch.linspace(-20, 20, 4097, device=self.weight_scale.device).to(self.weight_scale.dtype)
        with torch.no_grad():
            return bool(torch.equal(self.act_fn(probe), nn.functional.silu(probe)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)), gate|up one packed GEMM."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.gated and rows.shape[0] == 1:
            return self._gated_row(rows).to(x.dtype).reshape(*shape[:-1], -1)
        y = w4a16(rows, self.weight_packed, self.weight_scale, self.pre_quant_scale, self.block, ordered=self.ordered)
        y = y.to(x.dtype)
        if self.gated:
            from quantlab.engines.kernels import int4

            gate, up = int4.deinterleave_gated(y)
        else:
            gate, up = y[:, : self.inter], y[:, self.inter:]
        h = self.act_fn(gate) * up
        return self.down(h).reshape(*shape[:-1], -1)

    def _gated_row(self, rows: torch.Tensor) -> torch.Tensor:
        """One row: gate|up with the gated epilogue writing down's input (scaled, in down's input order where it reads
        that), then down's GEMM."""
        down = self.down
        x = rows.to(self.weight_scale.dtype)
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        h = torch.ops.quantlab.w4a16_k8_gated(in_x_order(x), self.weight_packed, self.weight_scale,
                                              down.pre_quant_scale, self.block, down.ordered)
        if down.ordered:
            y = torch.ops.quantlab.w4a16_k8_ordered(h, down.weight_packed, down.weight_scale, down.block)
        else:
            y = torch.ops.quantlab.w4a16_k8(h, down.weight_packed, down.weight_scale, None, down.block)
        return y.float()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def repack_int4(model: nn.Module) -> int:
    """Every packed W4A16 layer rewritten into the k8 layout (Int4AwqLinear.repack); returns how many were."""
    return sum(m.repack() for m in list(model.modules()) if isinstance(m, Int4AwqLinear))


def fuse_int4_siblings(model: nn.Module) -> int:
    """Packed W4A16 layers are first repacked into the k8 layout (repack_int4); then layers reading one input
    become one GEMM: q/k/v (SiblingGemm) and gated MLPs (Int4GatedMLP), where the layers share their layout, group
    size and pre_quant_scale and have no bias; an attention block's output projection (o_proj / out_proj / dense)
    multiplies by its pre_quant_scale inside the op (pqs_in_op). Returns the groups fused."""
    repack_int4(model)
    fused = 0
    for name, module in list(model.named_modules()):
        qkv = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if (all(isinstance(m, Int4AwqLinear) and m.packed_kernel and m.bias is None for m in qkv)
                and len({(m.block, m.layout) for m in qkv}) == 1
                and all(_same(m.pre_quant_scale, qkv[0].pre_quant_scale) for m in qkv)):
            group = SiblingGemm(qkv)
            for i, m in enumerate(qkv):
                m.siblings, m.sibling_index = group, i
            fused += 1
        if any(isinstance(m, Int4AwqLinear) for m in qkv):  # an attention block: its output projection reads the
            for out_name in ("o_proj", "out_proj", "dense"):  # attention op's output (opaque to torch.compile)
                out = getattr(module, out_name, None)
                if isinstance(out, Int4AwqLinear) and out.layout == "k8" and out.pre_quant_scale is not None:
                    out.pqs_in_op = True
        gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        act = getattr(module, "act_fn", None)
        if (all(isinstance(m, Int4AwqLinear) and m.packed_kernel and m.bias is None for m in (gate, up))
                and isinstance(down, nn.Module) and act is not None
                and (gate.block, gate.layout) == (up.block, up.layout)
                and _same(gate.pre_quant_scale, up.pre_quant_scale) and getattr(down, "bias", None) is None):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child,
                    Int4GatedMLP(gate, up, down, act))
            fused += 1
    return fused


# ------------------------------------------------------------------------------- 4-bit formats with FP8 / FP4 parts
class W4A8AwqLinear(QuantLinear):
    """W4A8 AWQ: int4 weights with one scale per group of `group_size` inputs (weight_scale [out, in/G]), whose
    dequantized values are held in FP8 E4M3 under a per-tensor scale (weight_scale_2), static per-tensor FP8
    activations (input_scale) and, where export could not fold it into a norm, a pre_quant_scale [in].

    What ModelOpt 0.47 exports and simulates (its weight quantizer is int4-per-group followed by FP8-per-tensor):
    W = e4m3(int4 * weight_scale / weight_scale_2) * weight_scale_2 and x -> fp8_qdq(x * pre_quant_scale,
    input_scale). The int4 codes are packed two per byte along the output dimension, as for W4A16_AWQ.
    torch._scaled_mm on GPUs with FP8; elsewhere exact emulation (fp8 products are exact in fp32)."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale_2: torch.Tensor, input_scale: torch.Tensor,
                 pre_quant_scale: torch.Tensor | None, bias: torch.Tensor | None, native: bool):
        super().__init__(weight_fp8.shape[1], weight_fp8.shape[0], bias)
        self.native = native
        self.kernel = ("torch._scaled_mm (fp8; int4 weights held in fp8)" if native
                       else "w4a8 emulation (int4 weights in fp8, fp32 accumulate)")
        self.register_buffer("weight", weight_fp8)  # float8_e4m3fn [N, K]
        self.register_buffer("weight_scale_2", weight_scale_2.float().reshape(()))
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.register_buffer("inv_input_scale", 1.0 / self.input_scale)
        self.register_buffer("pre_quant_scale", None if pre_quant_scale is None else
                             pre_quant_scale.float().reshape(-1))
        if not native:
            self.register_buffer("weight_f32", weight_fp8.float())

    @staticmethod
    def fp8_weight(packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
        """int4 codes [N/2, K] packed along N, group scales [N, K/G], per-tensor FP8 scale -> E4M3 [N, K]."""
        q = unpack_int4(packed)
        block = q.shape[1] // weight_scale.shape[1]
        w = q.float() * weight_scale.float().repeat_interleave(block, dim=1)
        return _fp8_quantize_eager(w, 1.0 / weight_scale_2.float())

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, fmt, ctx):
        """int4 codes packed [N/2, K], group scales, per-tensor weight_scale_2 and input_scale, optional
        pre_quant_scale, bias."""
        n, k, block = out_features, in_features, checked_group_size(name, in_features, fmt.group_size)
        packed = t.get(f"{name}.weight", torch.uint8, (n // 2, k))
        scale = cls._scale(f"{name}.weight_scale", t, (n, k // block))
        scale_2 = cls._scale(f"{name}.weight_scale_2", t, ())
        pqs = t.optional(f"{name}.pre_quant_scale", shape=(k,))
        if pqs is not None:
            pqs = cls._scale(f"{name}.pre_quant_scale", t, (k,))
        return cls(cls.fp8_weight(packed, scale, scale_2), scale_2, cls._scale(f"{name}.input_scale", t, ()), pqs,
                   cls._bias(name, n, has_bias, t), ctx.native_fp8)

    def dequantized_weight(self) -> torch.Tensor:
        """The FP8-held weight x weight_scale_2."""
        return self.weight.float() * self.weight_scale_2

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        if self.pre_quant_scale is not None:
            x = x.float() * self.pre_quant_scale
        xq = fp8_quantize(x, self.inv_input_scale)
        if self.native:
            rows = xq.shape[0]
            out = torch._scaled_mm(_pad_rows(xq, 16), self.weight.t(), scale_a=self.input_scale,
                                   scale_b=self.weight_scale_2, out_dtype=out_dtype)
            return out[:rows]
        return (xq.float() @ self.weight_f32.t()) * (self.input_scale * self.weight_scale_2)


def _positive(name: str, value: torch.Tensor) -> torch.Tensor:
    """checked_scale's value test for a scale read with its dtype checked too."""
    if not torch.isfinite(value.float()).all() or (value.float() <= 0).any():
        raise QuantlabError(f"tensor {name} holds non-positive or non-finite values",
                            fix="re-export the checkpoint; calibration did not produce usable scales")
    return value


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the 3 low bits of an E2M1 code; bit 3 = sign
E2M1_MAX = 6.0
NVFP4_BLOCK = 16


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (0..15, bit 3 the sign) -> float32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest E2M1 value (saturating at +-6); a tie goes to the value with the even code, as
    ModelOpt's FP4 fake quantization rounds (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)."""
    grid = torch.tensor(E2M1_VALUES, device=x.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    mag = x.abs()
    index = torch.bucketize(mag, midpoints)  # midpoints[i-1] < mag <= midpoints[i]: a tie goes down ...
    odd_tie = torch.isin(mag, midpoints[1::2])  # ... except onto an odd code (0.5, 1.5, 3): then up
    return torch.copysign(grid[index + odd_tie.long()], x)


def nvfp4_qdq(x: torch.Tensor, global_scale: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """Dynamic NVFP4 activation quantize + dequantize: per block of `block` values along the last dimension, a scale
    e4m3(block_amax / 6 / global_scale) * global_scale (global_scale = the exported input_scale = amax / 2688), then
    E2M1 values times it. Scales below 1e-5 become 1.0, as in ModelOpt's fake quantization."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    scale = (amax / (E2M1_MAX * global_scale)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float() * global_scale
    scale = torch.where(scale >= 1e-5, scale, torch.ones_like(scale))
    return (e2m1_round(xb / scale) * scale).reshape(shape)


class Nvfp4Linear(QuantLinear):
    """NVFP4 W4A4: E2M1 weights packed two per byte along the input dimension (even column in the low nibble),
    one FP8 E4M3 scale per block of 16 inputs (weight_scale [out, in/16]) times a per-tensor weight_scale_2;
    activations quantized at run time per block of 16 with the exported input_scale as their global scale.
    Emulated in fp32 (real FP4 GEMMs need Blackwell); the dequantized weight is exact."""

    kernel = "nvfp4 emulation (e2m1 x fp8 block scales, fp32 accumulate)"

    def __init__(self, weight: torch.Tensor, input_scale: torch.Tensor, pre_quant_scale: torch.Tensor | None,
                 bias: torch.Tensor | None, block: int):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.block = block
        self.register_buffer("weight", weight)  # dequantized fp32 [N, K]
        self.register_buffer("input_scale", input_scale.float().reshape(()))
        self.register_buffer("pre_quant_scale", None if pre_quant_scale is None else
                             pre_quant_scale.float().reshape(-1))

    @staticmethod
    def dequantize(packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
        """uint8 [N, K/2] codes, E4M3 [N, K/B] block scales, fp32 per-tensor scale -> fp32 [N, K]."""
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        block = codes.shape[1] // weight_scale.shape[1]
        scales = weight_scale.float().repeat_interleave(block, dim=1) * weight_scale_2.float()
        return e2m1_decode(codes) * scales

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, fmt, _ctx):
        """E2M1 codes packed [N, K/2], E4M3 block scales [N, K/16], weight_scale_2, input_scale, optional
        pre_quant_scale, bias."""
        n, k, block = out_features, in_features, fmt.group_size or NVFP4_BLOCK
        if k % block or k % 2:
            raise QuantlabError(f"{name}: NVFP4 group_size {block} does not divide its input width {k}",
                                fix="re-export the checkpoint; its hf_quant_config.json does not match the tensors")
        packed = t.get(f"{name}.weight", torch.uint8, (n, k // 2))
        scale = _positive(f"{name}.weight_scale", t.get(f"{name}.weight_scale", torch.float8_e4m3fn, (n, k // block)))
        scale_2 = cls._scale(f"{name}.weight_scale_2", t, ())
        pqs = t.optional(f"{name}.pre_quant_scale", shape=(k,))
        if pqs is not None:
            pqs = cls._scale(f"{name}.pre_quant_scale", t, (k,))
        return cls(cls.dequantize(packed, scale, scale_2), cls._scale(f"{name}.input_scale", t, ()), pqs,
                   cls._bias(name, n, has_bias, t), block)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as dequantized at load (exact)."""
        return self.weight

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        return nvfp4_qdq(x, self.input_scale, self.block) @ self.weight.t()


QLAYERS.add("W4A8_AWQ", W4A8AwqLinear)
QLAYERS.add("NVFP4", Nvfp4Linear)
