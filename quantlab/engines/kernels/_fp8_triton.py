"""The Triton kernel of quantlab.engines.kernels.fp8 (imported only where Triton is; read that module first)."""
import triton
import triton.language as tl


@triton.jit
def _step(acc, x_ptr, w_ptr, rows, m, kk, K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] += W[rows, kk] * x[m, kk]: E4M3 codes widened to fp32 exactly, exact products."""
    w = tl.load(w_ptr + rows[:, None] + kk[None, :], eviction_policy="evict_first")
    x = tl.load(x_ptr + m * K + kk)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def fp8_gemv(x_ptr, w_ptr, sa_ptr, sb_ptr, y_ptr, ws_ptr, cnt_ptr, N,  # noqa: PLR0913
             K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
             UNROLL: tl.constexpr, PDL: tl.constexpr = False):
    """y [M, N] = (x [M, K] @ W [N, K]^T) * (scale_a * scale_b), x and W E4M3 codes, with FMAs (no tensor cores).

    Program (n tile, K split, row m) reads BLOCK_N weight rows x K/SPLIT_K inputs, BLOCK_K a step (16 contiguous
    bytes a thread: 128-bit loads; UNROLL: the steps unrolled at compile time). Each code is widened to fp32
    exactly, each product is exact in fp32, and the products go into [BLOCK_N, BLOCK_K] fp32 accumulators summed
    once at the end. Rows past N read row N - 1 (no masked loads) and are not stored. With SPLIT_K > 1 each program
    writes its fp32 partial to the workspace and bumps its tile's counter (an int32 arrival count; values are never
    added atomically); the program that arrives last sums the SPLIT_K partials in split order (deterministic),
    scales, rounds, writes y and re-arms the counter at 0 for the next launch. PDL (launched as a programmatic
    dependent): wait for the previous kernels before anything is read or written, then let the next one start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    M = tl.num_programs(2)
    dtype = y_ptr.dtype.element_ty
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64) * K
    rk = tl.arange(0, BLOCK_K)
    PER_SPLIT: tl.constexpr = K // SPLIT_K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if UNROLL:  # every step's loads visible at once: the compiler may issue them all before the FMAs
        for it in tl.static_range(PER_SPLIT // BLOCK_K):
            acc = _step(acc, x_ptr, w_ptr, rows, m, pid_k * PER_SPLIT + it * BLOCK_K + rk, K)
    else:
        for it in range(PER_SPLIT // BLOCK_K):
            acc = _step(acc, x_ptr, w_ptr, rows, m, pid_k * PER_SPLIT + it * BLOCK_K + rk, K)
    part = tl.sum(acc, axis=1)
    scale = tl.load(sa_ptr) * tl.load(sb_ptr)
    if SPLIT_K == 1:
        tl.store(y_ptr + m * N + rn, (part * scale).to(dtype), mask=mask_n)
    else:
        tile = pid_n * M + m
        tl.store(ws_ptr + (pid_k * M + m) * N + rn, part, mask=mask_n)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for sk in range(SPLIT_K):
                total += tl.load(ws_ptr + (sk * M + m) * N + rn, mask=mask_n, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + m * N + rn, (total * scale).to(dtype), mask=mask_n)
            tl.atomic_xchg(cnt_ptr + tile, 0)
