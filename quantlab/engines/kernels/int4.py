"""W4A16 GEMM on weights that stay packed: y = (x * pre_quant_scale) @ dequant(W)^T.

The arithmetic is the dequantized layer's (qlayers.Int4AwqLinear on the CPU), value for value: the input times
pre_quant_scale rounded to the compute dtype, each weight q * scale computed exactly in fp32 and rounded once to the
compute dtype, products accumulated in fp32, the output rounded to the compute dtype. Only the order of the fp32
accumulation differs from a dequantize-then-GEMM.

Two layouts, two kernel families (and, for the k8 layout at up to 8 rows on CUDA devices, a CUDA C++ kernel on
tensor cores compiled at run time by NVRTC: see "k8 on tensor cores" below and _int4_cuda; decode at batch 1 takes
it where it compiles and passes its check, else the Triton one-row kernel):
- k8 (what the engine runs): `repack` rewrites the export's codes once at load into int32 [N, K/8], 8 codes of one
  output row per word along K (offset binary; within each block of 128 inputs, nibble j of word i is input 128b + 16j
  + i), stored in tiles of 16 rows: the 16 words of block b of rows 16T..16T+15 are one contiguous 1 KB (word offset
  ((T * K/128 + b) * 16 + row % 16) * 16 + i, `k8_offset`), so a warp reading eight rows' block reads 512 contiguous
  bytes; and the scales transposed to [K/group, N] (one coalesced vector per group). `k8_launch` runs, for one row
  (decode at batch 1), the FMA kernel w4a16_k8_gemv (split over K like the next one; on the GPU in bf16 / fp16 each
  pair of weights is dequantized by a short PTX block: the two codes moved into one register's 16-bit halves with a
  LOP3 and the magic-number trick, u - 8 by a packed FMA (exact), times the two scales by a packed FMA (RN: the one
  rounding of q * scale to the compute dtype), each half widened exactly to fp32 for the FMAs with x; in Triton's
  interpreter the same values come from Triton arithmetic: the contract above is unchanged); up to DENSE_ROWS rows,
  one split-K kernel (w4a16_k8: every SM streams codes; partials reduced in fp32 by the last program of each tile, in
  a fixed order) in one of two modes - tensor-core products of dequantized 16-wide tiles (`dot`), or FMAs (one row per
  program) - with a configuration per shape (`k8_config`: the table CONFIGS that bench/decode.py --check's sweep fills
  and prints, else a default); from DENSE_ROWS rows on (prefill) it dequantizes the layer into a temporary and lets
  torch's GEMM multiply. Op: quantlab::w4a16_k8.
- export (the fallback): the export's own layout read as is (uint8 [N/2, K], rows 2r / 2r+1 in the low / high
  nibble, two's complement; scales [N, K/group]): a GEMV for one row and a tensor-core GEMM. Op: quantlab::w4a16_mm.
  Layers keep this layout where the k8 kernels do not apply (N not in tiles of 16, K not a multiple of 128, a group
  size that does not tile 128) or fail their check on the device (`k8_usable`, run once per device and dtype before
  any layer is repacked).

K is a compile-time constant (a model has two or three input widths; loop bounds known to the compiler are what
Triton's CPU interpreter needs under NumPy 2.4). Both ops are torch custom ops, so torch.compile traces through them
and CUDA graphs capture them. A layer holds N*K/2 bytes of codes and N*K/group scales, never dequantized weights.
"""
from __future__ import annotations

import functools
import logging
import math
import os

import torch

from quantlab.engines.int4_codes import from_x_order, in_x_order, unpack_int4
from quantlab.engines.kernels import cuda_rtc
from quantlab.engines.kernels._int4_cuda import EPI_GATED, EPI_ORDER, EPI_RESIDUAL, EPI_SCALE
from quantlab.engines.kernels.scratch import Scratch

log = logging.getLogger("quantlab")
GEMV_MAX_ROWS = 1  # export layout: rows handled by the GEMV kernel; more rows use the tensor-core GEMM
DENSE_ROWS = 256  # k8: from this many rows on, dequantize into a temporary and multiply with torch's GEMM
TARGET_WAVES = 4  # k8 default: split K until the grid holds this many programs per SM


@functools.cache
def available() -> bool:
    """Triton imports (on CUDA builds of torch it does; the interpreter runs it on the CPU for tests)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no kernel here
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1: the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    import triton

    from quantlab.engines.kernels import _int4_triton

    return triton, _int4_triton


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def gemv_config(k: int, group: int) -> dict:
    """Launch parameters of the export-layout GEMV."""
    groups = _pow2_at_most(max(1, 256 // group), k // group)  # 256 inputs a step: 16 fp32 accumulators a thread
    return {"GROUPS": groups, "BLOCK_N2": 8, "num_warps": 4}


def gemm_config(m: int, group: int) -> dict:
    """Launch parameters of the export-layout GEMM."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_k = _pow2_at_most(group, 64 if block_m >= 64 else 128)
    return {"BLOCK_M": block_m, "BLOCK_N2": 32 if block_m <= 32 else 64, "BLOCK_K": block_k,
            "num_warps": 4 if block_m <= 64 else 8, "num_stages": 3}


def w4a16_launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
                 group: int, config: dict | None = None, gemv: bool | None = None) -> torch.Tensor:
    """Export layout: x [M, K] (compute dtype), packed uint8 [N/2, K], scales [N, K/group] -> y [M, N]."""
    triton, kernels = _kernels()
    m, k = x.shape
    n2 = packed.shape[0]
    x = x.contiguous()
    y = torch.empty(m, 2 * n2, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    p = pqs if pqs is not None else scales  # any pointer: unused when HAS_PQS is False
    if gemv if gemv is not None else m <= GEMV_MAX_ROWS:
        cfg = config or gemv_config(k, group)
        meta = {key: v for key, v in cfg.items() if key not in ("num_warps", "num_stages")}
        grid = (triton.cdiv(n2, meta["BLOCK_N2"]), m)
        kernels.w4a16_gemv[grid](x, packed, scales, p, y, n2, k, x.stride(0), y.stride(0), scales.stride(0),
                                 GROUP=group, KSTEP=meta["GROUPS"] * group, HAS_PQS=pqs is not None,
                                 num_warps=cfg.get("num_warps", 4), **meta)
    else:
        cfg = config or gemm_config(m, group)
        meta = {key: v for key, v in cfg.items() if key not in ("num_warps", "num_stages")}
        grid = (triton.cdiv(n2, meta["BLOCK_N2"]), triton.cdiv(m, meta["BLOCK_M"]))
        kernels.w4a16_gemm[grid](x, packed, scales, p, y, m, n2, k, x.stride(0), y.stride(0), scales.stride(0),
                                 GROUP=group, HAS_PQS=pqs is not None,
                                 F32_DOT=x.dtype == torch.float32 or interpreted(),
                                 num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **meta)
    return y


@torch.library.custom_op("quantlab::w4a16_mm", mutates_args=())
def w4a16_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
             group: int) -> torch.Tensor:
    """The packed W4A16 GEMM as one opaque op (traced by torch.compile, captured by CUDA graphs)."""
    return w4a16_launch(x, packed, scales, pqs, group)


@w4a16_mm.register_fake
def _(x, packed, _scales, _pqs, _group):
    return x.new_empty(x.shape[0], 2 * packed.shape[0])


def reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
              group: int) -> torch.Tensor:
    """The same arithmetic in plain torch (export layout): dequantize (q * scale in fp32, rounded to the compute
    dtype), GEMM."""
    dtype = x.dtype
    if pqs is not None:
        x = x * pqs
    w = (unpack_int4(packed).float() * scales.float().repeat_interleave(group, dim=1)).to(dtype)
    return x @ w.t()


# ------------------------------------------------------------------------------------------------ the k8 layout
K8_TILE = 16  # rows a k8 tile holds


def k8_supported(n: int, k: int, group: int) -> bool:
    """Whether the k8 kernels take a layer of N outputs and K inputs and this group size (N in tiles of 16; K in
    blocks of 128; a group that is a multiple of 16 and divides 128, or a multiple of 128)."""
    return (n % K8_TILE == 0 and k % 128 == 0 and group % 16 == 0 and (128 % group == 0 or group % 128 == 0)
            and k % group == 0)


def k8_offset(row, word, kw: int):
    """The int32 offset of (row, word) in a k8 tensor of kw = K/8 words a row (ints or integer tensors): tiles of
    16 rows, each block of 16 words of the tile's rows contiguous."""
    return ((row // K8_TILE) * (kw // 16) + word // 16) * (16 * K8_TILE) + (row % K8_TILE) * 16 + word % 16


def _tile(words: torch.Tensor) -> torch.Tensor:
    """[N, K/8] words in row order -> the k8 tile order (same shape)."""
    n, kw = words.shape
    return words.view(n // K8_TILE, K8_TILE, kw // 16, 16).permute(0, 2, 1, 3).reshape(n, kw)


def _untile(qweight: torch.Tensor) -> torch.Tensor:
    """The k8 tile order -> [N, K/8] words in row order."""
    n, kw = qweight.shape
    return qweight.reshape(n // K8_TILE, kw // 16, K8_TILE, 16).permute(0, 2, 1, 3).reshape(n, kw)


def repack(packed: torch.Tensor, scales: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Export layout -> k8, on the tensors' device: codes uint8 [N/2, K] -> int32 [N, K/8], scales [N, K/group] ->
    [K/group, N] (contiguous); the codes in tiles of 16 rows (k8_offset). Chunked over rows (the int64 temporaries
    are 16x the codes)."""
    n2, k = packed.shape
    if (2 * n2) % K8_TILE:
        raise ValueError(f"the k8 layout takes rows in tiles of {K8_TILE}; this layer has {2 * n2}")
    out = torch.empty(2 * n2, k // 8, dtype=torch.int32, device=packed.device)
    step = max(1, rows_per_chunk // 2)
    for r in range(0, n2, step):
        u = (unpack_int4(packed[r: r + step]).to(torch.int64) + 8).view(-1, k // 128, 8, 16)  # [n, b, j, i]
        words = torch.zeros(u.shape[0], k // 128, 16, dtype=torch.int64, device=packed.device)
        for j in range(8):
            words |= u[:, :, j] << (4 * j)
        words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the int32 with these bits
        out[2 * r: 2 * r + u.shape[0]] = words.view(u.shape[0], k // 8).to(torch.int32)
    return _tile(out), scales.t().contiguous()


def k8_codes(qweight: torch.Tensor) -> torch.Tensor:
    """k8 int32 [N, K/8] -> the signed codes int8 [N, K] (input order)."""
    n, kw = qweight.shape
    w = _untile(qweight).to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(w >> (4 * j)) & 15 for j in range(8)], dim=1)  # [N, 8 (j), K/8 (b, i)]
    nib = nib.view(n, 8, kw // 16, 16).permute(0, 2, 1, 3)  # [N, b, j, i]: input 128b + 16j + i
    return (nib.reshape(n, kw * 8) - 8).to(torch.int8)


def k8_dequantized(qweight: torch.Tensor, scales_t: torch.Tensor, group: int) -> torch.Tensor:
    """The weights the k8 kernels multiply, in plain torch: q * scale in fp32, rounded to the scales' dtype [N, K]."""
    return (k8_codes(qweight).float() * scales_t.t().float().repeat_interleave(group, dim=1)).to(scales_t.dtype)


_SCRATCH = Scratch(1 << 22, 1 << 16)  # the split-K workspace and tile counters


def reset_counters() -> None:
    """Zero every device's tile counters (after a launch that may have stopped half way, e.g. in a sweep)."""
    _SCRATCH.reset_counters()


def m_bucket(m: int) -> int:
    """The row class a configuration is chosen for: 1, 16, 32, 64 or 128 (DENSE_ROWS rows and more: dense)."""
    return 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


# (row class, N, K) -> configuration; bench/decode.py --check's sweep fills it for the run and prints it to commit.
# One row at the Llama-3.1-8B shapes (fused q|k|v and gate|up): the tensor-core kernel (gate|up its bulk-copy
# variant), the sweep's table from the H200 runs bench/results/h200-2026-12-02/mma7_tiled_decode.log and
# mma9_tma_decode.log (where that kernel cannot run, k8_launch takes the one-row Triton kernel's default instead).
CONFIGS: dict[tuple[int, int, int], dict] = {
    (1, 4096, 4096): {"mma": True, "warps": 16, "unroll": 1, "tiles": 1},
    (1, 4096, 14336): {"mma": True, "warps": 16, "unroll": 1, "tiles": 1},
    (1, 6144, 4096): {"mma": True, "tma": True, "warps": 8},
    (1, 28672, 4096): {"mma": True, "tma": True, "warps": 8},
}


@functools.cache
def _sm_count(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4


def valid_splits(k: int, bpi: int) -> list[int]:
    """Split counts the k8 kernel takes for K inputs and `bpi` blocks a step: each split an equal whole number of
    steps."""
    blocks = k // 128
    return [s for s in range(1, blocks + 1) if blocks % s == 0 and (blocks // s) % bpi == 0]


def first_split(splits: list[int], tiles: int, sms: int) -> int:
    """The smallest of a kernel's valid splits (ascending) that gives `tiles` output tiles TARGET_WAVES programs per
    SM, else the largest (the k8 kernels' and the FP8 GEMV's default)."""
    return next((s for s in splits if tiles * s >= TARGET_WAVES * sms), splits[-1])


def default_split(tiles: int, k: int, bpi: int, sms: int) -> int:
    """The k8 kernels' default split: first_split over valid_splits(k, bpi)."""
    return first_split(valid_splits(k, bpi), tiles, sms)


def k8_dot_config(m: int, n: int, k: int, device: str = "cuda") -> dict:
    """The split-K kernel's default: tensor-core mode, 64 output rows a program, 2 blocks a step, K split for
    TARGET_WAVES programs per SM."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    bpi = 2 if (k // 128) % 2 == 0 else 1
    tiles = -(-n // 64) * -(-m // block_m)
    return {"dot": True, "block_n": 64, "block_m": block_m, "bpi": bpi,
            "split_k": default_split(tiles, k, bpi, _sm_count(device)), "num_warps": 4, "num_stages": 2}


def k8_gemv_config(n: int, k: int, device: str = "cuda", block_n: int = 64, bpi: int = 2,
                   num_warps: int = 4) -> dict:
    """The one-row kernel's configuration: block_n rows a program, bpi blocks a step (fewer where K has fewer), K
    split for TARGET_WAVES programs per SM."""
    while bpi > 1 and not valid_splits(k, bpi):
        bpi //= 2
    return {"gemv": True, "block_n": block_n, "bpi": bpi,
            "split_k": default_split(-(-n // block_n), k, bpi, _sm_count(device)), "num_warps": num_warps}


def k8_route(m: int, n: int, k: int, device: str, ready) -> dict:
    """The configuration k8_launch runs for M rows by default: the sweep's entry (CONFIGS) where there is one and
    it can run here, else at one row the tensor-core kernel where `ready()` (it compiles and passed its check for
    this shape, dtype and device), else the Triton kernels' defaults (k8_config)."""
    cfg = k8_config(m, n, k, device)
    if cfg.get("mma"):
        if m <= MMA_ROWS and ready():
            return cfg
        return k8_gemv_config(n, k, device) if m == 1 else k8_dot_config(m, n, k, device)
    if m == 1 and (1, n, k) not in CONFIGS and ready():
        return mma_config(k)
    return cfg


def k8_config(m: int, n: int, k: int, device: str = "cuda") -> dict:
    """The configuration of the k8 kernels for M rows of an [N, K] layer: the sweep's (CONFIGS), else the default:
    one row the FMA kernel (k8_gemv_config), more rows the tensor-core split-K kernel (k8_dot_config)."""
    cfg = CONFIGS.get((m_bucket(m), n, k))
    if cfg is not None and (cfg.get("mma") or cfg["split_k"] in valid_splits(k, cfg["bpi"])):
        return cfg  # a tensor-core entry where that kernel cannot run is replaced in k8_launch
    return k8_gemv_config(n, k, device) if m == 1 else k8_dot_config(m, n, k, device)


def _k8_dense(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, pqs: torch.Tensor | None,
              group: int) -> torch.Tensor:
    """Many rows: the layer dequantized into a temporary by a kernel (the k8 kernel's weight values), then torch's
    GEMM (fp32 accumulation: reduced-precision reductions off for the call)."""
    triton, kernels = _kernels()
    n, k = qweight.shape[0], x.shape[1]
    w = torch.empty(n, k, dtype=x.dtype, device=x.device)
    kernels.w4a16_k8_dequant[(triton.cdiv(n, 64), k // 128)](qweight, scales_t, w, n, scales_t.stride(0), k,
                                                             GROUP=group, BLOCK_N=64,
                                                             FAST=x.dtype in (torch.bfloat16, torch.float16))
    if pqs is not None:
        x = x * pqs
    if not x.is_cuda:
        return x @ w.t()
    flags = torch.backends.cuda.matmul
    saved = flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = flags.allow_fp16_reduced_precision_reduction = False
    try:
        return x @ w.t()
    finally:
        flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = saved


def k8_launch(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, pqs: torch.Tensor | None, group: int,
              config: dict | None = None) -> torch.Tensor:
    """k8 layout: x [M, K] (compute dtype), qweight int32 [N, K/8], scales_t [K/group, N] (unit stride along N)
    -> y [M, N] in x's dtype. config: a k8_config-style dict, or {"dense": True}; None: by shape."""
    triton, kernels = _kernels()
    m, k = x.shape
    n = qweight.shape[0]
    x = x.contiguous()
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    if (config or {}).get("dense") or (config is None and m >= DENSE_ROWS):
        return _k8_dense(x, qweight, scales_t, pqs, group)
    if config is None:
        cfg = k8_route(m, n, k, str(x.device), lambda: mma_ready(x, n, k, group))
    else:
        cfg = config
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if cfg.get("xp"):  # the kernel reading x in its input order (checks, the sweep): x ordered here, as the layers do
        if pqs is not None:
            x, pqs = x * pqs, None
        return _k8_mma(in_x_order(x), qweight, scales_t, None, group, cfg, y, explicit=True)
    if cfg.get("mma"):
        try:
            return _k8_mma(x, qweight, scales_t, pqs, group, cfg, y, explicit=config is not None)
        except MmaUnavailable as exc:
            if config is not None:
                raise
            log.warning("int4: %s; the Triton kernels run instead", exc)
            cfg = k8_route(m, n, k, str(x.device), lambda: False)
    if cfg.get("gemv") and m == 1:
        return _k8_gemv(x, qweight, scales_t, pqs, group, cfg, y)
    dot, split = cfg["dot"], cfg["split_k"]
    block_m = cfg["block_m"] if dot else 1
    grid = (triton.cdiv(n, cfg["block_n"]), split, triton.cdiv(m, block_m))
    ws, cnt = _SCRATCH.get(x.device, split * m * n if split > 1 else 0, grid[0] * grid[2])
    kernels.w4a16_k8[grid](x, qweight, scales_t, pqs if pqs is not None else scales_t, y, ws, cnt, m, n, x.stride(0),
                           y.stride(0), scales_t.stride(0), k, GROUP=group, BLOCK_N=cfg["block_n"], BLOCK_M=block_m,
                           SPLIT_K=split, BPI=cfg["bpi"], DOT=dot, HAS_PQS=pqs is not None,
                           F32_DOT=x.dtype == torch.float32 or interpreted(),
                           FAST=x.dtype in (torch.bfloat16, torch.float16),
                           num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))
    return y


def ptx16(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether 16-bit packed PTX runs here: bf16 / fp16 on a CUDA device of compute capability 8.0 or later, not in
    Triton's interpreter (which runs the same arithmetic written in Triton). The one-row Triton kernel's PTX
    dequantization needs it, and the tensor-core kernel (mma_on)."""
    return (dtype in (torch.bfloat16, torch.float16) and torch.device(device).type == "cuda" and not interpreted()
            and cuda_rtc.capability(device) >= (8, 0))


def _k8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, pqs: torch.Tensor | None, group: int,
             cfg: dict, y: torch.Tensor) -> torch.Tensor:
    """One row: the FMA kernel w4a16_k8_gemv (split over K as configured) into y [1, N]."""
    triton, kernels = _kernels()
    k = x.shape[1]
    n = qweight.shape[0]
    split = cfg["split_k"]
    grid = (triton.cdiv(n, cfg["block_n"]), split)
    ws, cnt = _SCRATCH.get(x.device, split * n if split > 1 else 0, grid[0])
    kernels.w4a16_k8_gemv[grid](x, qweight, scales_t, pqs if pqs is not None else scales_t, y, ws, cnt, n,
                                scales_t.stride(0), k, GROUP=group, BLOCK_N=cfg["block_n"], SPLIT_K=split,
                                BPI=cfg["bpi"], HAS_PQS=pqs is not None, ASM=ptx16(x.dtype, x.device),
                                FAST=x.dtype in (torch.bfloat16, torch.float16),
                                num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 1))
    return y


# ------------------------------------------------------------------------------------------------ k8 on tensor cores
# Up to MMA_ROWS rows (decode), bf16 / fp16 on CUDA devices of compute capability 8.0 or later: the CUDA C++ kernel
# of _int4_cuda (register-fed mma.sync, ~2.6 instructions per weight against the one-row FMA kernel's ~5.5),
# compiled once per device and configuration by NVRTC (cuda_rtc) and checked against float64 before first use
# (mma_usable). Where NVRTC is missing or the check fails, the Triton kernels above run (the reason is logged).
MMA_ROWS = 8
# (warps, blocks loaded ahead, row tiles a warp) the sweep times: at most 16 tiles x blocks a CTA (more spill)
MMA_SHAPES = tuple((w, u, r) for w in (4, 8, 16) for u in (1, 2, 4) for r in (1, 2) if w * u * r <= 16)
_MMA_MODULES: dict = {}
_MMA_USABLE: dict = {}


def mma_config(k: int, warps: int | None = None, unroll: int = 1, tiles: int = 1) -> dict:
    """The tensor-core kernel's configuration for a layer of K inputs: a CTA of `warps` warps on 16 output rows, the
    warps splitting K (default: about 4 blocks of 128 inputs a warp, 4 to 16 warps), `unroll` blocks of loads issued
    before their arithmetic, `tiles` row tiles of 16 a warp (x's fragments shared). The sweep's choices live in
    CONFIGS (k8_route)."""
    if warps is None:
        warps = _pow2_at_most(max(4, k // 128 // 4), 16)
    return {"mma": True, "warps": warps, "unroll": unroll, "tiles": tiles}


TMA_MAX_SHARED = 100 * 1024  # the bulk-copy variant's staging (codes of a tile): two CTAs an SM at least


def tma_shared(k: int) -> int:
    """Bytes of dynamic shared memory the bulk-copy variant stages for K inputs: a 16-row tile's codes (1 KB a block
    of 128 inputs)."""
    return (k // 128) * 1024


def tma_shape(m: int, n: int, k: int, group: int, dtype: torch.dtype, warps: int) -> bool:
    """Shapes the bulk-copy variant of the tensor-core kernel takes: one row, group 128, the K blocks in whole
    rounds of `warps` (at most 8 a warp), its staging (a tile's codes) within TMA_MAX_SHARED."""
    nb = k // 128
    return (m == 1 and group == 128 and mma_applies(m, n, k, group, dtype) and nb % warps == 0
            and nb // warps <= 8 and tma_shared(k) <= TMA_MAX_SHARED)


def tma_applies(m: int, n: int, k: int, group: int, dtype: torch.dtype, device: torch.device | str,
                warps: int) -> bool:
    """tma_shape on a CUDA device of compute capability 9.x or 10.x (cp.async.bulk, and 227 KB of shared memory a
    block: consumer parts of later generations have 99 KB)."""
    return (tma_shape(m, n, k, group, dtype, warps) and torch.device(device).type == "cuda"
            and cuda_rtc.capability(device)[0] in (9, 10))


def mma_applies(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> bool:
    """Shapes and dtypes the tensor-core kernel takes: up to MMA_ROWS rows, N a multiple of 16, the k8 layout, a
    16-bit compute dtype."""
    return m <= MMA_ROWS and k8_supported(n, k, group) and dtype in (torch.bfloat16, torch.float16)


def mma_on(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the tensor-core kernel runs on this device and dtype: the hardware of ptx16, and it passed its check
    there (mma_usable)."""
    return ptx16(dtype, device) and mma_usable(str(device), dtype)


def mma_ready(x: torch.Tensor, n: int, k: int, group: int) -> bool:
    """Whether x's rows go to the tensor-core kernel: the shape applies and mma_on(x's device, x's dtype)."""
    return mma_applies(x.shape[0], n, k, group, x.dtype) and mma_on(x.device, x.dtype)


def k8_kernels(device: str, dtype: torch.dtype) -> str:
    """What multiplies a k8-layout layer on this device and dtype, in words (the engine's kernel description)."""
    few = ("CUDA tensor-core kernel (NVRTC; its bulk-copy variant where CONFIGS picks it) for one row"
           if mma_on(device, dtype) else "triton one-row GEMV")
    return f"W4A16, weights kept packed (k8 layout): {few}, triton split-K GEMM for more rows"


class MmaUnavailable(RuntimeError):
    """An instantiation of the tensor-core kernel did not compile or load, or failed its first-use check."""


_MMA_BAD: dict = {}


def _mma_kernel(device: torch.device, cfg: dict, group: int, dtype: torch.dtype, k_of_tma: int = 0,
                pqs: bool = False):
    """(module, name) of the configuration's instantiation on this device (pqs: the one multiplying x by
    pre_quant_scale): compiled on first use and checked on one small case against float64 before it multiplies
    anything (MmaUnavailable, with the reason, where either fails; remembered for the process)."""
    from quantlab.engines.kernels import _int4_cuda

    bf16, xp, epi = dtype == torch.bfloat16, bool(cfg.get("xp")), cfg.get("epi", 0)
    if cfg.get("tma"):
        name = _int4_cuda.tma_name(cfg["warps"], k_of_tma // 128 // cfg["warps"], bf16, xp, epi)
    else:
        name = _int4_cuda.name(cfg["warps"], cfg["unroll"], cfg.get("tiles", 1), group if group <= 128 else 0, bf16,
                               pqs, xp, epi)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, name)
    if key in _MMA_BAD:
        raise MmaUnavailable(_MMA_BAD[key])
    if key not in _MMA_MODULES:
        major, minor = cuda_rtc.capability(f"cuda:{index}")
        try:
            with torch.cuda.device(index):
                torch.empty(1, device=f"cuda:{index}")  # the primary context exists and is current
                _MMA_MODULES[key] = cuda_rtc.Module(*cuda_rtc.compile_kernels(_int4_cuda.SOURCE, [name],
                                                                                 f"{major}{minor}"))
                if cfg.get("tma"):
                    _MMA_MODULES[key].allow_shared(name, tma_shared(k_of_tma))
        except cuda_rtc.RtcError as exc:
            _MMA_BAD[key] = f"{name} on cuda:{index}: {exc}"
            raise MmaUnavailable(_MMA_BAD[key]) from exc
        if cfg.get("tma"):  # its instantiation is for one K; two tiles (two CTAs) and one row
            case = (1, 32, k_of_tma, group, pqs)
        else:  # (with pre_quant_scale exactly when the instantiation multiplies by it: check() runs this one)
            case = (min(3, MMA_ROWS), 32 * cfg.get("tiles", 1), 2 * max(128, group), group, pqs)
        if epi & EPI_GATED:
            bad = failed_rows(lambda: check_gated(f"cuda:{index}", dtype, cfg, case[2], group, case[0]))
        elif epi & EPI_RESIDUAL:
            bad = failed_rows(lambda: check_residual(f"cuda:{index}", dtype, cfg, case[2], group, case[0]))
        else:
            bad = failed_rows(lambda: check(f"cuda:{index}", dtypes=(dtype,), cases=(case,), layouts=("mma",),
                                            variants=((name, cfg),)))
        if bad:
            del _MMA_MODULES[key]
            _MMA_BAD[key] = f"{name} on cuda:{index} failed its first-use check: {bad[:1]}"
            raise MmaUnavailable(_MMA_BAD[key])
    return _MMA_MODULES[key], name


_SAID: set = set()


def _say_once(key, message: str, *args) -> None:
    """A fallback's warning, once per process and key (a kernel's first-use failure re-raises on every call)."""
    if key not in _SAID:
        _SAID.add(key)
        log.warning(message, *args)


def _k8_mma(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, pqs: torch.Tensor | None, group: int,
            cfg: dict, y: torch.Tensor, explicit: bool = False) -> torch.Tensor:
    """Up to MMA_ROWS rows on tensor cores into y [M, N] (x times pre_quant_scale rounded to x's dtype first, as
    the reference: in the kernel, as x is loaded). cfg["xp"]: x is in x_order; cfg["epi"]: the gated epilogue
    into y [M, N/2], `pqs` then being the epilogue's scale (int4 interleaved gate|up, see k8_launch_gated), or the
    residual epilogue, `pqs` then being the residual [M, N] added to the product (k8_launch_ordered_add). A
    bulk-copy configuration the shape or device does not take, or whose kernel cannot run, runs the register-fed
    kernel (the same arithmetic) when routed here, and raises when asked for (explicit)."""
    m, k = x.shape
    n = qweight.shape[0]
    rows = 16 * cfg.get("tiles", 1)
    xp, epi = bool(cfg.get("xp")), cfg.get("epi", 0)
    epi_scale, pqs = (pqs, None) if epi else (None, pqs)  # with an epilogue, `pqs` is its scale or residual
    if epi & EPI_RESIDUAL:
        if (epi_scale is None or epi_scale.dtype != x.dtype or tuple(epi_scale.shape) != (m, n)
                or epi_scale.stride() != y.stride() or y.shape != (m, n)):
            raise ValueError(f"the residual epilogue takes a residual laid out as y [{m}, {n}] in {x.dtype}; got "
                             f"{None if epi_scale is None else (epi_scale.dtype, tuple(epi_scale.shape))}")
    elif epi_scale is not None and (epi_scale.dtype != x.dtype or epi_scale.numel() != n // 2
                                    or epi_scale.stride(-1) != 1):
        raise ValueError(f"the gated epilogue's scale must be [{n // 2}] contiguous in {x.dtype}; got "
                         f"{epi_scale.dtype} {tuple(epi_scale.shape)}")
    if (not mma_applies(m, n, k, group, x.dtype) or n % rows or not x.is_cuda or scales_t.dtype != x.dtype
            or qweight.dtype != torch.int32 or (pqs is not None and (pqs.dtype != x.dtype or pqs.numel() != k))):
        raise ValueError(f"the tensor-core W4A16 kernel takes up to {MMA_ROWS} rows, N a multiple of {rows}, and "
                         f"CUDA bf16 / fp16 inputs with scales (and pre_quant_scale [K]) of the same dtype on the k8 "
                         f"layout; got M={m}, N={n}, K={k}, group {group}, x {x.dtype} on {x.device}, scales "
                         f"{scales_t.dtype}, codes {qweight.dtype}, pre_quant_scale "
                         f"{None if pqs is None else (pqs.dtype, tuple(pqs.shape))}")
    if pqs is not None and (pqs.stride(-1) != 1 or pqs.data_ptr() % 16):
        pqs = pqs.clone(memory_format=torch.contiguous_format)  # read 4 values at a time, as x
    if xp and pqs is not None:
        raise ValueError("x in x_order comes with pre_quant_scale applied (no kernel takes both)")
    if epi & EPI_GATED and (rows != 16 or n % 32 or y.shape[1] != n // 2 or (epi & EPI_ORDER and (n // 2) % 128)):
        raise ValueError(f"the gated epilogue takes one row tile a warp and N a multiple of 32 into y [M, N/2] (of "
                         f"256 when it writes in x_order); got {rows} rows a CTA, N={n}, y {tuple(y.shape)}")
    tma = bool(cfg.get("tma")) and pqs is None and tma_applies(m, n, k, group, x.dtype, x.device, cfg["warps"])
    if cfg.get("tma") and not tma:
        if explicit:
            raise ValueError(f"the bulk-copy W4A16 kernel takes one row, group 128, K in whole rounds of "
                             f"{cfg['warps']} warps (at most 8 blocks a warp) on compute capability 9.x / 10.x, and "
                             f"no pre_quant_scale; got M={m}, K={k}, group {group}, pre_quant_scale "
                             f"{'given' if pqs is not None else 'none'}")
        cfg, rows = {**mma_config(k), "xp": xp, "epi": epi}, 16  # routed by a CONFIGS entry: the register-fed kernel
    if x.stride(1) != 1 or x.stride(0) % (8 if xp else 4) or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh (aligned) contiguous copy
    scaled = pqs is not None
    try:
        module, name = _mma_kernel(x.device, cfg, group, x.dtype, k if tma else 0, scaled)
    except MmaUnavailable as exc:
        if not tma or explicit:
            raise
        _say_once(("tma", str(x.device), k), "int4: %s; the register-fed tensor-core kernel runs instead", exc)
        cfg, rows, tma = {**mma_config(k), "xp": xp, "epi": epi}, 16, False
        module, name = _mma_kernel(x.device, cfg, group, x.dtype, 0, scaled)
    shared = tma_shared(k) if tma else 0
    with torch.cuda.device(x.device):
        module.launch(name, (n // rows, 1, 1), (32 * cfg["warps"], 1, 1),
                      [x, qweight, scales_t, pqs if scaled else epi_scale if epi_scale is not None else scales_t, y,
                       m, n, k, x.stride(0), scales_t.stride(0), y.stride(0), group],
                      shared=shared, pdl=cuda_rtc.pdl_on(x.device))
    return y


def mma_usable(device: str, dtype: torch.dtype) -> bool:
    """Whether the tensor-core kernel compiles and computes exactly on this device and dtype (check() on
    MMA_CHECK_CASES, once per process; False with the reason logged otherwise)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (str(dev), dtype)
    if key not in _MMA_USABLE:
        bad = failed_rows(lambda: check(str(dev), dtypes=(dtype,), cases=MMA_CHECK_CASES, layouts=("mma",),
                                        variants=MMA_VARIANTS))
        if bad:
            log.warning("int4: the tensor-core W4A16 kernel is not used on %s %s (%s); the Triton kernels run",
                        device, dtype, bad[:2])
        _MMA_USABLE[key] = not bad
    return _MMA_USABLE[key]


@torch.library.custom_op("quantlab::w4a16_k8", mutates_args=())
def w4a16_k8(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, pqs: torch.Tensor | None,
             group: int) -> torch.Tensor:
    """The k8 W4A16 GEMM as one opaque op (traced by torch.compile, captured by CUDA graphs)."""
    return k8_launch(x, qweight, scales_t, pqs, group)


@w4a16_k8.register_fake
def _(x, qweight, _scales_t, _pqs, _group):
    return x.new_empty(x.shape[0], qweight.shape[0])


# ------------------------------------------------------------------------------------------------ x in its order
# At one row the tensor-core kernel builds each mma's B registers from x by byte permutes (pair_of: ~16 a block and
# thread). Given x in its input order instead (int4_codes.in_x_order: thread t's 32 inputs of a block in the order
# of its B registers) it loads them with four 16-byte loads and permutes nothing (bench/int4_mma_variants.py MODE 97:
# 1-2 us a layer at the 8B shapes in isolation; 15 us a token end to end). The layers reorder x by views that
# torch.compile folds into the op producing x (a norm); QUANTLAB_INT4_XORDER=0 turns it off.
def ordered_on(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether layers on this device and dtype hand their one-row GEMMs x in the kernel's input order: the
    tensor-core kernel runs here (mma_on) and QUANTLAB_INT4_XORDER is not 0 (decided when the layers are built)."""
    return cuda_rtc.switch("QUANTLAB_INT4_XORDER") and mma_on(device, dtype)


def _one_row_cfg(m: int, n: int, k: int, one_tile: bool = False) -> dict:
    """The tensor-core kernel's configuration for a few rows of an [N, K] layer: the shape's CONFIGS entry where it
    is one of that kernel's (and, with one_tile, has one row tile a warp), else mma_config(k)."""
    cfg = CONFIGS.get((m_bucket(m), n, k))
    return dict(cfg) if cfg and cfg.get("mma") and (not one_tile or cfg.get("tiles", 1) == 1) else mma_config(k)


def k8_launch_ordered(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int) -> torch.Tensor:
    """x [1, K] in the kernel's input order (pre_quant_scale applied) -> y [1, N]: the tensor-core kernel of the
    shape's configuration reading x as ordered; where that kernel cannot run, x is put back in the layer's order and
    k8_launch runs (the same product)."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    try:
        return _k8_mma(x, qweight, scales_t, None, group, {**_one_row_cfg(m, n, k), "xp": True}, y)
    except MmaUnavailable as exc:
        _say_once(("ordered", str(x.device), k), "int4: %s; x is put back in order for the other kernels", exc)
        return k8_launch(from_x_order(x), qweight, scales_t, None, group)


@torch.library.custom_op("quantlab::w4a16_k8_ordered", mutates_args=())
def w4a16_k8_ordered(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int) -> torch.Tensor:
    """k8_launch_ordered as one opaque op."""
    return k8_launch_ordered(x, qweight, scales_t, group)


@w4a16_k8_ordered.register_fake
def _(x, qweight, _scales_t, _group):
    return x.new_empty(x.shape[0], qweight.shape[0])


# ------------------------------------------------------------------------------------------------ residual epilogue
# A layer whose one-row output is added to a residual and nothing else (a decoder layer's last projection, the hidden
# state it returns): the kernel adds it as it writes (EPI_RESIDUAL), the same two roundings as torch's residual + y in
# the compute dtype, and the add's kernel goes. The compiled layers are rewritten to it (quantlab.engines.fusion);
# QUANTLAB_INT4_RESIDUAL=0 turns it off.
def k8_launch_ordered_add(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int,
                          residual: torch.Tensor) -> torch.Tensor:
    """residual + k8_launch_ordered(x, ...) in the residual's shape ([..., N] with M rows): the product rounded to x's
    dtype, then the sum rounded once; where the kernel cannot run, the unfused op and torch's add (the same values)."""
    m, k = x.shape
    n = qweight.shape[0]
    if residual.dtype != x.dtype or residual.numel() != m * n or residual.shape[-1] != n:
        raise ValueError(f"the residual epilogue takes a residual of {m} rows of {n} in {x.dtype}; got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    rows = residual.reshape(m, n).contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    try:
        out = _k8_mma(x, qweight, scales_t, rows, group, {**_one_row_cfg(m, n, k), "xp": True, "epi": EPI_RESIDUAL}, y)
    except MmaUnavailable as exc:
        _say_once(("residual", str(x.device), k), "int4: %s; the residual is added by torch", exc)
        out = rows + k8_launch_ordered(x, qweight, scales_t, group)
    return out.view(residual.shape)


@torch.library.custom_op("quantlab::w4a16_k8_ordered_add", mutates_args=())
def w4a16_k8_ordered_add(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int,
                         residual: torch.Tensor) -> torch.Tensor:
    """k8_launch_ordered_add as one opaque op (what quantlab.engines.fusion rewrites w4a16_k8_ordered + add into)."""
    return k8_launch_ordered_add(x, qweight, scales_t, group, residual)


@w4a16_k8_ordered_add.register_fake
def _(_x, _qweight, _scales_t, _group, residual):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


def _random_k8(g: torch.Generator, n: int, k: int, group: int, dtype: torch.dtype,
               device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An [N, K] layer of random codes and small positive scales in the k8 layout (the epilogues' first-use checks)."""
    packed = torch.randint(0, 256, (n // 2, k), generator=g, dtype=torch.uint8)  # the export layout: [N / 2, K]
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(dtype)
    return repack(packed.to(device), scales.to(device))


def check_residual(device: str, dtype: torch.dtype, cfg: dict, k: int, group: int, rows: int = 1,
                   seed: int = 0) -> list[dict]:
    """The residual epilogue against the same kernel without it followed by torch's add: equal value for value (the
    same roundings)."""
    g = torch.Generator().manual_seed(seed)
    n = 32 * cfg.get("tiles", 1)
    qweight, scales_t = _random_k8(g, n, k, group, dtype, device)
    xo = in_x_order(torch.randn(rows, k, generator=g).to(dtype).to(device))
    residual = (torch.randn(rows, n, generator=g) * 4).to(dtype).to(device)
    plain = {key: v for key, v in cfg.items() if key != "epi"}
    ref = residual + _k8_mma(xo, qweight, scales_t, None, group, plain,
                             torch.empty(rows, n, dtype=dtype, device=device), explicit=True)
    got = _k8_mma(xo, qweight, scales_t, residual, group, cfg, torch.empty(rows, n, dtype=dtype, device=device),
                  explicit=True)
    equal = bool(torch.equal(got, ref))
    return [{"kernel": "residual epilogue", "dtype": str(dtype), "k": k, "rows": rows,
             "worst": 0.0 if equal else float((got.float() - ref.float()).abs().max()), "ok": equal}]


# ------------------------------------------------------------------------------------------------ gated epilogue
# A gated MLP's gate|up GEMM at one row with SiLU applied in the kernel: the rows interleaved so that each 16-row tile
# holds 8 gate rows and the same 8 up rows (interleave_gated), the CTA then writes h = silu(gate) * up, times the down
# projection's pre_quant_scale, in the down projection's input order (the EPI flags of _int4_cuda): the activation's own
# kernel goes. QUANTLAB_INT4_EPILOGUE=0 turns it off.
def interleave_gated(qweight: torch.Tensor, scales_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k8 gate|up (gate rows, then up rows: [2I, K/8] codes, [K/g, 2I] scales) -> the rows in tiles of 8 gate rows
    then the same 8 up rows (row 16i + r: gate 8i + r; 16i + 8 + r: up 8i + r)."""
    n = qweight.shape[0]
    inter = n // 2
    if n % 2 or inter % 8:
        raise ValueError(f"gate|up interleaving takes 8-row groups; got {n} rows")
    i = torch.arange(inter // 8, device=qweight.device)[:, None, None] * 8
    half = torch.arange(2, device=qweight.device)[None, :, None] * inter
    src = (i + half + torch.arange(8, device=qweight.device)[None, None, :]).reshape(-1)
    return _tile(_untile(qweight)[src].contiguous()), scales_t[:, src].contiguous()


def deinterleave_gated(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of the interleaved gate|up GEMM [M, 2I] -> (gate [M, I], up [M, I]) (views a compiled graph fuses
    into their consumer)."""
    m, n = y.shape
    t = y.view(m, n // 16, 2, 8)
    return t[:, :, 0].reshape(m, n // 2), t[:, :, 1].reshape(m, n // 2)


def gated_torch(y: torch.Tensor, scale: torch.Tensor | None, order_out: bool) -> torch.Tensor:
    """What the gated epilogue writes, in torch: silu(gate) * up from the interleaved output y, times scale, in the
    next layer's input order when order_out."""
    gate, up = deinterleave_gated(y)
    h = torch.nn.functional.silu(gate) * up
    if scale is not None:
        h = h * scale
    return in_x_order(h) if order_out else h


def epilogue_cfg(m: int, n: int, k: int, scaled: bool, order_out: bool) -> dict:
    """The one-row kernel's configuration for the interleaved gate|up: the shape's (one tile a warp), x in its input
    order, the epilogue flags."""
    epi = EPI_GATED | (EPI_SCALE if scaled else 0) | (EPI_ORDER if order_out else 0)
    return {**_one_row_cfg(m, n, k, one_tile=True), "xp": True, "epi": epi}


def k8_launch_gated(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, scale: torch.Tensor | None,
                    group: int, order_out: bool, cfg: dict | None = None) -> torch.Tensor:
    """x [M, K] in the kernel's input order (pre_quant_scale applied), the interleaved gate|up codes and scales ->
    h [M, N/2]
    (gated_torch's values); where the kernel cannot run, x is put back in order, k8_launch runs and gated_torch."""
    m, k = x.shape
    n = qweight.shape[0]
    cfg = cfg or epilogue_cfg(m, n, k, scale is not None, order_out)
    y = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
    try:
        return _k8_mma(x, qweight, scales_t, scale, group, cfg, y)  # (the epilogue's scale in pqs's place)
    except MmaUnavailable as exc:
        _say_once(("gated", str(x.device), k), "int4: %s; the gated MLP's activation runs in torch", exc)
        return gated_torch(k8_launch(from_x_order(x), qweight, scales_t, None, group), scale, order_out)


@torch.library.custom_op("quantlab::w4a16_k8_gated", mutates_args=())
def w4a16_k8_gated(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, scale: torch.Tensor | None,
                   group: int, order_out: bool) -> torch.Tensor:
    """k8_launch_gated as one opaque op."""
    return k8_launch_gated(x, qweight, scales_t, scale, group, order_out)


@w4a16_k8_gated.register_fake
def _(x, qweight, _scales_t, _scale, _group, _order_out):
    return x.new_empty(x.shape[0], qweight.shape[0] // 2)


def check_gated(device: str, dtype: torch.dtype, cfg: dict, k: int, group: int, rows: int = 1,
                seed: int = 0) -> list[dict]:
    """The gated epilogue against the same kernel without it followed by gated_torch (the sums are the same, value
    for value; the activation may differ from torch's by its last rounding): each output within 2 units in the last
    place of the 16-bit type. One row per flag combination the configuration's epilogue has (scale, order)."""
    g = torch.Generator().manual_seed(seed)
    n = 256  # 128 outputs: whole blocks of the next layer's x_order
    qweight, scales_t = interleave_gated(*_random_k8(g, n, k, group, dtype, device))
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    scale = (torch.rand(n // 2, generator=g) + 0.5).to(dtype).to(device) if cfg["epi"] & EPI_SCALE else None
    order_out = bool(cfg["epi"] & EPI_ORDER)
    xo = in_x_order(x)
    plain = {key: v for key, v in cfg.items() if key != "epi"}
    ref = gated_torch(_k8_mma(xo, qweight, scales_t, None, group, plain, torch.empty(rows, n, dtype=dtype,
                                                                                   device=device), explicit=True),
                      scale, order_out).float()
    got = _k8_mma(xo, qweight, scales_t, scale, group, cfg, torch.empty(rows, n // 2, dtype=dtype, device=device),
                  explicit=True).float()
    worst = float(((got - ref).abs() / (2 * torch.finfo(dtype).eps * ref.abs() + 1e-30)).max())
    return [{"kernel": "gated epilogue", "epi": cfg["epi"], "dtype": str(dtype), "k": k, "rows": rows,
             "worst": worst, "ok": worst <= 1.0 and bool(torch.isfinite(got).all())}]


# ------------------------------------------------------------------------------------------------ checks
CHECK_CASES = ((1, 64, 512, 64, True), (1, 48, 128, 32, False), (3, 64, 384, 128, True), (20, 96, 256, 64, False))


def k8_variants(rows: int, k: int) -> list[tuple[str, dict | None]]:
    """The k8 paths check() runs for a case: the default configuration, tensor cores without a split, FMAs with a
    split (few rows), and the dense path."""
    bpi = 2 if (k // 128) % 2 == 0 else 1
    split = valid_splits(k, bpi)[min(1, len(valid_splits(k, bpi)) - 1)]
    out = [("k8", None), ("k8_dot_nosplit", {"dot": True, "block_n": 32, "block_m": 16, "bpi": 1, "split_k": 1})]
    if rows <= 4:
        out.append(("k8_fma_split", {"dot": False, "block_n": 32, "block_m": 1, "bpi": bpi, "split_k": split}))
    if rows == 1:
        out.append(("k8_gemv_split", {"gemv": True, "block_n": 32, "bpi": bpi, "split_k": split}))
    out.append(("k8_dense", {"dense": True}))
    return out


def _bound(xs: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact result, error bound): fp32 accumulation in any order (a statistical bound: sqrt(K) roundings) plus
    half an ulp of the output."""
    exact = xs.double() @ w.double().t()
    accumulation = (xs.double().abs() @ w.double().abs().t()) * 2 * math.sqrt(w.shape[1]) * torch.finfo(
        torch.float32).eps
    bound = accumulation + (exact.abs() + accumulation) * torch.finfo(dtype).eps / 2 * (1 + 1e-6) + 1e-30
    return exact, bound


def _one_case(out: list, device: str, case: tuple, tensors: tuple, kernels: tuple) -> None:
    """Run each (name, kind, config) kernel on one case's tensors, appending a row per kernel."""
    rows, n, k, group, has_pqs = case
    x, packed, scales, pqs, dtype = tensors
    xs = x * pqs if has_pqs else x
    w = (unpack_int4(packed).float() * scales.float().repeat_interleave(group, 1)).to(dtype)
    exact, bound = _bound(xs, w, dtype)
    args = [t.to(device) if t is not None else None for t in (x, packed, scales, pqs)]
    k8_args = None
    for name, kind, config in kernels:
        row = {"rows": rows, "n": n, "k": k, "group": group, "pqs": has_pqs, "kernel": name,
               "dtype": str(dtype).removeprefix("torch."), "worst": float("inf"), "ok": False}
        def run(kind=kind, config=config):
            nonlocal k8_args
            if kind == "export":
                return w4a16_launch(*args, group, gemv=config)
            if k8_args is None:
                k8_args = (args[0], *repack(args[1], args[2]), args[3])
            return k8_launch(*k8_args, group, config=config)

        _SCRATCH.check_case(row, run, exact, bound, (rows, n), dtype)
        out.append(row)


def check(device: str = "cpu", dtypes=(torch.float16, torch.float32), cases=CHECK_CASES, seed: int = 0,
          layouts: tuple = ("export", "k8", "mma"), variants: tuple | None = None) -> list[dict]:
    """Every kernel against the exact arithmetic it implements, case by case (rows, N, K, group, with
    pre_quant_scale): the input times pre_quant_scale rounded to the compute dtype, weights q * scale rounded once,
    exact products accumulated in fp32 in any order, the output rounded once. `worst` is the largest error over
    its bound (fp32 accumulation of |x||w| plus half an ulp of the output): at most 1 passes (inf: the launch
    failed, `error` says why). A wrong code, scale or group is off by the size of the products, orders of
    magnitude above the bound. Kernels: the export layout's GEMV and GEMM; the k8 paths of k8_variants (cases whose
    K or group the k8 layout does not take are skipped there); on a CUDA device the tensor-core kernel's
    MMA_VARIANTS, or `variants` ((name, config) pairs; 16-bit dtypes, up to MMA_ROWS rows, N a multiple of 16).
    Used by the tests (Triton's CPU interpreter), by k8_usable, mma_usable and the tensor-core kernel's first-use
    check, and by bench/decode.py --check (on the GPU, at the model's shapes)."""
    out = []
    g = torch.Generator().manual_seed(seed)
    for case in cases:
        rows, n, k, group, has_pqs = case
        packed = torch.randint(0, 256, (n // 2, k), generator=g, dtype=torch.uint8)
        for dtype in dtypes:
            scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(dtype)
            pqs = (torch.rand(k, generator=g) + 0.5).to(dtype) if has_pqs else None
            x = torch.randn(rows, k, generator=g).to(dtype)
            kernels = []
            if "export" in layouts:
                kernels += [("gemv", "export", True), ("gemm", "export", False)]
            if "k8" in layouts and k8_supported(n, k, group):
                kernels += [(name, "k8", cfg) for name, cfg in k8_variants(rows, k)]
            if "mma" in layouts and str(device).startswith("cuda") and mma_applies(rows, n, k, group, dtype):
                kernels += [(name, "k8", cfg) for name, cfg in variants or MMA_VARIANTS + XP_VARIANTS + TMA_VARIANTS
                            if n % (16 * cfg.get("tiles", 1)) == 0
                            and (not cfg.get("tma") or (not has_pqs
                                                        and tma_applies(rows, n, k, group, dtype, device,
                                                                        cfg["warps"])))]
            _one_case(out, device, case, (x, packed, scales, pqs, dtype), kernels)
    return out


SELF_CHECK_CASES = ((1, 96, 512, 128, True), (5, 64, 256, 64, False), (300, 64, 256, 128, True))
# the tensor-core kernel: groups 16 to 256, rows 1 to 8, warps with no block of K (3 blocks for 4 warps)
MMA_CHECK_CASES = ((1, 96, 512, 128, True), (1, 32, 2048, 256, False), (8, 64, 384, 64, True), (1, 48, 256, 32, False),
                   (3, 32, 256, 16, True))
MMA_VARIANTS = (("k8_mma_w4u2", {"mma": True, "warps": 4, "unroll": 2, "tiles": 1}),
                ("k8_mma_w8u1", {"mma": True, "warps": 8, "unroll": 1, "tiles": 1}),
                ("k8_mma_w4u1t2", {"mma": True, "warps": 4, "unroll": 1, "tiles": 2}))
# the bulk-copy variant where tma_applies (one row, group 128): in check()'s default set, not in mma_usable's (a
# failure of it alone leaves the register-fed kernel in use; its instantiations are checked on first use)
TMA_VARIANTS = (("k8_tma_w4", {"mma": True, "tma": True, "warps": 4}),
                ("k8_tma_w4_xorder", {"mma": True, "tma": True, "warps": 4, "xp": True}))
# the kernels reading x in the x order (in_x_order; one row in the engine, any rows here): in check()'s default set too
XP_VARIANTS = (("k8_mma_w4u1_xorder", {"mma": True, "warps": 4, "unroll": 1, "tiles": 1, "xp": True}),
               ("k8_mma_w8u2t2_xorder", {"mma": True, "warps": 8, "unroll": 2, "tiles": 2, "xp": True}))
_USABLE: dict = {}


def failed_rows(run) -> list[dict]:
    """The rows of a kernel check (run()) that did not pass; a check that raises, or that ran no case, is one failed
    row saying why (the startup and first-use checks of the k8 kernels, the tensor-core kernel and the FP8 GEMV)."""
    try:
        rows = run()
    except Exception as exc:  # noqa: BLE001 - the kernel is not used then, and the caller says why
        return [{"error": f"{type(exc).__name__}: {exc}"}]
    if not rows:
        return [{"error": "the check ran no case"}]
    return [r for r in rows if not r["ok"]]


def k8_usable(device: str, dtype: torch.dtype) -> bool:
    """Whether the k8 kernels compute exactly on this device and dtype: check() on a few small cases, once per
    process (False where Triton cannot run; the layers then keep the export layout and its kernels)."""
    key = (str(device), dtype)
    if key not in _USABLE:
        if not available() or (not str(device).startswith("cuda") and not interpreted()):
            _USABLE[key] = False
        else:
            bad = failed_rows(lambda: check(str(device), dtypes=(dtype,), cases=SELF_CHECK_CASES, layouts=("k8",)))
            if bad:
                log.warning("int4: the k8 W4A16 kernels failed their check on %s (%s); using the export layout's "
                            "kernels", device, bad[:2])
            _USABLE[key] = not bad
    return _USABLE[key]


def sweep_candidates(m: int, n: int, k: int) -> list[dict]:
    """k8 configurations bench/decode.py --check times for M rows of an [N, K] layer (all valid for K): for one row
    the one-row kernel over tile widths and steps, each at its default split and the two next to it; for more rows,
    tensor-core tiles of the row class, each at the default's split and the next larger."""
    sms = _sm_count("cuda") if torch.cuda.is_available() else 132
    if m == 1:  # the one-row kernel over tile shapes, each at its default split and the two next to it
        out = []
        if torch.cuda.is_available() and mma_on("cuda", torch.bfloat16):  # the tensor-core kernel first
            out += [mma_config(k, w, u, r) for w, u, r in MMA_SHAPES if n % (16 * r) == 0]
            out += [{"mma": True, "tma": True, "warps": w} for w in (4, 8, 16)
                    if tma_applies(1, n, k, 128, torch.bfloat16, "cuda", w)]
        for block_n, bpi, warps in ((64, 2, 4), (128, 1, 4), (64, 1, 4), (256, 1, 4)):
            base = k8_gemv_config(n, k, "cuda" if torch.cuda.is_available() else "cpu", block_n, bpi, warps)
            splits = valid_splits(k, base["bpi"])
            i = splits.index(base["split_k"])
            out += [{**base, "split_k": s} for s in sorted({splits[max(0, i - 1)], base["split_k"],
                                                              splits[min(len(splits) - 1, i + 1)]})]
        return out
    out = []
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_tiles = -(-m // block_m)
    shapes = ([(True, 64, 2, 4), (True, 128, 1, 4), (True, 32, 2, 4), (False, 64, 2, 4), (False, 32, 4, 4)]
              if m == 1 else [(True, 64, 2, 4), (True, 128, 1, 8), (True, 32, 2, 4)])
    for dot, block_n, bpi, warps in shapes:
        splits = valid_splits(k, bpi)
        if not splits:
            continue
        tiles = -(-n // block_n) * (m_tiles if dot else m)
        base = splits.index(default_split(tiles, k, bpi, sms))
        for i in sorted({base, min(len(splits) - 1, base + 1)}):  # the default's split and the next larger
            out.append({"dot": dot, "block_n": block_n, "block_m": block_m if dot else 1, "bpi": bpi,
                        "split_k": splits[i], "num_warps": warps, "num_stages": 2})
    return out
