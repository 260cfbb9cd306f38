"""The Triton kernels of quantlab.engines.kernels.int4 (imported only where Triton is; read that module first)."""
import triton
import triton.language as tl


@triton.jit
def _nibbles(wb):
    """uint8 codes -> (low, high) nibbles as exact fp32 integers in -8..7 (two's complement), without an
    int-to-float conversion: (n ^ 8) ORed into the mantissa of 2^23, minus 2^23 + 8."""
    w = wb.to(tl.int32)
    lo = (((w & 15) ^ 8) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    hi = ((((w >> 4) & 15) ^ 8) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return lo, hi

# Two 16-bit dequantized weights per 32-bit register, Marlin-style: the code's nibble ORed into the mantissa of a
# magic number (bf16 128.0 / fp16 1024.0, whose mantissa steps by 1), the magic plus 8 subtracted exactly (codes are
# XORed with 8 first: two's complement -> offset binary), then one multiply by the group scale, rounded once.
# For 4 bytes (8 codes): 1 xor, 2 byte permutes, 2 shifts, 4 lop3, 8 packed FMAs.
_DEQUANT_ASM = """
{{
.reg .b32 w, a, b, t, one, bias, nz;
mov.b32 one, {one};
mov.b32 bias, {bias};
mov.b32 nz, 0x80008000;
xor.b32 w, $4, 0x88888888;
prmt.b32 a, w, 0, 0x4140;
prmt.b32 b, w, 0, 0x4342;
lop3.b32 $0, a, 0x000F000F, {magic}, 0xEA;
lop3.b32 $1, b, 0x000F000F, {magic}, 0xEA;
shr.b32 t, a, 4;
lop3.b32 $2, t, 0x000F000F, {magic}, 0xEA;
shr.b32 t, b, 4;
lop3.b32 $3, t, 0x000F000F, {magic}, 0xEA;
fma.rn.{ty} $0, $0, one, bias;
fma.rn.{ty} $1, $1, one, bias;
fma.rn.{ty} $2, $2, one, bias;
fma.rn.{ty} $3, $3, one, bias;
fma.rn.{ty} $0, $0, $5, nz;
fma.rn.{ty} $1, $1, $6, nz;
fma.rn.{ty} $2, $2, $7, nz;
fma.rn.{ty} $3, $3, $8, nz;
}}
"""
DEQUANT_BF16 = _DEQUANT_ASM.format(one="0x3F803F80", bias="0xC308C308", magic="0x43004300", ty="bf16x2")
DEQUANT_F16 = _DEQUANT_ASM.format(one="0x3C003C00", bias="0xE408E408", magic="0x64006400", ty="f16x2")


@triton.jit
def _dequant_asm(wb, s_lo, s_hi, dtype: tl.constexpr):
    """uint8 codes and the scales of their rows (broadcast to the codes' shape) -> (low, high) weights q * scale
    in the 16-bit compute dtype, by packed PTX (GPU only; Triton's interpreter runs the plain path)."""
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(DEQUANT_BF16, "=r,=r,=r,=r,r,r,r,r,r", [wb, s_lo, s_hi],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(DEQUANT_F16, "=r,=r,=r,=r,r,r,r,r,r", [wb, s_lo, s_hi],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def w4a16_gemv(x_ptr, w_ptr, s_ptr, p_ptr, y_ptr, N2, K: tl.constexpr, stride_xm, stride_ym, stride_sn,
               GROUP: tl.constexpr, GROUPS: tl.constexpr, KSTEP: tl.constexpr, BLOCK_N2: tl.constexpr,
               HAS_PQS: tl.constexpr, ASM: tl.constexpr):
    """One output row m (program axis 1) x BLOCK_N2 packed weight rows (2*BLOCK_N2 outputs), GROUPS groups of
    K per step: acc[r, g, e] += x[g, e] * w[r, g, e], reduced once at the end. ASM: the weights dequantized two
    per instruction (16-bit compute dtypes on the GPU)."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    dtype = y_ptr.dtype.element_ty
    rp = pid_n * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    rg = tl.arange(0, GROUPS)
    re = tl.arange(0, GROUP)
    mask_p = rp < N2
    acc_lo = tl.zeros([BLOCK_N2, GROUPS, GROUP], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_N2, GROUPS, GROUP], dtype=tl.float32)
    for k0 in range(0, K, KSTEP):  # KSTEP = GROUPS * GROUP
        kk = k0 + rg[:, None] * GROUP + re[None, :]  # [GROUPS, GROUP]
        mask_k = kk < K
        x = tl.load(x_ptr + m * stride_xm + kk, mask=mask_k, other=0.0)
        if HAS_PQS:
            x = (x.to(tl.float32) * tl.load(p_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)).to(dtype)
        x = x.to(tl.float32)
        wb = tl.load(w_ptr + rp[:, None, None] * K + kk[None, :, :],
                     mask=mask_p[:, None, None] & mask_k[None, :, :], other=0)
        gi = k0 // GROUP + rg
        mask_s = mask_p[:, None] & (gi[None, :] < K // GROUP)
        s_lo = tl.load(s_ptr + (2 * rp)[:, None] * stride_sn + gi[None, :], mask=mask_s, other=0.0)
        s_hi = tl.load(s_ptr + (2 * rp + 1)[:, None] * stride_sn + gi[None, :], mask=mask_s, other=0.0)
        if ASM:  # the scales are broadcast to the codes' shape by inline_asm_elementwise
            w_lo, w_hi = _dequant_asm(wb, s_lo[:, :, None], s_hi[:, :, None], dtype)
            w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
        else:
            q_lo, q_hi = _nibbles(wb)
            w_lo = (q_lo * s_lo.to(tl.float32)[:, :, None]).to(dtype).to(tl.float32)
            w_hi = (q_hi * s_hi.to(tl.float32)[:, :, None]).to(dtype).to(tl.float32)
        acc_lo += w_lo * x[None, :, :]
        acc_hi += w_hi * x[None, :, :]
    y_lo = tl.sum(tl.sum(acc_lo, axis=2), axis=1)
    y_hi = tl.sum(tl.sum(acc_hi, axis=2), axis=1)
    tl.store(y_ptr + m * stride_ym + 2 * rp, y_lo.to(dtype), mask=mask_p)
    tl.store(y_ptr + m * stride_ym + 2 * rp + 1, y_hi.to(dtype), mask=mask_p)

@triton.jit
def w4a16_gemm(x_ptr, w_ptr, s_ptr, p_ptr, y_ptr, M, N2, K: tl.constexpr, stride_xm, stride_ym, stride_sn,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr,
               HAS_PQS: tl.constexpr, F32_DOT: tl.constexpr):
    """BLOCK_M rows x BLOCK_N2 packed weight rows; a K step lies inside one group (BLOCK_K divides GROUP):
    acc_lo / acc_hi hold outputs 2r / 2r+1 and are stored interleaved."""
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    dtype = y_ptr.dtype.element_ty
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rp = pid_n * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    mask_m = rm < M
    mask_p = rp < N2
    acc_lo = tl.zeros([BLOCK_M, BLOCK_N2], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_N2], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask_m[:, None], other=0.0)
        if HAS_PQS:
            x = (x.to(tl.float32) * tl.load(p_ptr + rk).to(tl.float32)[None, :]).to(dtype)
        wb = tl.load(w_ptr + rp[:, None] * K + rk[None, :], mask=mask_p[:, None], other=0)
        g = k0 // GROUP
        s_lo = tl.load(s_ptr + (2 * rp) * stride_sn + g, mask=mask_p, other=0.0).to(tl.float32)
        s_hi = tl.load(s_ptr + (2 * rp + 1) * stride_sn + g, mask=mask_p, other=0.0).to(tl.float32)
        q_lo, q_hi = _nibbles(wb)
        w_lo = (q_lo * s_lo[:, None]).to(dtype)
        w_hi = (q_hi * s_hi[:, None]).to(dtype)
        if F32_DOT:  # fp32 models (no TF32), and Triton's CPU interpreter (its 16-bit dot is wrong): the same
            # exact products of 16-bit values, accumulated in fp32
            acc_lo = tl.dot(x.to(tl.float32), tl.trans(w_lo.to(tl.float32)), acc_lo, input_precision="ieee")
            acc_hi = tl.dot(x.to(tl.float32), tl.trans(w_hi.to(tl.float32)), acc_hi, input_precision="ieee")
        else:
            acc_lo = tl.dot(x, tl.trans(w_lo), acc_lo)
            acc_hi = tl.dot(x, tl.trans(w_hi), acc_hi)
    out = y_ptr + rm[:, None] * stride_ym + 2 * rp[None, :]
    mask = mask_m[:, None] & mask_p[None, :]
    tl.store(out, acc_lo.to(dtype), mask=mask)
    tl.store(out + 1, acc_hi.to(dtype), mask=mask)
