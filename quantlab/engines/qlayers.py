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

from dataclasses import dataclass, field

import torch
from torch import nn

from quantlab.checkpoint import CheckpointTensors, LayerFormat
from quantlab.engines.int4_codes import unpack_int4
from quantlab.engines.kernels.api import LinearSpec, choose
from quantlab.engines.kernels.device import KernelContext
from quantlab.engines.kernels.device import current as current_kernels
from quantlab.engines.kernels.int4.linear import PRIORITY as INT4_KERNELS
from quantlab.engines.kernels.int4.linear import w4a16
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
    """Where and how a quantized layer runs: its device, whether that device has native FP8 GEMMs, the dtype of the
    activations around it, and the kernel switches (engine.kernels, as the torch engine's build configured them)."""

    device: str
    native_fp8: bool
    compute_dtype: torch.dtype
    kernels: KernelContext = field(default_factory=current_kernels)


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
        self.shared = None  # a fusion_fp8.SharedActivation when siblings read the same activation
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
        self.choice: dict | None = None  # the kernel choice at load and every refusal's reason (from_checkpoint)
        self.siblings = None  # a fusion_int4.SiblingGemm: q/k/v fused into one GEMM (fuse_int4_siblings)
        self.sibling_index = 0
        # pre_quant_scale applied inside the op (the kernel scales x as it loads it) rather than by torch before it:
        # for layers whose input comes from an op torch.compile cannot fuse into (the attention output's projection;
        # fuse_int4_siblings sets it), where the product would otherwise be a kernel of its own
        self.pqs_in_op = False
        self.ordered = False  # k8, one row: x handed to the kernel in its input order (in_x_order; set at repack)

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, fmt, ctx):
        """int4 codes packed [N/2, K], group scales [N, K/group_size], optional pre_quant_scale [K], bias."""
        n, k, block = out_features, in_features, checked_group_size(name, in_features, fmt.group_size)
        pqs = t.optional(f"{name}.pre_quant_scale", shape=(k,))
        # the first kernel of the INT4 priority list (kernels.int4.linear) that takes this layer and engine.kernels
        # leaves on; the torch reference (dequantized once, torch's GEMM) where none does (the CPU, disabled=[all])
        choice = choose(LinearSpec("int4_awq", n, k, block, ctx.compute_dtype, pqs is not None, has_bias,
                                   ctx.device), ctx.kernels, INT4_KERNELS)
        layer = cls(t.get(f"{name}.weight", torch.uint8, (n // 2, k)),
                    cls._scale(f"{name}.weight_scale", t, (n, k // block)),
                    block, pqs, cls._bias(name, n, has_bias, t), ctx.compute_dtype,
                    packed_kernel=choice.kernel.name != "torch")
        layer.choice = choice.describe()
        return layer

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
        from quantlab.engines.kernels import device, int4

        if (self.layout != "export" or not device.allowed("int4_k8")
                or not int4.k8_supported(self.out_features, self.in_features, self.block)
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


DECODE_ROWS = 64  # up to this many rows the gate|up GEMM runs per-tensor (fp32 out), row-wise scaled above


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
