"""CUDA C++ source of the k8-layout W4A16 kernel for up to 8 rows on tensor cores (compiled by NVRTC: cuda_rtc).

Why CUDA C++ and not Triton: at one row the FMA kernel (_int4_triton.w4a16_k8_gemv) spends ~5.5 instructions per
weight (dequantize, widen to fp32, FMA) and is bound by instruction issue; Triton's tensor-core path takes the
dequantized tile through shared memory. Here each thread dequantizes straight into the registers of mma.sync's A
fragment: per pair of weights one LOP3 (magic number) and two packed FMAs, and one mma per 8 weights a thread.

The k8 layout read as is (int4.repack): row n, block b of 128 inputs, word i (0..15) holds in nibble j the input
128b + 16j + i; rows in tiles of 16, block b of a tile's rows one contiguous 1 KB (int4.k8_offset). A warp takes RT
tiles of 16 rows (in each, n0 + g and n0 + g + 8, g = lane / 4) and thread t = lane % 4 loads words 4t..4t+3 of each
of its rows (one 128-bit load a row: a quad reads a row's 64 bytes of the block, the warp 512 contiguous bytes); a
step issues every load of its UNROLL blocks (codes, scales, x) before their arithmetic. The K index
inside an mma is a permutation of the inputs, the same for A and B, so the product is the one of the layer:
for word 4t + s and h in {0, 1}, mma (s, h) has in thread t's k slots (2t, 2t+1) the nibbles (2h, 2h + 4) - a
LOP3 pair - and in (2t+8, 2t+9) the nibbles (2h+1, 2h+5); B's slots hold the x values of the same inputs
(128b + 16j + 4t + s), column g = batch row g (rows past M repeat the last row and are not written).
Numerics (int4.py's contract): q * scale rounded once to the 16-bit type (RN, the packed FMA), products exact,
fp32 accumulation in the tensor core; two accumulator sets (h) added at the end; a CTA's warps split K (warp w
takes blocks w, w + WARPS, ...) and their partials are summed in warp order from shared memory: deterministic.

w4a16_k8_tma (sm_90, one row, group 128): the same arithmetic and reduction, with the tile's codes staged in
shared memory by bulk copies (cp.async.bulk + mbarriers) instead of per-thread loads; it won at gate|up (N 28672,
K 4096: 19.8 against 22.4-22.8 us on the H200, bench/int4_mma_variants.py --tma) and lost at the other 8B shapes,
so CONFIGS picks it per shape.

Two instantiation flags: PQS multiplies x by pre_quant_scale as it is loaded (scale_x, the product torch computes:
for the attention output's projection, whose input comes from an op torch.compile cannot fuse the multiply into);
XP reads x in the x order (int4_codes.in_x_order), thread t's 32 inputs of a block in the order of its B registers
(four 16-byte loads and no byte permutes instead of eight 8-byte loads and 16 permutes; the layers reorder x by views
torch.compile folds into the norm producing x). The bulk-copy kernel has XP, not PQS.

Both are launched as programmatic dependents on compute capability 9.0+ (engine.kernels.pdl, device.pdl_on): the
bulk-copy kernel requests its tile's codes before it waits for the previous kernel (griddepcontrol.wait), so the
first codes arrive while that kernel ends (its scale loads are written before the wait too, but ptxas places them
after it); the register-fed kernel waits first (loading its first codes, or prefetching its tile into L2, before the
wait measured slower: 2.33 and 2.34 against 2.28 ms a token). x, which the previous kernel writes, is read by
explicit coherent loads (ld_x) that stay after the wait.
"""

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Programmatic dependent launch (compute capability 9.0+; no-ops where the grid was launched without it, and compiled
// out for older targets): pdl_wait() blocks until the stream's previous kernels have ended and their writes are
// visible - nothing is read from x or written to y before it; pdl_release() lets the next kernel start (it waits in
// turn), called only after pdl_wait so that every kernel before ours has ended when it does. What a kernel does
// before pdl_wait reads only its constant weights, so it overlaps the previous kernel's tail.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// x (written by the previous kernel) is read by coherent loads (ld_x; a read-only .nc load, which the compiler may
// pick for a const __restrict__ pointer, is not) through a pointer laundered after pdl_wait (after_wait), so no load
// of it can be placed above the wait.
__device__ __forceinline__ uint2 ld_x(const void* p) {
    uint2 v;
    asm("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// pre_quant_scale (constant) by read-only loads, 4 values at a time as x.
__device__ __forceinline__ uint2 ld_const(const void* p) {
    uint2 v;
    asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// the residual (RESIDUAL epilogue: written by the previous kernels) by a coherent load, as x
__device__ __forceinline__ u16 ld_res(const u16* p) {
    u16 v;
    asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}

template <typename T>
__device__ __forceinline__ T* after_wait(T* p) {
    asm volatile("" : "+l"(p) :: "memory");
    return p;
}

// nibbles at bits 0..3 and 16..19 of t -> (u - 8) * s per 16-bit half, s the packed scale pair; one RN rounding.
template <bool BF16>
__device__ __forceinline__ u32 dq_pair(u32 t, u32 sp) {
    u32 v;
    if (BF16) {
        asm("{\n.reg .b32 c1, c2, z;\n"
            "mov.b32 c1, 0x3F803F80;\nmov.b32 c2, 0xC308C308;\nmov.b32 z, 0x80008000;\n"
            "lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;\n"
            "fma.rn.bf16x2 %0, %0, c1, c2;\n"
            "fma.rn.bf16x2 %0, %0, %2, z;\n}"
            : "=r"(v) : "r"(t), "r"(sp));
    } else {
        asm("{\n.reg .b32 c1, c2, z;\n"
            "mov.b32 c1, 0x3C003C00;\nmov.b32 c2, 0xE408E408;\nmov.b32 z, 0x80008000;\n"
            "lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;\n"
            "fma.rn.f16x2 %0, %0, c1, c2;\n"
            "fma.rn.f16x2 %0, %0, %2, z;\n}"
            : "=r"(v) : "r"(t), "r"(sp));
    }
    return v;
}

// x * pre_quant_scale for 4 values (2 packed pairs): each exact product rounded once (RN; a fused multiply-add of
// -0), as torch multiplies two 16-bit tensors.
template <bool BF16>
__device__ __forceinline__ uint2 scale_x(uint2 v, uint2 p) {
    uint2 r;
    if (BF16) {
        asm("{\n.reg .b32 z;\nmov.b32 z, 0x80008000;\nfma.rn.bf16x2 %0, %2, %4, z;\nfma.rn.bf16x2 %1, %3, %5, z;\n}"
            : "=r"(r.x), "=r"(r.y) : "r"(v.x), "r"(v.y), "r"(p.x), "r"(p.y));
    } else {
        asm("{\n.reg .b32 z;\nmov.b32 z, 0x80008000;\nfma.rn.f16x2 %0, %2, %4, z;\nfma.rn.f16x2 %1, %3, %5, z;\n}"
            : "=r"(r.x), "=r"(r.y) : "r"(v.x), "r"(v.y), "r"(p.x), "r"(p.y));
    }
    return r;
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

template <bool BF16>
__device__ __forceinline__ u16 round16(float f) {
    u16 h;
    if (BF16) {
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    } else {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    }
    return h;
}

// element e (0..3) of 4 consecutive 16-bit values (p), paired with the same element of q: (p[e], q[e]).
__device__ __forceinline__ u32 pair_of(uint2 p, uint2 q, int e) {
    const u32 a = e < 2 ? p.x : p.y;
    const u32 b = e < 2 ? q.x : q.y;
    return __byte_perm(a, b, (e & 1) ? 0x7632 : 0x5410);
}

__device__ __forceinline__ u32 word(uint4 v, int e) {
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}

__device__ __forceinline__ uint4 ld_x4(const void* p) {  // ld_x, 8 values
    uint4 v;
    asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// A block's x values of one batch row as thread t holds them. XRow: x in the layer's order, v[j] = inputs
// 128b + 16j + 4t .. +3 (8-byte loads; the B registers are built by byte permutes). XPerm: x given in the x order
// (int4_codes.in_x_order), thread t's 32 inputs at 128b + 32t in the order of its B registers (16-byte loads, no
// permutes): word 4e + j holds the pair (inputs 128b + 16j + 4t + e, 128b + 16(j + 4) + 4t + e), j = 0..3.
struct XRow { uint2 v[8]; };
struct XPerm { uint4 v[4]; };
template <bool XP> struct XSel { typedef XRow T; };
template <> struct XSel<true> { typedef XPerm T; };

// B register of mma (e, j): the x values of inputs 128b + 16j + 4t + e and 128b + 16(j + 4) + 4t + e.
__device__ __forceinline__ u32 bfrag(const XRow& x, int e, int j) { return pair_of(x.v[j], x.v[j + 4], e); }
__device__ __forceinline__ u32 bfrag(const XPerm& x, int e, int j) { return word(x.v[e], j); }

// Block b's x of one row (xp: the row's x plus 4t, or plus 32t for XPerm); PQS: times pre_quant_scale (pp = p + 4t).
template <bool BF16, bool PQS>
__device__ __forceinline__ void load_x(XRow& xf, const u16* xp, const u16* pp, int b) {
    const uint2* xs = reinterpret_cast<const uint2*>(xp) + 32 * b;
#pragma unroll
    for (int j = 0; j < 8; ++j) xf.v[j] = ld_x(xs + 4 * j);
    if (PQS) {  // (the x loads first: with each product next to its load, the scale loads took 20 more registers)
        const uint2* ps = reinterpret_cast<const uint2*>(pp) + 32 * b;
#pragma unroll
        for (int j = 0; j < 8; ++j) xf.v[j] = scale_x<BF16>(xf.v[j], ld_const(ps + 4 * j));
    }
}

template <bool BF16, bool PQS>
__device__ __forceinline__ void load_x(XPerm& xf, const u16* xp, const u16*, int b) {
    static_assert(!PQS, "x in x_order comes with pre_quant_scale applied");
#pragma unroll
    for (int i = 0; i < 4; ++i) xf.v[i] = ld_x4(xp + 128 * b + 8 * i);
}

// One block of 128 inputs of one 16-row tile: the codes of rows g / g + 8 (w0 / w1: words 4t..4t+3), the block's
// x values of batch row g (xf, XRow or XPerm), the scale pairs of each row (NS a block).
template <bool BF16, int NS, typename XF>
__device__ __forceinline__ void block_mma(float (&acc)[2][4], uint4 w0, uint4 w1, const XF& xf,
                                          const u32 (&s0)[NS], const u32 (&s1)[NS]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j0 = 2 * h, j1 = 2 * h + 1;   // pairs (j0, j0 + 4) and (j1, j1 + 4)
            const int q0 = j0 * NS / 4, q1 = j1 * NS / 4;
            const u32 wa = word(w0, e), wb = word(w1, e);
            mma16816<BF16>(acc[h], dq_pair<BF16>(wa >> (4 * j0), s0[q0]), dq_pair<BF16>(wb >> (4 * j0), s1[q0]),
                           dq_pair<BF16>(wa >> (4 * j1), s0[q1]), dq_pair<BF16>(wb >> (4 * j1), s1[q1]),
                           bfrag(xf, e, j0), bfrag(xf, e, j1));
        }
    }
}

template <bool BF16>
__device__ __forceinline__ float widen16(u16 h) {
    if (BF16) return __uint_as_float((u32)h << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Epilogue flags (EPI): GATED - the tile's rows 0..7 are gate rows and 8..15 the up rows of the same 8 outputs
// (int4.interleave_gated): h = silu(gate) * up is written (N / 2 outputs), each step rounded to the 16-bit type as
// torch computes act(gate) * up; SCALE - h times the next layer's pre_quant_scale (q [N / 2]), rounded once; ORDER - h
// written in that layer's x_order (x_position), so the next GEMM reads it as is. RESIDUAL (not with the others): q
// is a residual [M, N] laid out as y; y = q + the product, the product rounded to the 16-bit type first and the sum
// rounded once (torch's residual + layer(x) in that type), so the layer's residual add needs no kernel of its own.
constexpr int EPI_GATED = 1, EPI_SCALE = 2, EPI_ORDER = 4, EPI_RESIDUAL = 8;

// Where input i sits in x_order: i = 128b + 16(j + 4s) + 4t + e -> 128b + 32t + 8e + 2j + s.
__device__ __forceinline__ int x_position(int i) {
    const int r = i & 127, jj = r >> 4;
    return (i & ~127) + 32 * ((r >> 2) & 3) + 8 * (r & 3) + 2 * (jj & 3) + (jj >> 2);
}

// The warps' partials (acc of RT row tiles) summed in warp order from shared memory; batch rows < M written (EPI: the
// gated outputs instead, one tile a warp).
template <int WARPS, int RT, bool BF16, int EPI = 0>
__device__ __forceinline__ void finish(float (&red)[WARPS][16 * RT][8], const float (&acc)[RT][2][4],
                                       u16* __restrict__ y, int M, int sy, int n0,
                                       const u16* __restrict__ q = nullptr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        red[warp][16 * r + g][2 * t] = acc[r][0][0] + acc[r][1][0];
        red[warp][16 * r + g][2 * t + 1] = acc[r][0][1] + acc[r][1][1];
        red[warp][16 * r + g + 8][2 * t] = acc[r][0][2] + acc[r][1][2];
        red[warp][16 * r + g + 8][2 * t + 1] = acc[r][0][3] + acc[r][1][3];
    }
    __syncthreads();
    if constexpr ((EPI & EPI_GATED) != 0) {
        static_assert(RT == 1, "the gated epilogue takes one row tile a CTA");
        for (int i = threadIdx.x; i < 64; i += WARPS * 32) {
            const int row = i >> 3, col = i & 7;
            if (col < M) {
                float vg = 0.f, vu = 0.f;
#pragma unroll
                for (int k = 0; k < WARPS; ++k) {
                    vg += red[k][row][col];
                    vu += red[k][row + 8][col];
                }
                const float g = widen16<BF16>(round16<BF16>(vg)), u = widen16<BF16>(round16<BF16>(vu));
                const float a = widen16<BF16>(round16<BF16>(g / (1.0f + expf(-g))));
                u16 h = round16<BF16>(a * u);
                const int out = (n0 >> 1) + row;
                if constexpr ((EPI & EPI_SCALE) != 0) h = round16<BF16>(widen16<BF16>(h) * widen16<BF16>(q[out]));
                y[(size_t)col * sy + ((EPI & EPI_ORDER) != 0 ? x_position(out) : out)] = h;
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < 128 * RT; i += WARPS * 32) {
        const int row = i >> 3, col = i & 7;
        if (col < M) {
            float v = 0.f;
#pragma unroll
            for (int k = 0; k < WARPS; ++k) v += red[k][row][col];
            const size_t at = (size_t)col * sy + n0 + row;
            if constexpr ((EPI & EPI_RESIDUAL) != 0) {
                y[at] = round16<BF16>(widen16<BF16>(round16<BF16>(v)) + widen16<BF16>(ld_res(q + at)));
            } else {
                y[at] = round16<BF16>(v);
            }
        }
    }
}

// GS: the group size when it is 16, 32, 64 (groups inside a block) or 128 (one a block); 0: a larger multiple of 128
// (`group` at run time: a division a block).
// RT: row tiles of 16 a warp (a CTA computes 16 RT rows); x's B fragments serve all of them.
// PQS: x is multiplied by pre_quant_scale p [K] as it is loaded (scale_x: torch's x * p, value for value); the
// engine asks for it where the product cannot be fused into the op producing x (the attention output's projection).
// XP: x comes in the x order (XPerm; the layers' views, folded by torch.compile into the op producing x).
template <int WARPS, int UNROLL, int RT, int GS, bool BF16, bool PQS, bool XP, int EPI = 0>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_k8_mma(const u16* __restrict__ x, const uint4* __restrict__ w, const u16* __restrict__ s,
             const u16* __restrict__ p, u16* __restrict__ y, int M, int N, int K, int sx, int ss, int sy, int group) {
    constexpr int PER = GS ? 128 / GS : 1;       // groups in a block of 128 inputs
    constexpr int NS = PER > 1 ? PER / 2 : 1;    // distinct scale pairs a row and block
    __shared__ float red[WARPS][16 * RT][8];
    pdl_wait();  // nothing before it: loading the first codes early measured slower (bench/results, 2026-12-02)
    pdl_release();
    x = after_wait(x);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16 * RT;
    const int nb = K >> 7;
    const u16* xp = x + (size_t)(g < M ? g : M - 1) * sx + (XP ? 32 : 4) * t;
    const u16* pp = p + 4 * t;
    const int tile = nb * 64;  // 128-bit words in a tile of 16 rows
    const uint4* wt = w + (size_t)(n0 >> 4) * tile + 4 * g + t;  // tile n0 / 16, block 0, row g, words 4t..4t+3
    float acc[RT][2][4];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i >> 2][i & 3] = 0.f;
    }
    uint4 wv[UNROLL][RT][2];
    u32 sv[UNROLL][RT][2][NS];
    auto load_codes = [&](int base) {  // a step's codes and scales
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = base + u * WARPS;
            if (b < nb) {
#pragma unroll
                for (int r = 0; r < RT; ++r) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int row = n0 + 16 * r + g + 8 * half;
                        wv[u][r][half] = ld_stream(wt + (size_t)b * 64 + (size_t)r * tile + 32 * half);
#pragma unroll
                        for (int q = 0; q < NS; ++q) {
                            const int lo = GS ? PER * b + q : (128 * b) / group;
                            const int hi = PER > 1 ? lo + PER / 2 : lo;
                            sv[u][r][half][q] = (u32)s[(size_t)lo * ss + row] | ((u32)s[(size_t)hi * ss + row] << 16);
                        }
                    }
                }
            }
        }
    };
    for (int base = warp; base < nb; base += WARPS * UNROLL) {
        load_codes(base);
        typename XSel<XP>::T xv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = base + u * WARPS;
            if (b < nb) load_x<BF16, PQS>(xv[u], xp, pp, b);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (base + u * WARPS < nb) {
#pragma unroll
                for (int r = 0; r < RT; ++r) block_mma<BF16, NS>(acc[r], wv[u][r][0], wv[u][r][1], xv[u], sv[u][r][0],
                                                                   sv[u][r][1]);
            }
        }
    }
    static_assert(!(PQS && EPI), "p is the epilogue's scale or residual there");
    finish<WARPS, RT, BF16, EPI>(red, acc, y, M, sy, n0, p);
}

// TMA variant (sm_90): one row (M == 1), group 128, one 16-row tile a CTA, nb == WARPS * SPW. The tile's codes (one
// contiguous nb KB in the k8 tile order) are staged in shared memory by bulk copies (cp.async.bulk, no per-thread
// loads and no registers held for them), one mbarrier per chunk of WARPS blocks: chunk c holds block c of every warp,
// so warps start on chunk 0 while the others land. The codes are requested before pdl_wait (they are constant; the
// scale loads, one a row and block, are written there too, ptxas moves them after it), x after it by per-thread
// loads (x staged by a bulk copy queued behind the codes came later: 2-3 us slower at gate|up). The arithmetic and
// the reduction are the kernel's above, value for value; XP as there. p is the epilogue's scale or residual (EPI),
// never a pre_quant_scale: the argument list is the register-fed kernel's.
__device__ __forceinline__ u32 saddr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(saddr(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(saddr(dst)), "l"(src), "r"(bytes), "r"(saddr(bar)) : "memory");
}

__device__ __forceinline__ void bulk_wait(unsigned long long* bar) {  // each barrier completes once: phase 0
    u32 done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(saddr(bar)) : "memory");
    }
}

template <int WARPS, int SPW, bool BF16, bool XP, int EPI = 0>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_k8_tma(const u16* __restrict__ x, const uint4* __restrict__ w, const u16* __restrict__ s,
             const u16* __restrict__ p, u16* __restrict__ y, int M, int N, int K, int sx, int ss, int sy, int group) {
    extern __shared__ __align__(128) uint4 staged[];  // the tile's codes [NB * 64]
    __shared__ __align__(8) unsigned long long bar[SPW];
    __shared__ float red[WARPS][16][8];
    constexpr int NB = WARPS * SPW;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int c = 0; c < SPW; ++c) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(saddr(&bar[c])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the codes first: they do not depend on the previous kernel (pdl_wait below)
        const uint4* src = w + (size_t)blockIdx.x * NB * 64;
#pragma unroll
        for (int c = 0; c < SPW; ++c) bulk_load(staged + c * WARPS * 64, src + c * WARPS * 64, WARPS * 1024, &bar[c]);
    }
    u32 sv[SPW][2][1];
#pragma unroll
    for (int i = 0; i < SPW; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const u32 v = s[(size_t)(warp + i * WARPS) * ss + n0 + g + 8 * half];
            sv[i][half][0] = v | (v << 16);
        }
    }
    float acc[1][2][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[0][i >> 2][i & 3] = 0.f;
    pdl_wait();
    pdl_release();
    // (x's pointer as a uint2 pointer plus t: written as x + 4t, 8 warps took 66 registers, 3 CTAs an SM, not 4)
    const uint2* xs = reinterpret_cast<const uint2*>(after_wait(x)) + (XP ? 8 : 1) * t;
#pragma unroll
    for (int i = 0; i < SPW; ++i) {
        const int b = warp + i * WARPS;
        typename XSel<XP>::T xv;
        load_x<BF16, false>(xv, reinterpret_cast<const u16*>(xs), nullptr, b);
        bulk_wait(&bar[i]);
        block_mma<BF16, 1>(acc[0], staged[(b * 16 + g) * 4 + t], staged[(b * 16 + g + 8) * 4 + t], xv, sv[i][0],
                           sv[i][1]);
    }
    finish<WARPS, 1, BF16, EPI>(red, acc, y, M, sy, n0, p);
}
"""


def _b(flag: bool) -> str:
    return "true" if flag else "false"


EPI_GATED, EPI_SCALE, EPI_ORDER, EPI_RESIDUAL = 1, 2, 4, 8  # the epilogue flags (finish's EPI_* above)


def _check_epi(epi: int) -> None:
    if epi & EPI_RESIDUAL and epi != EPI_RESIDUAL:
        raise ValueError("the residual epilogue goes with no other epilogue flag")
    if epi and not epi & (EPI_GATED | EPI_RESIDUAL):
        raise ValueError("the scale and order flags belong to the gated epilogue")


def tma_name(warps: int, spw: int, bf16: bool, xp: bool = False, epi: int = 0) -> str:
    """The name expression of one instantiation of the bulk-copy variant (spw: blocks of 128 inputs a warp; xp: x in
    x_order; epi: the epilogue flags). It has no pre_quant_scale instantiation (with one, 8 and 16 warps spill at its
    64 registers): the register-fed kernel takes those layers."""
    _check_epi(epi)
    return f"w4a16_k8_tma<{warps}, {spw}, {_b(bf16)}, {_b(xp)}, {epi}>"


def name(warps: int, unroll: int, tiles: int, gs: int, bf16: bool, pqs: bool = False, xp: bool = False,
         epi: int = 0) -> str:
    """The name expression of one instantiation (tiles: row tiles of 16 a warp; gs: 16, 32, 64, 128, or 0 for
    groups that are larger multiples of 128; pqs: x multiplied by pre_quant_scale in the kernel; xp: x in x_order,
    not with pqs; epi: the epilogue flags, not with pqs (the gated one: one tile a warp))."""
    if pqs and (xp or epi):
        raise ValueError("pre_quant_scale in the kernel goes with neither x in x_order nor an epilogue")
    _check_epi(epi)
    if epi & EPI_GATED and tiles != 1:
        raise ValueError("the gated epilogue takes one row tile a warp")
    return f"w4a16_k8_mma<{warps}, {unroll}, {tiles}, {gs}, {_b(bf16)}, {_b(pqs)}, {_b(xp)}, {epi}>"

