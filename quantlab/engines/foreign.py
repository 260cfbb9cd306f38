"""Linear layers of checkpoints made by other tools, registered in QLAYERS beside ModelOpt's formats: each reads its
format's tensors (dtypes and shapes checked, scales positive and finite), dequantizes the weight once the way that
format's own loader does, and applies the activation quantization the format declares at run time.

- compressed-tensors (llm-compressor's save_compressed):
  CT_FP8 / CT_INT8   weight F8_E4M3 / I8 [out, in] with per-tensor, per-channel, per-group or per-block scales (and
                     zero points when asymmetric): W = (q - z) * s in the scales' dtype;
  CT_PACKED_INT*     weight_packed I32 [out, in * bits / 32] (codes + 2^(bits-1), dense little-endian along the input
                     dimension), weight_scale [out, groups], weight_zero_point packed the same way along the output
                     dimension (asymmetric only), weight_shape [out, in];
  activations        dynamic per token: s = absmax / (range / 2) (int8: / 127.5, fp8 e4m3: / 448), x / s clamped and
                     rounded (int: half to even; fp8: cast to e4m3), times s; static per tensor: s = input_scale.
- GPTQ (GPTQModel / AutoGPTQ) GPTQ_INT*: qweight I32 [in * bits / 32, out] (fields little-endian along the input
  dimension), qzeros I32 [groups, out * bits / 32] along the output dimension (v1 stores z - 1), scales F16
  [groups, out], g_idx I32 [in] (act-order: the group of every input column): W = (q - z[g]) * s[g] in f16.
- AWQ GEMM (AutoAWQ, GPTQModel format "gemm") AWQ_GEMM_INT4: qweight I32 [in, out / 8] and qzeros I32
  [groups, out / 8] with the nibbles of each word interleaved (0, 2, 4, 6, 1, 3, 5, 7), scales F16 [groups, out]:
  W = (q - z) * s in f16.
- GGUF GGUF_<TYPE>: rows of ggml blocks (quantlab.formats.ggml) dequantized in float32.

Weights are held dequantized in the compute dtype; activations stay in it (weight-only formats) or are fake-quantized
as the format's runtime does. Every class says what the audit holds it to (`audit_bounds`)."""
from __future__ import annotations

import torch

from quantlab.checkpoint import CheckpointTensors
from quantlab.engines.qlayers import QLAYERS, QuantLinear, checked_group_size
from quantlab.errors import QuantlabError
from quantlab.formats import ggml
from quantlab.formats.base import ForeignLayer
from quantlab.formats.packing import AWQ_ORDER, unpack
from quantlab.precisions import PRECISIONS, AuditBounds, CanaryBounds, WeightBounds

FP8_MAX = 448.0
BOUNDS_8 = PRECISIONS["int8_sq"].audit
BOUNDS_FP8 = PRECISIONS["fp8"].audit
BOUNDS_4 = PRECISIONS["int4_awq"].audit
# 2- and 3-bit GGUF K-quants: only gross damage is an error (no healthy measurement on a real model here)
BOUNDS_LOW = AuditBounds(WeightBounds(cosine_error=0.9, sqnr_error_db=6.0, sqnr_warn_db=8.0),
                         CanaryBounds(top1_error=0.4, top1_warn=0.55, kl_error=1.5, kl_warn=0.8))


# weights processed by GPTQ (error compensation moves each weight further from the reference than rounding does):
# healthy llm-compressor W4A16 GPTQ g64 on SmolLM2-135M has layers down to cosine 0.9495 / 9.7 dB (two outlier
# down_proj layers), RTN and AWQ exports stay above 0.97 / 12 dB; damaged layers measured here sit far lower
# (interleave lost: cosine 0.28)
BOUNDS_GPTQ = AuditBounds(WeightBounds(cosine_error=0.90, sqnr_error_db=7.0,
                                       sqnr_warn_db=BOUNDS_4.weights.sqnr_warn_db), BOUNDS_4.canary)


def _bounds_for_bits(bits: float, gptq: bool = False) -> AuditBounds:
    if gptq and 2 < bits < 8:
        return BOUNDS_GPTQ
    return BOUNDS_8 if bits >= 8 else BOUNDS_4 if bits >= 4 else BOUNDS_LOW


# --------------------------------------------------------------------------------------- activations
class ActivationQuant:
    """compressed-tensors' activation quantize-dequantize: int or fp8 codes of `bits`, symmetric, with a scale per
    token computed at run time (dynamic) or the checkpoint's input_scale (static)."""

    def __init__(self, kind: str, act_type: str, bits: int, scale: torch.Tensor | None = None):
        self.kind, self.act_type, self.bits = kind, act_type, bits
        if act_type == "float":
            self.qmin, self.qmax, self.half_range = -FP8_MAX, FP8_MAX, FP8_MAX
        else:
            self.qmin, self.qmax = -(2.0 ** (bits - 1)), 2.0 ** (bits - 1) - 1
            self.half_range = (self.qmax - self.qmin) / 2  # int8: 127.5, as the library divides
        self.scale = scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x quantized and dequantized: x / s clamped to the code range, rounded (int) or cast to e4m3, times s."""
        if self.kind == "dynamic_token":
            amax = x.abs().amax(dim=-1, keepdim=True)
            scale = amax / self.half_range
            scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype, device=x.device),
                                scale)
        else:
            scale = self.scale.to(x.dtype)
        y = (x / scale).clamp(self.qmin, self.qmax)
        y = y.to(torch.float8_e4m3fn).to(x.dtype) if self.act_type == "float" else torch.round(y)
        return y * scale

    def describe(self) -> str:
        """fp8 per-token (dynamic), int8 per-tensor (static), ..."""
        what = "fp8" if self.act_type == "float" else f"int{self.bits}"
        return f"{what} {'per-token dynamic' if self.kind == 'dynamic_token' else 'per-tensor static'}"


def _activation(name: str, fmt: ForeignLayer, t: CheckpointTensors) -> ActivationQuant | None:
    if fmt.activations is None:
        return None
    scale = None
    if fmt.activations == "static_tensor":
        scale = QuantLinear._scale(f"{name}.input_scale", t, t.shape_of(f"{name}.input_scale") or ()).float()
        if scale.numel() != 1:
            raise QuantlabError(f"tensor {name}.input_scale has {scale.numel()} values, a per-tensor scale has 1",
                                fix="the checkpoint's activation scheme is not the one its config declares")
        scale = scale.reshape(())
    return ActivationQuant(fmt.activations, fmt.act_type, fmt.act_bits, scale)


class ForeignLinear(QuantLinear):
    """A format's weight dequantized once at load into the compute dtype; activations as the format's runtime treats
    them (unchanged for weight-only formats)."""

    audit_bounds: AuditBounds = BOUNDS_4
    marker = "weight_scale"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                 act: ActivationQuant | None, kernel: str):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight.to(compute_dtype))
        self.act = act
        self.kernel = kernel + (f", {act.describe()} activations" if act else ", weight-only")

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as dequantized at load (fp32)."""
        return self.weight.float()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.act is not None:
            x = self.act(x)
        return (x @ self.weight.t()).float()


# --------------------------------------------------------------------------------------- compressed-tensors
def _expand(values: torch.Tensor, out_f: int, in_f: int, fmt: ForeignLayer) -> torch.Tensor:
    """Scales or zero points of a strategy broadcast to the weight's [out, in]."""
    if fmt.strategy == "tensor":
        return values.reshape(1, 1)
    if fmt.strategy == "channel":
        return values.reshape(out_f, 1)
    if fmt.strategy == "group":
        return values.repeat_interleave(fmt.group_size, dim=1)
    rows, cols = fmt.block
    return values.repeat_interleave(rows, dim=0)[:out_f].repeat_interleave(cols, dim=1)[:, :in_f]


def ct_scale_shape(out_f: int, in_f: int, fmt: ForeignLayer) -> tuple[int, ...]:
    """The weight_scale shape compressed-tensors writes for a strategy."""
    if fmt.strategy == "tensor":
        return (1,)
    if fmt.strategy == "channel":
        return (out_f, 1)
    if fmt.strategy == "group":
        return (out_f, in_f // fmt.group_size)
    rows, cols = fmt.block
    return (-(-out_f // rows), -(-in_f // cols))


def _ct_scale(name: str, out_f: int, in_f: int, fmt: ForeignLayer, t: CheckpointTensors) -> torch.Tensor:
    if fmt.strategy == "group":
        checked_group_size(name, in_f, fmt.group_size)
    shape = ct_scale_shape(out_f, in_f, fmt)
    if fmt.strategy == "tensor" and t.shape_of(f"{name}.weight_scale") == ():
        shape = ()
    return QuantLinear._scale(f"{name}.weight_scale", t, shape)


class CtQuantizedLinear(ForeignLinear):
    """compressed-tensors float-quantized (FP8 E4M3) or int-quantized (INT8) weights, one code per weight."""

    code_dtype = torch.int8
    family = "int"

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, fmt, ctx):
        """weight [out, in] codes, weight_scale of the declared strategy, weight_zero_point when asymmetric."""
        q = t.get(f"{name}.weight", cls.code_dtype, (out_features, in_features))
        scale = _ct_scale(name, out_features, in_features, fmt, t)
        w = q.to(scale.dtype)
        if not fmt.symmetric:
            zero = t.get(f"{name}.weight_zero_point", shape=tuple(scale.shape))
            w = w - _expand(zero.to(scale.dtype), out_features, in_features, fmt)
        w = w * _expand(scale, out_features, in_features, fmt)
        return cls(w, cls._bias(name, out_features, has_bias, t), ctx.compute_dtype, _activation(name, fmt, t),
                   f"compressed-tensors {cls.family}-quantized ({fmt.strategy} scales), dequantized once")


class CtFp8Linear(CtQuantizedLinear):
    """compressed-tensors float-quantized: FP8 E4M3 weights."""

    code_dtype = torch.float8_e4m3fn
    family = "float"
    audit_bounds = BOUNDS_FP8


class CtInt8Linear(CtQuantizedLinear):
    """compressed-tensors int-quantized: INT8 weights."""

    audit_bounds = BOUNDS_8


def unpack_dense(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' dense packing along the last dimension: element i of a row at bit i * bits of the row's
    words (little-endian), `count` elements per row, unsigned."""
    if 32 % bits == 0:
        return unpack(packed, bits, 1)[:, :count]
    words = packed.to(torch.int64) & 0xFFFFFFFF
    stream = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int64)) & 1).to(torch.uint8)
    stream = stream.reshape(packed.shape[0], -1)[:, : count * bits].reshape(packed.shape[0], count, bits)
    return (stream.to(torch.int32) << torch.arange(bits, dtype=torch.int32)).sum(-1, dtype=torch.int32)


class CtPackedLinear(ForeignLinear):
    """compressed-tensors pack-quantized: int codes packed into int32 along the input dimension, group or channel
    scales, packed zero points when asymmetric. `weight_g_idx` (act-order) is refused when the checkpoint is opened."""

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, fmt, ctx):
        """weight_packed, weight_shape, weight_scale, weight_zero_point (asymmetric)."""
        bits, offset = fmt.bits, 1 << (fmt.bits - 1)
        words = -(-in_features * bits // 32)
        packed = t.get(f"{name}.weight_packed", torch.int32, (out_features, words))
        declared = t.get(f"{name}.weight_shape", shape=(2,))
        if [int(v) for v in declared] != [out_features, in_features]:
            raise QuantlabError(f"tensor {name}.weight_shape is {[int(v) for v in declared]}, the model's layer is "
                                f"[{out_features}, {in_features}]",
                                fix="the checkpoint was made from another model or its tensors were renamed")
        scale = _ct_scale(name, out_features, in_features, fmt, t)
        q = unpack_dense(packed, bits, in_features) - offset
        w = q.to(scale.dtype)
        if not fmt.symmetric:
            groups = scale.shape[1]
            zp = t.get(f"{name}.weight_zero_point", torch.int32, (-(-out_features * bits // 32), groups))
            zero = unpack_dense(zp.t().contiguous(), bits, out_features).t() - offset
            w = w - _expand(zero.to(scale.dtype), out_features, in_features, fmt)
        w = w * _expand(scale, out_features, in_features, fmt)
        return cls(w, cls._bias(name, out_features, has_bias, t), ctx.compute_dtype, _activation(name, fmt, t),
                   f"compressed-tensors pack-quantized int{bits} ({fmt.strategy}), dequantized once")


# --------------------------------------------------------------------------------------- GPTQ / AWQ
def _gptq_tensors(name: str, out_f: int, in_f: int, fmt: ForeignLayer, t: CheckpointTensors, awq: bool):
    """(codes [in, out], zero points [groups, out], scales [groups, out], group of every input column)."""
    bits, per = fmt.bits, 32 // fmt.bits
    block = checked_group_size(name, in_f, fmt.group_size)
    groups = in_f // block
    if awq:
        codes = unpack(t.get(f"{name}.qweight", torch.int32, (in_f, out_f // per)), bits, 1, AWQ_ORDER)
    else:
        codes = unpack(t.get(f"{name}.qweight", torch.int32, (in_f // per, out_f)), bits, 0)
    zeros = unpack(t.get(f"{name}.qzeros", torch.int32, (groups, out_f // per)), bits, 1,
                   AWQ_ORDER if awq else None) + fmt.zero_offset
    scales = QuantLinear._scale(f"{name}.scales", t, (groups, out_f))
    g_idx = t.optional(f"{name}.g_idx", shape=(in_f,))
    if g_idx is None:
        g_idx = torch.arange(in_f) // block
    else:
        g_idx = g_idx.long()
        if bool((g_idx < 0).any()) or bool((g_idx >= groups).any()):
            raise QuantlabError(f"tensor {name}.g_idx holds groups outside 0 .. {groups - 1}",
                                fix="the checkpoint's act-order indices are damaged; re-export it")
    return codes, zeros, scales, g_idx


class GptqLinear(ForeignLinear):
    """GPTQ packed weights (GPTQModel / AutoGPTQ layout, v1 or v2 zero points, act-order g_idx)."""

    marker = "qweight"
    awq = False

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, fmt, ctx):
        """qweight, qzeros, scales, g_idx (optional: absent means column // group_size)."""
        per = 32 // fmt.bits
        if (out_features if cls.awq else in_features) % per:
            raise QuantlabError(f"{name}: {out_features if cls.awq else in_features} is not a multiple of {per}",
                                fix="the checkpoint does not match the model's layer sizes")
        codes, zeros, scales, g_idx = _gptq_tensors(name, out_features, in_features, fmt, t, cls.awq)
        w = (codes - zeros[g_idx]).to(scales.dtype) * scales[g_idx]  # [in, out] in the scales' dtype, as its kernels
        return cls(w.t(), cls._bias(name, out_features, has_bias, t), ctx.compute_dtype, None,
                   f"{'AWQ GEMM' if cls.awq else 'GPTQ'} int{fmt.bits} dequantized once (in {scales.dtype})")


class AwqGemmLinear(GptqLinear):
    """AWQ GEMM packed weights (AutoAWQ, GPTQModel format gemm)."""

    awq = True


# --------------------------------------------------------------------------------------- GGUF
class GgufLinear(ForeignLinear):
    """Rows of ggml blocks of one type (weight U8 [out, row bytes]), dequantized in float32."""

    marker = "weight"
    ggml_type = ""

    @classmethod
    def from_checkpoint(cls, name, out_features, in_features, has_bias, t, _fmt, ctx):
        """weight: raw blocks [out, in / block * bytes]."""
        values, size = ggml.BLOCKS[cls.ggml_type]
        if in_features % values:
            raise QuantlabError(f"{name}: {cls.ggml_type} blocks of {values} do not tile its input width {in_features}",
                                fix="the GGUF file does not match the model's layer sizes")
        raw = t.get(f"{name}.weight", torch.uint8, (out_features, in_features // values * size))
        return cls(ggml.dequantize(raw, cls.ggml_type), cls._bias(name, out_features, has_bias, t),
                   ctx.compute_dtype, None, f"GGUF {cls.ggml_type} dequantized once")


QLAYERS.add("CT_FP8", CtFp8Linear)
QLAYERS.add("CT_INT8", CtInt8Linear)
for _bits in (2, 4, 8):
    QLAYERS.add(f"CT_PACKED_INT{_bits}", type(f"CtPackedInt{_bits}Linear", (CtPackedLinear,),
                                            {"audit_bounds": _bounds_for_bits(_bits), "__doc__":
                                             f"compressed-tensors pack-quantized int{_bits}."}))
    # the same layout, made by llm-compressor's GPTQModifier (recipe.yaml): the audit allows GPTQ's weight movement
    QLAYERS.add(f"CT_PACKED_INT{_bits}_GPTQ", type(f"CtPackedInt{_bits}GptqLinear", (CtPackedLinear,),
                                                 {"audit_bounds": _bounds_for_bits(_bits, gptq=True), "__doc__":
                                                  f"compressed-tensors pack-quantized int{_bits}, GPTQ-made."}))
    QLAYERS.add(f"GPTQ_INT{_bits}", type(f"GptqInt{_bits}Linear", (GptqLinear,),
                                         {"audit_bounds": _bounds_for_bits(_bits, gptq=True),
                                          "__doc__": f"GPTQ int{_bits} packed weights."}))
QLAYERS.add("AWQ_GEMM_INT4", AwqGemmLinear)
for _type in ggml.BLOCKS:
    QLAYERS.add(f"GGUF_{_type}", type(f"Gguf{_type}Linear", (GgufLinear,),
                                      {"ggml_type": _type, "audit_bounds": _bounds_for_bits(ggml.bits_of(_type)),
                                       "__doc__": f"GGUF {_type} blocks."}))
