"""The Triton kernel of quantlab.engines.kernels.attention (imported only where Triton is; read that module first)."""
import triton
import triton.language as tl


@triton.jit
def _e4m3(u, scale_ptr):
    """E4M3 bytes (uint8) -> value * scale in fp32 (the caller rounds it to the compute dtype, as the cache's read
    does): by bit operations (exact; no fp8 type, no subnormal fp32 intermediate) - normal codes rebias the exponent
    by 120, subnormal ones are m * 2^-9, S.1111.111 is NaN."""
    b = u.to(tl.int32)
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(mag < 8, (mag & 7).to(tl.float32) * 0.001953125, normal)
    value = tl.where(mag == 0x7F, float("nan"), value)
    value = tl.where((b & 0x80) != 0, -value, value)
    return value * tl.load(scale_ptr)


@triton.jit
def _tile(ptr, offsets, mask, scale_ptr, out_ptr, FP8: tl.constexpr):
    """A [BLOCK_L, BLOCK_D] tile of one K or V head (masked positions read as 0), in the compute dtype (out's)."""
    t = tl.load(ptr + offsets, mask=mask, other=0)
    if FP8:
        t = _e4m3(t, scale_ptr).to(out_ptr.dtype.element_ty)
    return t


@triton.jit
def decode_attention(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, ks_ptr, vs_ptr, ws_ptr, cnt_ptr,  # noqa: PLR0913
                     stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
                     stride_ob, stride_oh, HKV, scaling, softcap, window,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_L: tl.constexpr, TILES: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr,
                     SOFTCAP: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr = False):
    """One query token per sequence over a static cache: program (sequence x KV head, split) holds the G query
    heads that share the KV head and reads positions [split * TILES * BLOCK_L, +TILES * BLOCK_L) of it, keeping
    those allowed (window start <= l <= pos, pos read from the step's position tensor), with an online softmax in
    fp32. Splits write (max, sum, unnormalized output) to the workspace; the program arriving last for its
    (sequence, KV head) combines them in split order (unrolled loops: no split's loads wait on another's) and
    writes o [B, 1, Hq, D]. PDL (launched as a programmatic dependent): wait for the previous kernels before anything
    is read or written, then let the next one start (reading pos and the cache rows before pos ahead of the wait -
    earlier steps wrote them - measured no faster: 2.005 against 2.003 ms a token on the 8B shape,
    bench/results/h200-2026-12-02/s5_2_*, and was not kept)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0)
    split = tl.program_id(1)
    dtype = o_ptr.dtype.element_ty
    b = bh // HKV
    h = bh % HKV
    pos = tl.load(pos_ptr).to(tl.int32)
    start = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)  # window 0: none
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, BLOCK_D)
    mask_g = rg < G
    mask_d = rd < D
    q = tl.load(q_ptr + b * stride_qb + (h * G + rg)[:, None] * stride_qh + rd[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_base = b * stride_kb + h * stride_kh
    v_base = b * stride_vb + h * stride_vh
    for t in range(TILES):
        rl = (split * TILES + t) * BLOCK_L + tl.arange(0, BLOCK_L)
        valid = (rl >= start) & (rl <= pos)
        kv_mask = valid[:, None] & mask_d[None, :]
        k = _tile(k_ptr, k_base + rl[:, None] * stride_kl + rd[None, :], kv_mask, ks_ptr, o_ptr, FP8)
        v = _tile(v_ptr, v_base + rl[:, None] * stride_vl + rd[None, :], kv_mask, vs_ptr, o_ptr, FP8)
        if F32_DOT:  # fp32 models, and Triton's interpreter: exact fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scaling
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(dtype), v)  # probabilities rounded to the compute dtype, as flash attention does
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out_ptrs = o_ptr + b * stride_ob + (h * G + rg)[:, None] * stride_oh + rd[None, :]
    out_mask = mask_g[:, None] & mask_d[None, :]
    if SPLITS == 1:
        tl.store(out_ptrs, (acc / l_i[:, None]).to(dtype), mask=out_mask)
    else:
        nbh = tl.num_programs(0)
        part = (bh * SPLITS + split) * BLOCK_G
        ml = nbh * SPLITS * BLOCK_G * BLOCK_D  # the (max, sum) pairs follow the outputs
        tl.store(ws_ptr + (part + rg)[:, None] * BLOCK_D + rd[None, :], acc)
        tl.store(ws_ptr + ml + (part + rg) * 2, m_i)
        tl.store(ws_ptr + ml + (part + rg) * 2 + 1, l_i)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        arrived = tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            m_all = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            for sp in tl.static_range(SPLITS):
                at = (bh * SPLITS + sp) * BLOCK_G + rg
                m_all = tl.maximum(m_all, tl.load(ws_ptr + ml + at * 2, cache_modifier=".cg"))
            m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
            total = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            denom = tl.zeros([BLOCK_G], dtype=tl.float32)
            for sp in tl.static_range(SPLITS):
                at = (bh * SPLITS + sp) * BLOCK_G + rg
                w = tl.exp(tl.load(ws_ptr + ml + at * 2, cache_modifier=".cg") - m_all)
                denom += w * tl.load(ws_ptr + ml + at * 2 + 1, cache_modifier=".cg")
                total += w[:, None] * tl.load(ws_ptr + at[:, None] * BLOCK_D + rd[None, :], mask=mask_g[:, None],
                                              other=0.0, cache_modifier=".cg")  # (padded heads: not read)
            tl.store(out_ptrs, (total / denom[:, None]).to(dtype), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + bh, 0)
