"""Variants of the tensor-core W4A16 kernel at the 8B decode shapes (one row), timed against the engine's kernel in
one process (GPU): how the k8 tile order, the group-128 scale index and a pre-permuted x were chosen. Each variant's
output is checked against the exact arithmetic (worst/bound <= 1); the loads-only variants bound what the memory
system gives that access pattern. Results: bench/RESULTS.md ("the k8 tile order"), logs mma5_* / mma6_*.

MODE bits of the kernel below: 1 the 16-row tile order (adopted: int4.k8_offset), 2 the next step's codes and scales
loaded before this step's arithmetic, 4 loads only (no arithmetic), 8 each warp a contiguous range of K, 16 x staged
in shared memory, 32 group 128 indexed without a division (adopted: GS = 128), 64 x pre-permuted into the B
fragments' order (no PRMT; the variant reads x_perm, built here in torch). The device functions are _int4_cuda's.
--tma: the engine's bulk-copy kernel (w4a16_k8_tma: a CTA's tile of codes and x staged by cp.async.bulk; adopted
where it wins) at each warp count, against the engine's configuration, and a persistent variant (w4p: CTAs loop
over tiles with 2-3 tiles of codes in flight; not adopted: slower). Logs mma8_* / mma9_*.

    python bench/int4_mma_variants.py [--first | --tma] [OUT.json]
"""
import ctypes
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode as bench  # noqa: E402 - the decode bench's timing helpers

from quantlab.engines.kernels import _int4_cuda, cuda_rtc, int4  # noqa: E402

HELPERS = _int4_cuda.SOURCE  # device functions (and the engine's kernels)
SOURCE = HELPERS + r"""
template <int WARPS, int UNROLL, int RT, int GS, bool BF16, int MODE, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB)
w4x(const u16* __restrict__ x, const uint4* __restrict__ w, const u16* __restrict__ s,
    u16* __restrict__ y, int M, int N, int K, int sx, int ss, int sy, int group) {
    constexpr bool G128 = MODE & 32, XP = MODE & 64;
    constexpr bool TILED = MODE & 1, PREF = MODE & 2, LOADONLY = MODE & 4, CONTIG = MODE & 8, XSH = MODE & 16;
    constexpr int PER = GS ? 128 / GS : 1;
    constexpr int NS = GS ? PER / 2 : 1;
    __shared__ float red[WARPS][16 * RT][8];
    extern __shared__ uint2 xs[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16 * RT;
    const int nb = K >> 7;
    const int kw4 = K >> 5;
    const u16* xp = x + (size_t)(g < M ? g : M - 1) * sx + 4 * t;
    if (XSH) {  // M == 1 only: x[0, :] as uint2 (4 values) in shared memory
        for (int i = threadIdx.x; i < (K >> 2); i += WARPS * 32) xs[i] = *reinterpret_cast<const uint2*>(x + 4 * i);
        __syncthreads();
    }
    // the K blocks of this warp: strided (b = warp + WARPS * i) or contiguous (b = b0 + i)
    const int per = (nb + WARPS - 1) / WARPS;
    const int bstart = CONTIG ? warp * per : warp;
    const int bend = CONTIG ? min(nb, bstart + per) : nb;
    const int bstep = CONTIG ? 1 : WARPS;
    float acc[RT][2][4];
    u32 lacc = 0;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i >> 2][i & 3] = 0.f;
    }
    uint4 wn[UNROLL][RT][2];
    u32 sn[UNROLL][RT][2][NS];
    auto load = [&](int base, uint4 (&wv)[UNROLL][RT][2], u32 (&sv)[UNROLL][RT][2][NS]) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = base + u * bstep;
            if (b < bend) {
#pragma unroll
                for (int r = 0; r < RT; ++r) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int row = n0 + 16 * r + g + 8 * half;
                        const size_t off = TILED ? (((size_t)(row >> 4) * nb + b) * 16 + (row & 15)) * 4 + t
                                                 : (size_t)row * kw4 + 4 * b + t;
                        wv[u][r][half] = ld_stream(w + off);
#pragma unroll
                        for (int q = 0; q < NS; ++q) {
                            const int lo = GS ? PER * b + q : G128 ? b : (128 * b) / group;
                            const int hi = GS ? lo + PER / 2 : lo;
                            sv[u][r][half][q] = (u32)s[(size_t)lo * ss + row] | ((u32)s[(size_t)hi * ss + row] << 16);
                        }
                    }
                }
            }
        }
    };
    if (PREF) load(bstart, wn, sn);
    for (int base = bstart; base < bend; base += bstep * UNROLL) {
        uint4 wv[UNROLL][RT][2];
        u32 sv[UNROLL][RT][2][NS];
        if (PREF) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int r = 0; r < RT; ++r)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        wv[u][r][h] = wn[u][r][h];
#pragma unroll
                        for (int q = 0; q < NS; ++q) sv[u][r][h][q] = sn[u][r][h][q];
                    }
            if (base + bstep * UNROLL < bend) load(base + bstep * UNROLL, wn, sn);
        } else {
            load(base, wv, sv);
        }
        if (LOADONLY) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                if (base + u * bstep < bend)
#pragma unroll
                    for (int r = 0; r < RT; ++r)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            lacc ^= wv[u][r][h].x ^ wv[u][r][h].y ^ wv[u][r][h].z ^ wv[u][r][h].w ^ sv[u][r][h][0];
            continue;
        }
        uint2 xv[UNROLL][XP ? 1 : 8];
        uint4 xb[UNROLL][XP ? 4 : 1];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = base + u * bstep;
            if (b < bend) {
                if (XP) {
                    const uint4* xq = reinterpret_cast<const uint4*>(x + (size_t)(g < M ? g : M - 1) * sx
                                                                     + 128 * b + 32 * t);
#pragma unroll
                    for (int i = 0; i < 4; ++i) xb[u][i] = xq[i];
                } else {
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    xv[u][j] = XSH ? xs[32 * b + 4 * j + t] : *reinterpret_cast<const uint2*>(xp + 128 * b + 16 * j);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (base + u * bstep < bend) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int j0 = 2 * h, j1 = 2 * h + 1;
                        const int q0 = j0 * NS / 4, q1 = j1 * NS / 4;
                        constexpr int NX = XP ? 1 : 8;
                        const u32 b0 = XP ? word(xb[u][e], 2 * h) : pair_of(xv[u][j0 % NX], xv[u][(j0 + 4) % NX], e);
                        const u32 b1 = XP ? word(xb[u][e], 2 * h + 1)
                                          : pair_of(xv[u][j1 % NX], xv[u][(j1 + 4) % NX], e);
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
    if (LOADONLY) {
        if (lacc == 0x9E3779B9u) y[0] = 1;
        return;
    }
    finish<WARPS, RT, BF16>(red, acc, y, M, sy, n0);  // the engine kernel's reduction
}

// ---- persistent bulk-copy variant: CTAs loop over 16-row tiles (tile = blockIdx.x + i * gridDim.x), STAGES tiles
// of codes in flight in shared memory (a stage refilled after the tile that read it is reduced), x staged once, the
// next tile's scales loaded into registers a tile ahead. M == 1, group 128, nb == WARPS * SPW.
template <int WARPS, int SPW, int STAGES, bool BF16>
__global__ void __launch_bounds__(WARPS * 32)
w4p(const u16* __restrict__ x, const uint4* __restrict__ w, const u16* __restrict__ s,
    u16* __restrict__ y, int M, int N, int K, int sx, int ss, int sy, int group) {
    extern __shared__ __align__(128) uint4 sm[];  // STAGES tiles of codes [NB * 64], then x [K / 8]
    __shared__ __align__(8) unsigned long long bar[STAGES + 1];
    __shared__ float red[WARPS][16];
    constexpr int NB = WARPS * SPW;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ntiles = N >> 4;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int c = 0; c <= STAGES; ++c) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(saddr(&bar[c])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bulk_load(sm + STAGES * NB * 64, x, K * 2, &bar[STAGES]);
#pragma unroll
        for (int st = 0; st < STAGES; ++st) {
            const int tile = blockIdx.x + st * gridDim.x;
            if (tile < ntiles) bulk_load(sm + st * NB * 64, w + (size_t)tile * NB * 64, NB * 1024, &bar[st]);
        }
    }
    u32 sv[SPW][2];
    auto scales = [&](int tile) {
#pragma unroll
        for (int i = 0; i < SPW; ++i) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 v = s[(size_t)(warp + i * WARPS) * ss + tile * 16 + g + 8 * half];
                sv[i][half] = v | (v << 16);
            }
        }
    };
    if (blockIdx.x < ntiles) scales(blockIdx.x);
    bulk_wait(&bar[STAGES]);
    const uint2* xs = reinterpret_cast<const uint2*>(sm + STAGES * NB * 64);
    int it = 0;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
        const int st = it % STAGES;
        const u32 parity = (it / STAGES) & 1;
        u32 cur[SPW][2];
#pragma unroll
        for (int i = 0; i < SPW; ++i) { cur[i][0] = sv[i][0]; cur[i][1] = sv[i][1]; }
        if (tile + gridDim.x < ntiles) scales(tile + gridDim.x);
        float acc[2][4];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i >> 2][i & 3] = 0.f;
        {
            u32 done = 0;
            while (!done) {
                asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                             "selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(saddr(&bar[st])), "r"(parity) : "memory");
            }
        }
        const uint4* tw = sm + st * NB * 64;
#pragma unroll
        for (int i = 0; i < SPW; ++i) {
            const int b = warp + i * WARPS;
            uint2 xv[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) xv[j] = xs[32 * b + 4 * j + t];
            const uint4 w0 = tw[(b * 16 + g) * 4 + t], w1 = tw[(b * 16 + g + 8) * 4 + t];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int j0 = 2 * h, j1 = 2 * h + 1;
                    const u32 b0 = pair_of(xv[j0], xv[j0 + 4], e);
                    const u32 b1 = pair_of(xv[j1], xv[j1 + 4], e);
                    const u32 wa = word(w0, e), wb = word(w1, e);
                    mma16816<BF16>(acc[h], dq_pair<BF16>(wa >> (4 * j0), cur[i][0]),
                                   dq_pair<BF16>(wb >> (4 * j0), cur[i][1]), dq_pair<BF16>(wa >> (4 * j1), cur[i][0]),
                                   dq_pair<BF16>(wb >> (4 * j1), cur[i][1]), b0, b1);
                }
            }
        }
        if (t == 0) {
            red[warp][g] = acc[0][0] + acc[1][0];
            red[warp][g + 8] = acc[0][2] + acc[1][2];
        }
        __syncthreads();  // every warp has read stage st and written its partials
        if (threadIdx.x == 0 && tile + STAGES * gridDim.x < ntiles)
            bulk_load(sm + st * NB * 64, w + (size_t)(tile + STAGES * gridDim.x) * NB * 64, NB * 1024, &bar[st]);
        if (threadIdx.x < 16) {
            float v = 0.f;
#pragma unroll
            for (int k = 0; k < WARPS; ++k) v += red[k][threadIdx.x];
            y[tile * 16 + threadIdx.x] = round16<BF16>(v);
        }
        __syncthreads();  // red is read before the next tile writes it
    }
}
"""


def name(warps, unroll, tiles, mode, minb=1, gs=0, bf16=True):
    return f"w4x<{warps}, {unroll}, {tiles}, {gs}, {'true' if bf16 else 'false'}, {mode}, {minb}>"


SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]
BASE = [(4, 1, 1), (8, 1, 1), (16, 1, 1), (8, 2, 1), (4, 1, 2)]
MODES = (0, 1, 32, 33, 64, 65, 96, 97, 104, 105, 5)  # the second run (mma6); --first: the first run's set (mma5)
FIRST = (0, 1, 8, 9, 16, 17, 4, 5, 12, 13)
PREFETCH = (2, 3, 10, 11, 18, 19)  # capped at 64 registers (minb: w4 8 CTAs of 128, w8 4 of 256, w16 2 of 512)


def variants(first: bool) -> list[tuple]:
    if not first:
        return [(w, u, r, m, 1) for w, u, r in BASE for m in MODES]
    out = [(w, u, r, m, 1) for w, u, r in BASE + [(4, 2, 1)] for m in FIRST]
    return out + [(w, 1, 1, m, {4: 8, 8: 4, 16: 2}[w]) for w in (4, 8, 16) for m in PREFETCH]


def x_permuted(x: torch.Tensor) -> torch.Tensor:
    """x with each thread's 16 B-fragment words contiguous: position 128b + 32t + 8e + 4h + 2c + p holds input
    128b + 16(2h + c + 4p) + 4t + e."""
    k = x.shape[1]
    b, t, e, h, c, p = torch.meshgrid(*[torch.arange(d, device=x.device) for d in (k // 128, 4, 4, 2, 2, 2)],
                                      indexing="ij")
    return x[:, (128 * b + 16 * (2 * h + c + 4 * p) + 4 * t + e).reshape(-1)].contiguous()


def row_order(q: torch.Tensor) -> torch.Tensor:
    return int4.layout._untile(q)


COPY_BYTES_PER_S = 4.28e12  # the H200's device-to-device copy (bench/decode.py's environment): the % column's base


def _ranked(rows: list[dict], n: int, k: int) -> list[dict]:
    """Rows sorted by time, each with its share of the copy bandwidth (codes and group-128 scales read)."""
    nbytes = n * k / 2 + n * k / 128 * 2
    for z in rows:
        z["pct_of_copy"] = nbytes / (z["us"] * 1e-6) / COPY_BYTES_PER_S * 100 if math.isfinite(z["us"]) else 0.0
    return sorted(rows, key=lambda z: z["us"])


def _checked_us(run, src: list, y: torch.Tensor, t: dict, exact: bool = True) -> dict:
    """A variant's output on the first copy against the exact answer (worst/bound; skipped for loads-only
    variants), then its microseconds per call over every copy; a variant that fails says why."""
    try:
        worst = float("nan")
        if exact:
            y.zero_()
            run(*src[0])
            torch.cuda.synchronize()
            worst = float(((y.double() - t["exact"]).abs() / t["bound"]).max())
        return {"us": bench.graph_us(lambda: [run(q, st) for q, st in src]) / len(src), "worst": worst,
                "error": None}
    except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
        return {"us": float("inf"), "worst": float("nan"), "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def time_shape(mod, vs: list[tuple], names: list[str], t: dict, n: int, k: int) -> list[dict]:
    """The MODE variants, and the engine's kernel at its CONFIGS entry, on one shape's tensors t."""
    x, tiles = t["x"], [(q, st) for _, _, q, st in t["layers"]]  # the engine's layout
    rows_ = [(row_order(q), st) for q, st in tiles]
    xperm = x_permuted(x)
    cfg = int4.CONFIGS.get((1, n, k))
    us, why = bench._sweep_config(t, cfg)
    out = [{"name": f"engine {cfg}", "us": us, "error": why}]
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    for (w, u, r, mode, minb), nm in zip(vs, names, strict=True):
        if n % (16 * r):
            continue
        xx = xperm if mode & 64 else x
        shared = (k // 4) * 8 if mode & 16 else 0

        def run(q, st, xx=xx, w=w, r=r, nm=nm, shared=shared):
            mod.launch(nm, (n // (16 * r), 1, 1), (32 * w, 1, 1),
                       [xx, q, st, y, 1, n, k, xx.stride(0), st.stride(0), y.stride(0), 128], shared=shared)

        res = _checked_us(run, tiles if mode & 1 else rows_, y, t, exact=not mode & 4)
        out.append({"name": f"w{w}u{u}r{r} mode{mode} minb{minb}", **res})
    return _ranked(out, n, k)


TMA_WARPS = (4, 8, 16)


def time_tma(t: dict, n: int, k: int) -> list[dict]:
    """The engine's bulk-copy kernel (int4.k8_launch with a "tma" configuration) at each warp count, against the
    engine's CONFIGS entry and the register-fed kernel's default."""
    cfgs = [("engine", int4.CONFIGS.get((1, n, k))), ("engine mma default", int4.mma_config(k))]
    cfgs += [(f"tma w{w}", {"mma": True, "tma": True, "warps": w}) for w in TMA_WARPS
             if int4.tma_applies(1, n, k, 128, torch.bfloat16, "cuda", w)]
    out = []
    for label, cfg in cfgs:
        us, why = bench._sweep_config(t, cfg)
        out.append({"name": f"{label} {cfg}", "us": us, "error": why})
    return out


def pers_name(warps: int, spw: int, stages: int) -> str:
    return f"w4p<{warps}, {spw}, {stages}, true>"


PERS = [(8, 4, 2), (8, 4, 3), (4, 8, 2), (4, 8, 3), (16, 2, 2), (16, 2, 3)]  # K = 4096


def time_pers(mod, t: dict, n: int, k: int) -> list[dict]:
    """The persistent bulk-copy variant: grid = CTAs that fit an SM (the driver's occupancy, and half of it) x
    SMs, capped by the tiles."""
    x, tiles = t["x"], [(q, st) for _, _, q, st in t["layers"]]
    y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    drv = cuda_rtc.driver()
    out = []
    for w, spw, stages in (PERS if k == 4096 else []):
        nm = pers_name(w, spw, stages)
        shared = stages * (k // 128) * 1024 + k * 2
        mod.allow_shared(nm, shared)
        occ = ctypes.c_int()
        cuda_rtc._cu_check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(occ), mod.functions[nm], 32 * w, ctypes.c_size_t(shared)), "occupancy")
        for mult in (1, 2):
            ctas = min(n // 16, max(1, occ.value // mult) * sms)

            def run(q, st, nm=nm, w=w, shared=shared, ctas=ctas):
                mod.launch(nm, (ctas, 1, 1), (32 * w, 1, 1),
                           [x, q, st, y, 1, n, k, x.stride(0), st.stride(0), y.stride(0), 128], shared=shared)

            out.append({"name": f"{nm} ctas={ctas}", **_checked_us(run, tiles, y, t)})
    return out


def main() -> int:
    first = "--first" in sys.argv
    dest = next((a for a in sys.argv[1:] if not a.startswith("--")), None)
    t0 = time.time()
    tma = "--tma" in sys.argv
    vs = [] if tma else variants(first)
    names = [name(*v) for v in vs]
    if tma:
        names += [pers_name(*v) for v in PERS]
    cubin, lowered = cuda_rtc.compile_kernels(SOURCE, names, "90")
    mod = cuda_rtc.Module(cubin, lowered)
    print(f"compiled {len(names)} variants in {time.time() - t0:.1f}s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "shapes": {}}
    for n, k in SHAPES:
        t = bench._sweep_tensors(1, n, k, g)  # one set of tensors a shape: every variant reads the same copies
        rows = _ranked(time_tma(t, n, k) + time_pers(mod, t, n, k), n, k) if tma else \
            time_shape(mod, vs, names, t, n, k)
        res["shapes"][f"N{n}_K{k}"] = rows
        print(f"== N={n} K={k} (% of a {COPY_BYTES_PER_S / 1e12:.2f} TB/s copy)", flush=True)
        for z in rows:
            print(f"   {z['name'][:60]:60s} {z['us']:7.2f}us {z['pct_of_copy']:5.1f}% worst/bound "
                  f"{z.get('worst', float('nan')):.3f} {z.get('error') or ''}", flush=True)
        del t
        torch.cuda.empty_cache()
    return bench.finish(res, t0, dest)


if __name__ == "__main__":
    sys.exit(main())
