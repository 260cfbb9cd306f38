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

// GS: the group size when it is 16, 32, 64 (groups inside a block) or 128 (one a block); 0: a larger multiple of 128
// (`group` at run time: a division a block).
// RT: row tiles of 16 a warp (a CTA computes 16 RT rows); x's B fragments serve all of them.
template <int WARPS, int UNROLL, int RT, int GS, bool BF16>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_k8_mma(const u16* __restrict__ x, const uint4* __restrict__ w, const u16* __restrict__ s,
             u16* __restrict__ y, int M, int N, int K, int sx, int ss, int sy, int group) {
    constexpr int PER = GS ? 128 / GS : 1;       // groups in a block of 128 inputs
    constexpr int NS = PER > 1 ? PER / 2 : 1;    // distinct scale pairs a row and block
    __shared__ float red[WARPS][16 * RT][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16 * RT;
    const int nb = K >> 7;
    const u16* xp = x + (size_t)(g < M ? g : M - 1) * sx + 4 * t;
    const int tile = nb * 64;  // 128-bit words in a tile of 16 rows
    const uint4* wt = w + (size_t)(n0 >> 4) * tile + 4 * g + t;  // tile n0 / 16, block 0, row g, words 4t..4t+3
    float acc[RT][2][4];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i >> 2][i & 3] = 0.f;
    }
    for (int base = warp; base < nb; base += WARPS * UNROLL) {
        uint4 wv[UNROLL][RT][2];
        uint2 xv[UNROLL][8];
        u32 sv[UNROLL][RT][2][NS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {   // every load of the step first
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
#pragma unroll
                for (int j = 0; j < 8; ++j) xv[u][j] = *reinterpret_cast<const uint2*>(xp + 128 * b + 16 * j);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (base + u * WARPS < nb) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int j0 = 2 * h, j1 = 2 * h + 1;   // pairs (j0, j0 + 4) and (j1, j1 + 4)
                        const int q0 = j0 * NS / 4, q1 = j1 * NS / 4;
                        const u32 b0 = pair_of(xv[u][j0], xv[u][j0 + 4], e);
                        const u32 b1 = pair_of(xv[u][j1], xv[u][j1 + 4], e);
#pragma unroll
                        for (int r = 0; r < RT; ++r) {
                            const u32 wa = word(wv[u][r][0], e), wb = word(wv[u][r][1], e);
                            const u32 a0 = dq_pair<BF16>(wa >> (4 * j0), sv[u][r][0][q0]);
                            const u32 a1 = dq_pair<BF16>(wb >> (4 * j0), sv[u][r][1][q0]);
                            const u32 a2 = dq_pair<BF16>(wa >> (4 * j1), sv[u][r][0][q1]);
                            const u32 a3 = dq_pair<BF16>(wb >> (4 * j1), sv[u][r][1][q1]);
                            mma16816<BF16>(acc[r][h], a0, a1, a2, a3, b0, b1);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        red[warp][16 * r + g][2 * t] = acc[r][0][0] + acc[r][1][0];
        red[warp][16 * r + g][2 * t + 1] = acc[r][0][1] + acc[r][1][1];
        red[warp][16 * r + g + 8][2 * t] = acc[r][0][2] + acc[r][1][2];
        red[warp][16 * r + g + 8][2 * t + 1] = acc[r][0][3] + acc[r][1][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 128 * RT; i += WARPS * 32) {
        const int row = i >> 3, col = i & 7;
        if (col < M) {
            float v = 0.f;
#pragma unroll
            for (int k = 0; k < WARPS; ++k) v += red[k][row][col];
            y[(size_t)col * sy + n0 + row] = round16<BF16>(v);
        }
    }
}
"""


def name(warps: int, unroll: int, tiles: int, gs: int, bf16: bool) -> str:
    """The name expression of one instantiation (tiles: row tiles of 16 a warp; gs: 16, 32, 64, 128, or 0 for
    groups that are larger multiples of 128)."""
    return f"w4a16_k8_mma<{warps}, {unroll}, {tiles}, {gs}, {'true' if bf16 else 'false'}>"
