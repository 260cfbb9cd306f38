"""Launch configurations of the W4A16 kernels: the per-shape table CONFIGS (bench/decode.py --check's sweep fills and
prints it), the defaults where it has no entry, the splits over K each kernel takes, the routes by row count, and the
shapes each kernel takes (pure functions of the shape and dtype: no device, no launch)."""
from __future__ import annotations

import torch

from quantlab.engines.kernels._int4_cuda import EPI_GATED, EPI_ORDER, EPI_SCALE
from quantlab.engines.kernels.device import first_split, sm_count

GEMV_MAX_ROWS = 1  # export layout: rows handled by the GEMV kernel; more rows use the tensor-core GEMM
DENSE_ROWS = 256  # k8: from this many rows on, dequantize into a temporary and multiply with torch's GEMM


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



K8_TILE = 16  # rows a k8 tile holds


def k8_supported(n: int, k: int, group: int) -> bool:
    """Whether the k8 kernels take a layer of N outputs and K inputs and this group size (N in tiles of 16; K in
    blocks of 128; a group that is a multiple of 16 and divides 128, or a multiple of 128)."""
    return (n % K8_TILE == 0 and k % 128 == 0 and group % 16 == 0 and (128 % group == 0 or group % 128 == 0)
            and k % group == 0)



def m_bucket(m: int) -> int:
    """The row class a configuration is chosen for: 1, 16, 32, 64 or 128 (DENSE_ROWS rows and more: dense)."""
    return 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


# (row class, N, K) -> configuration; bench/decode.py's sweep prints its table to commit (its timed rows use this one).
# One row at the Llama-3.1-8B shapes (fused q|k|v and gate|up): the tensor-core kernel (gate|up its bulk-copy
# variant), the sweep's table from the H200 runs bench/results/h200-2026-12-02/mma7_tiled_decode.log and
# mma9_tma_decode.log (where that kernel cannot run, k8_launch takes the one-row Triton kernel's default instead).
CONFIGS: dict[tuple[int, int, int], dict] = {
    (1, 4096, 4096): {"mma": True, "warps": 16, "unroll": 1, "tiles": 1},
    (1, 4096, 14336): {"mma": True, "warps": 16, "unroll": 1, "tiles": 1},
    (1, 6144, 4096): {"mma": True, "tma": True, "warps": 8},
    (1, 28672, 4096): {"mma": True, "tma": True, "warps": 8},
}



def valid_splits(k: int, bpi: int) -> list[int]:
    """Split counts the k8 kernel takes for K inputs and `bpi` blocks a step: each split an equal whole number of
    steps."""
    blocks = k // 128
    return [s for s in range(1, blocks + 1) if blocks % s == 0 and (blocks // s) % bpi == 0]




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
            "split_k": default_split(tiles, k, bpi, sm_count(device)), "num_warps": 4, "num_stages": 2}


def k8_gemv_config(n: int, k: int, device: str = "cuda", block_n: int = 64, bpi: int = 2,
                   num_warps: int = 4) -> dict:
    """The one-row kernel's configuration: block_n rows a program, bpi blocks a step (fewer where K has fewer), K
    split for TARGET_WAVES programs per SM."""
    while bpi > 1 and not valid_splits(k, bpi):
        bpi //= 2
    return {"gemv": True, "block_n": block_n, "bpi": bpi,
            "split_k": default_split(-(-n // block_n), k, bpi, sm_count(device)), "num_warps": num_warps}


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



MMA_ROWS = 8
# (warps, blocks loaded ahead, row tiles a warp) the sweep times: at most 16 tiles x blocks a CTA (more spill)
MMA_SHAPES = tuple((w, u, r) for w in (4, 8, 16) for u in (1, 2, 4) for r in (1, 2) if w * u * r <= 16)


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



def mma_applies(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> bool:
    """Shapes and dtypes the tensor-core kernel takes: up to MMA_ROWS rows, N a multiple of 16, the k8 layout, a
    16-bit compute dtype."""
    return m <= MMA_ROWS and k8_supported(n, k, group) and dtype in (torch.bfloat16, torch.float16)



def one_row_cfg(m: int, n: int, k: int, one_tile: bool = False) -> dict:
    """The tensor-core kernel's configuration for a few rows of an [N, K] layer: the shape's CONFIGS entry where it
    is one of that kernel's (and, with one_tile, has one row tile a warp), else mma_config(k)."""
    cfg = CONFIGS.get((m_bucket(m), n, k))
    return dict(cfg) if cfg and cfg.get("mma") and (not one_tile or cfg.get("tiles", 1) == 1) else mma_config(k)



def epilogue_cfg(m: int, n: int, k: int, scaled: bool, order_out: bool) -> dict:
    """The one-row kernel's configuration for the interleaved gate|up: the shape's (one tile a warp), x in its input
    order, the epilogue flags."""
    epi = EPI_GATED | (EPI_SCALE if scaled else 0) | (EPI_ORDER if order_out else 0)
    return {**one_row_cfg(m, n, k, one_tile=True), "xp": True, "epi": epi}

