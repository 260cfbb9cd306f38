"""The Triton kernels of quantlab.engines.kernels.int4 (imported only where Triton is; read that module first).

w4a16_gemv / w4a16_gemm read the export's layout (uint8 [N/2, K]); they are the fallback when the k8 kernels
(w4a16_k8, w4a16_k8_dequant: the layout int4.repack writes) fail their check on a device."""
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


@triton.jit
def w4a16_gemv(x_ptr, w_ptr, s_ptr, p_ptr, y_ptr, N2, K: tl.constexpr, stride_xm, stride_ym,  # noqa: PLR0913
               stride_sn, GROUP: tl.constexpr, GROUPS: tl.constexpr, KSTEP: tl.constexpr, BLOCK_N2: tl.constexpr,
               HAS_PQS: tl.constexpr):
    """One output row m (program axis 1) x BLOCK_N2 packed weight rows (2*BLOCK_N2 outputs), GROUPS groups of
    K per step: acc[r, g, e] += x[g, e] * w[r, g, e], reduced once at the end."""
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
def w4a16_gemm(x_ptr, w_ptr, s_ptr, p_ptr, y_ptr, M, N2, K: tl.constexpr, stride_xm, stride_ym,  # noqa: PLR0913
               stride_sn, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr,
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


# ------------------------------------------------------------------------------------------------ the k8 layout
# int4.repack writes, per output row, one int32 word per 8 inputs: in block b of 128 inputs, word i (0..15) holds in
# bits 4j..4j+3 the code of input 128b + 16j + i, offset binary (q + 8). Nibble j of 16 consecutive words is then
# the 16 consecutive inputs 128b + 16j .. +15: one [rows, 16] tile per j, matched by 16 consecutive inputs of x.
# Rows are stored in tiles of 16 (int4.k8_offset): block b of the tile's rows is one contiguous 1 KB.
@triton.jit
def _k8_rows(rn, KW: tl.constexpr):
    """The int32 offset of word 0 of block 0 of rows rn (add _k8_block(b) and the word 0..15)."""
    return (rn // 16) * (16 * KW) + (rn % 16) * 16


@triton.jit
def _k8_block(b):
    """The int32 offset of block b within a tile's row (see _k8_rows)."""
    return b * 256


@triton.jit
def _k8_dequant(wv, j: tl.constexpr, s, FAST: tl.constexpr):
    """Nibble j of int32 words wv [R, 16] -> (code - 8) * s, exactly, in fp32 (s [R] fp32, its row's scale).

    FAST (s a 16-bit value): the nibble is moved to bits p..p+3 (p = 12 or 16) and ORed into 1.0, giving
    v = 1 + u 2^(p-23); then v * S - C with S = s 2^(23-p), C = S + 8s is (u - 8) s. Exact with or without FMA
    contraction: v has 24-p <= 12 significant bits and S at most 11, so v * S is exact, and (u - 8) s (at most 15
    bits) is representable, so the subtraction is too. 4 shifts per word, then per weight one LOP3 and one FFMA.
    Otherwise (fp32 scales): q exactly as (u | 2^23 bits) - (2^23 + 8), times s rounded once, as the reference."""
    return _gemv_nibble(wv, j, s[:, None], FAST)


@triton.jit
def _k8_x(x_ptr, p_ptr, rm, M, stride_xm, k0, HAS_PQS: tl.constexpr):
    """x[rm, k0:k0+16] (times pre_quant_scale, rounded to the compute dtype - x's - as the reference rounds it)."""
    ri = tl.arange(0, 16)
    x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + ri)[None, :], mask=(rm < M)[:, None], other=0.0)
    if HAS_PQS:
        x = (x.to(tl.float32) * tl.load(p_ptr + k0 + ri).to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def w4a16_k8(x_ptr, w_ptr, s_ptr, p_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_ym,  # noqa: PLR0913
             stride_sg, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
             SPLIT_K: tl.constexpr, BPI: tl.constexpr, DOT: tl.constexpr, HAS_PQS: tl.constexpr,
             F32_DOT: tl.constexpr, FAST: tl.constexpr):
    """y [M, N] = x [M, K] @ dequant(W)^T on the k8 layout, split over K.

    Program (n tile, K split, m tile) reads BLOCK_N rows x K/SPLIT_K inputs of codes, BPI blocks of 128 inputs per
    loop step (their loads issued together). DOT: per nibble j one tensor-core product of the dequantized
    [BLOCK_N, 16] tile with x's [BLOCK_M, 16] columns (fp32 accumulate); else (BLOCK_M = 1, one program per row)
    FMAs into [BLOCK_N, 16] fp32 accumulators summed at the end. With SPLIT_K > 1 each program writes its fp32
    partial to the workspace and bumps its tile's counter; the program that arrives last sums the SPLIT_K partials
    in split order (deterministic), writes y and re-arms the counter at 0 for the next launch."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    dtype = y_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    ri = tl.arange(0, 16)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rm < M
    KW: tl.constexpr = K // 8
    PER_SPLIT: tl.constexpr = K // 128 // SPLIT_K
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for it in range(PER_SPLIT // BPI):
        for bb in tl.static_range(BPI):
            b = pid_k * PER_SPLIT + it * BPI + bb
            wv = tl.load(w_ptr + _k8_rows(rn, KW)[:, None] + (_k8_block(b) + ri)[None, :], mask=mask_n[:, None],
                         other=0)
            for j in tl.static_range(8):
                k0 = b * 128 + j * 16
                if (j * 16) % GROUP == 0:  # the group changes (every block when GROUP >= 128)
                    s = tl.load(s_ptr + (k0 // GROUP) * stride_sg + rn, mask=mask_n, other=0.0).to(tl.float32)
                w = _k8_dequant(wv, j, s, FAST).to(dtype)
                x = _k8_x(x_ptr, p_ptr, rm, M, stride_xm, k0, HAS_PQS)
                if DOT:
                    if F32_DOT:  # fp32 models, and Triton's interpreter: exact products, fp32 accumulation
                        acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(w, tl.trans(x), acc)
                else:
                    acc += w.to(tl.float32) * x.to(tl.float32)
    if DOT:
        out = acc
        rows = rm[None, :]
        cols = rn[:, None]
        mask = mask_n[:, None] & mask_m[None, :]
    else:
        out = tl.sum(acc, axis=1)
        rows = pid_m
        cols = rn
        mask = mask_n
    if SPLIT_K == 1:
        tl.store(y_ptr + rows * stride_ym + cols, out.to(dtype), mask=mask)
    else:
        tl.store(ws_ptr + (pid_k * M + rows) * N + cols, out, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter says so (CUTLASS's semaphore)
        tile = pid_n * tl.num_programs(2) + pid_m
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros(out.shape, dtype=tl.float32)
            for sk in range(SPLIT_K):
                total += tl.load(ws_ptr + (sk * M + rows) * N + cols, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rows * stride_ym + cols, total.to(dtype), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def w4a16_k8_dequant(w_ptr, s_ptr, out_ptr, N, stride_sg, K: tl.constexpr, GROUP: tl.constexpr,  # noqa: PLR0913
                     BLOCK_N: tl.constexpr, FAST: tl.constexpr):
    """The k8 codes of BLOCK_N rows x one block of 128 inputs -> the dequantized weights [N, K] in out's dtype
    (q * s rounded once: the values the GEMV multiplies), for large-row GEMMs done by torch."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    ri = tl.arange(0, 16)
    wv = tl.load(w_ptr + _k8_rows(rn, K // 8)[:, None] + (_k8_block(b) + ri)[None, :], mask=mask_n[:, None],
                 other=0)
    for j in tl.static_range(8):
        k0 = b * 128 + j * 16
        if (j * 16) % GROUP == 0:
            s = tl.load(s_ptr + (k0 // GROUP) * stride_sg + rn, mask=mask_n, other=0.0).to(tl.float32)
        w = _k8_dequant(wv, j, s, FAST)
        tl.store(out_ptr + rn[:, None] * K + (k0 + ri)[None, :], w.to(dtype), mask=mask_n[:, None])


# ------------------------------------------------------------------------------------------------ k8, one row
# Word i of block b holds nibble j at bits 4j: the input 128b + 16j + i. `(w >> 4j) & 0x000F000F` puts nibbles j and
# j + 4 (inputs 16j + i and 16j + 64 + i of the block) into the two 16-bit halves of one register: a pair.
_PAIR_ASM = {
    # 16-bit halves ORed into 128.0 (bf16 0x4300: unit step) or 1024.0 (f16 0x6400): 128 + u; minus 136 (1032)
    # gives the code u - 8 exactly; times the scale pair, rounded once (RN) to the 16-bit type; each half widened
    # to fp32 exactly (bf16: the bits moved up; f16: cvt).
    "bf16": ("lop3.b32 v, t, 0x000F000F, 0x43004300, 0xEA;\n"
             "fma.rn.bf16x2 v, v, 0x3F803F80, 0xC308C308;\n"
             "fma.rn.bf16x2 v, v, $3, 0x80008000;\n"
             "shl.b32 $0, v, 16;\n"
             "and.b32 $1, v, 0xFFFF0000;"),
    "f16": ("lop3.b32 v, t, 0x000F000F, 0x64006400, 0xEA;\n"
            "fma.rn.f16x2 v, v, 0x3C003C00, 0xE408E408;\n"
            "fma.rn.f16x2 v, v, $3, 0x80008000;\n"
            "mov.b32 {a, b}, v;\n"
            "cvt.f32.f16 $0, a;\n"
            "cvt.f32.f16 $1, b;"),
}


def _pair_asm_text(jp: int, kind: str) -> str:
    """The PTX of one pair (nibbles jp and jp + 4 of a word): inputs $2 (the word), $3 (the two scales, 16-bit
    halves); outputs $0 / $1 (the low / high nibble's weight in fp32)."""
    shift = f"shr.u32 t, $2, {4 * jp};\n" if jp else "mov.b32 t, $2;\n"
    body = _PAIR_ASM[kind]
    # PTX takes no immediate for a packed 16-bit operand: the constants go through registers
    consts = {"0x3F803F80": "c1", "0xC308C308": "c2", "0x3C003C00": "c1", "0xE408E408": "c2", "0x80008000": "c3"}
    movs = ""
    for value, reg in consts.items():
        if value in body:
            body = body.replace(value, reg)
            movs += f"mov.b32 {reg}, {value};\n"
    return "{\n.reg .b32 t, v, c1, c2, c3;\n.reg .b16 a, b;\n" + movs + shift + body + "\n}"


# one constexpr per pair and type (a kernel reads globals only as constexprs)
_BF16_0, _BF16_1, _BF16_2, _BF16_3 = (tl.constexpr(_pair_asm_text(jp, "bf16")) for jp in range(4))
_F16_0, _F16_1, _F16_2, _F16_3 = (tl.constexpr(_pair_asm_text(jp, "f16")) for jp in range(4))


@triton.jit
def _pair_asm(wv, sp, JP: tl.constexpr, BF16: tl.constexpr):
    """The PTX block of pair JP on words wv and packed scale pairs sp -> (low, high) fp32."""
    f32x2: tl.constexpr = (tl.float32, tl.float32)
    if BF16:
        if JP == 0:
            out = tl.inline_asm_elementwise(_BF16_0, "=r,=r,r,r", [wv, sp], dtype=f32x2, is_pure=True, pack=1)
        elif JP == 1:
            out = tl.inline_asm_elementwise(_BF16_1, "=r,=r,r,r", [wv, sp], dtype=f32x2, is_pure=True, pack=1)
        elif JP == 2:
            out = tl.inline_asm_elementwise(_BF16_2, "=r,=r,r,r", [wv, sp], dtype=f32x2, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise(_BF16_3, "=r,=r,r,r", [wv, sp], dtype=f32x2, is_pure=True, pack=1)
    else:
        if JP == 0:
            out = tl.inline_asm_elementwise(_F16_0, "=r,=r,r,r", [wv, sp], dtype=f32x2, is_pure=True, pack=1)
        elif JP == 1:
            out = tl.inline_asm_elementwise(_F16_1, "=r,=r,r,r", [wv, sp], dtype=f32x2, is_pure=True, pack=1)
        elif JP == 2:
            out = tl.inline_asm_elementwise(_F16_2, "=r,=r,r,r", [wv, sp], dtype=f32x2, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise(_F16_3, "=r,=r,r,r", [wv, sp], dtype=f32x2, is_pure=True, pack=1)
    return out


@triton.jit
def _gemv_nibble(wv, j: tl.constexpr, s, FAST: tl.constexpr):
    """Nibble j of int32 words wv (any shape) -> (code - 8) * s exactly in fp32 (s fp32, broadcast against wv); the
    arithmetic is _k8_dequant's (its docstring)."""
    if FAST:
        P = 12 + 4 * ((0b10110010 >> j) & 1)  # constexpr: 16 for j in (1, 4, 5, 7), 12 otherwise
        SHIFT = P - 4 * j
        if SHIFT > 0:
            ws = wv << SHIFT
        elif SHIFT < 0:
            ws = wv >> (-SHIFT)
        else:
            ws = wv
        v = ((ws & (15 << P)) | 0x3F800000).to(tl.float32, bitcast=True)
        big = s * (1 << (23 - P))
        return v * big - (big + 8.0 * s)
    u = (wv >> (4 * j)) & 15
    q = (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return q * s


@triton.jit
def _gemv_pair(wv, s_lo, s_hi, JP: tl.constexpr, dtype: tl.constexpr, ASM: tl.constexpr, FAST: tl.constexpr):
    """Nibbles JP and JP + 4 of the words wv [R, B, 16] -> their weights in fp32, each q * s rounded once to dtype
    (s_lo / s_hi [R, B, 1]: the scales of the two nibbles' groups). ASM (bf16 / fp16 on the GPU): one PTX block per
    word and pair (a shift, a LOP3, two packed FMAs, two widenings); else the same values in Triton."""
    if ASM:
        h_lo = s_lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        h_hi = s_hi.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        sp = h_lo | (h_hi << 16)
        lo, hi = _pair_asm(wv, sp, JP, dtype == tl.bfloat16)
    else:
        lo = _gemv_nibble(wv, JP, s_lo.to(tl.float32), FAST).to(dtype).to(tl.float32)
        hi = _gemv_nibble(wv, JP + 4, s_hi.to(tl.float32), FAST).to(dtype).to(tl.float32)
    return lo, hi


@triton.jit
def _gemv_x(x_ptr, p_ptr, b, JP: tl.constexpr, HAS_PQS: tl.constexpr):
    """x at inputs 128 b + 16 JP + i (b [B], i < 16) -> [B, 16] fp32 (times pre_quant_scale rounded to x's dtype)."""
    kk = b[:, None] * 128 + 16 * JP + tl.arange(0, 16)[None, :]
    x = tl.load(x_ptr + kk)
    if HAS_PQS:
        x = (x.to(tl.float32) * tl.load(p_ptr + kk).to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _gemv_load(w_ptr, s_ptr, rn, mask_n, b, stride_sg, KW: tl.constexpr, GROUP: tl.constexpr):
    """The words of blocks b [B] for rows rn ([R, B, 16] int32) and the scales of each block's first group
    ([R, B])."""
    ri = tl.arange(0, 16)
    wv = tl.load(w_ptr + _k8_rows(rn, KW)[:, None, None] + _k8_block(b)[None, :, None] + ri[None, None, :],
                 mask=mask_n[:, None, None], other=0, eviction_policy="evict_first")
    s0 = tl.load(s_ptr + ((b * 128) // GROUP)[None, :] * stride_sg + rn[:, None], mask=mask_n[:, None], other=0.0)
    return wv, s0


@triton.jit
def w4a16_k8_gemv(x_ptr, w_ptr, s_ptr, p_ptr, y_ptr, ws_ptr, cnt_ptr, N, stride_sg,  # noqa: PLR0913
                  K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                  BPI: tl.constexpr, HAS_PQS: tl.constexpr, ASM: tl.constexpr, FAST: tl.constexpr):
    """y [1, N] = x [1, K] @ dequant(W)^T on the k8 layout, with FMAs (no tensor cores: one row).

    Program (n tile, K split) reads BLOCK_N rows x K/SPLIT_K inputs, BPI blocks of 128 inputs per step (one
    [BLOCK_N, BPI, 16]-word load: 64 BPI contiguous bytes per row, 128-bit loads). Each word gives four pairs of
    weights (_gemv_pair) multiplied into [BLOCK_N, BPI, 16] fp32 accumulators, summed once at the end. The K split
    is combined as in w4a16_k8 (fp32 partials, the last program of a tile sums them in split order)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dtype = y_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rb = tl.arange(0, BPI)
    KW: tl.constexpr = K // 8
    PER_SPLIT: tl.constexpr = K // 128 // SPLIT_K
    acc = tl.zeros([BLOCK_N, BPI, 16], dtype=tl.float32)
    for it in range(PER_SPLIT // BPI):
        b = pid_k * PER_SPLIT + it * BPI + rb
        wv, s0 = _gemv_load(w_ptr, s_ptr, rn, mask_n, b, stride_sg, KW, GROUP)
        for jp in tl.static_range(4):
            if jp == 0:
                s_lo = s0[:, :, None]
            elif (16 * jp) % GROUP == 0:  # the group of nibble jp changes
                s_lo = tl.load(s_ptr + ((b * 128 + 16 * jp) // GROUP)[None, :] * stride_sg + rn[:, None],
                               mask=mask_n[:, None], other=0.0)[:, :, None]
            if GROUP >= 128:
                s_hi = s_lo
            elif (16 * jp) % GROUP == 0:  # nibble jp + 4: input 64 further on
                s_hi = tl.load(s_ptr + ((b * 128 + 16 * jp + 64) // GROUP)[None, :] * stride_sg + rn[:, None],
                               mask=mask_n[:, None], other=0.0)[:, :, None]
            lo, hi = _gemv_pair(wv, s_lo, s_hi, jp, dtype, ASM, FAST)
            acc += lo * _gemv_x(x_ptr, p_ptr, b, jp, HAS_PQS)[None, :, :]
            acc += hi * _gemv_x(x_ptr, p_ptr, b, jp + 4, HAS_PQS)[None, :, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rn, out.to(dtype), mask=mask_n)
    else:
        tl.store(ws_ptr + pid_k * N + rn, out, mask=mask_n)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for sk in range(SPLIT_K):
                total += tl.load(ws_ptr + sk * N + rn, mask=mask_n, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rn, total.to(dtype), mask=mask_n)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
