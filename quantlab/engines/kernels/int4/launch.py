"""The W4A16 launchers: the export layout's Triton GEMV / GEMM, the k8 layout's Triton kernels (one-row GEMV,
split-K GEMM, dense dequantize + torch GEMM) and the tensor-core kernel of _int4_cuda (compiled by NVRTC on first use,
checked before it multiplies anything), with the x-order, residual and gated epilogue variants. The ops (ops.py) call
these; where a kernel cannot run, a launcher falls back to one computing the same values and says so once.

The startup and first-use checks (checks.py) run these launchers; they reach this module through CHECKS, which
checks.py fills when the package is imported, so this module does not import its own checks."""
from __future__ import annotations

import logging

import torch

from quantlab.engines.int4_codes import from_x_order, in_x_order
from quantlab.engines.kernels import cuda_rtc
from quantlab.engines.kernels._int4_cuda import EPI_GATED, EPI_ORDER, EPI_RESIDUAL
from quantlab.engines.kernels.device import allowed, capability, interpreted, pdl_on
from quantlab.engines.kernels.int4.configs import (
    DENSE_ROWS,
    GEMV_MAX_ROWS,
    MMA_ROWS,
    epilogue_cfg,
    gemm_config,
    gemv_config,
    k8_route,
    mma_applies,
    mma_config,
    one_row_cfg,
    tma_shape,
    tma_shared,
)
from quantlab.engines.kernels.int4.layout import gated_torch
from quantlab.engines.kernels.scratch import Scratch

log = logging.getLogger("quantlab")
# filled by checks.py: "mma_usable" (device, dtype) -> bool; "first_use" (device, dtype, cfg, case, name) -> the
# failed rows of an instantiation's first-use check
CHECKS: dict = {}

def _kernels():
    import triton

    from quantlab.engines.kernels import _int4_triton

    return triton, _int4_triton


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


_SCRATCH = Scratch(1 << 22, 1 << 16)  # the split-K workspace and tile counters


def reset_counters() -> None:
    """Zero every device's tile counters (after a launch that may have stopped half way, e.g. in a sweep)."""
    _SCRATCH.reset_counters()


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
        return k8_mma(in_x_order(x), qweight, scales_t, None, group, cfg, y, explicit=True)
    if cfg.get("mma"):
        try:
            return k8_mma(x, qweight, scales_t, pqs, group, cfg, y, explicit=config is not None)
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
            and capability(device) >= (8, 0))


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
_MMA_MODULES: dict = {}


def tma_applies(m: int, n: int, k: int, group: int, dtype: torch.dtype, device: torch.device | str,
                warps: int) -> bool:
    """tma_shape on a CUDA device of compute capability 9.x or 10.x (cp.async.bulk, and 227 KB of shared memory a
    block: consumer parts of later generations have 99 KB), where engine.kernels does not disable it (int4_tma)."""
    return (tma_shape(m, n, k, group, dtype, warps) and torch.device(device).type == "cuda" and allowed("int4_tma")
            and capability(device)[0] in (9, 10))


def mma_on(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the tensor-core kernel runs on this device and dtype: the hardware of ptx16, and it passed its check
    there (checks.mma_usable), and engine.kernels does not disable it (int4_mma)."""
    return ptx16(dtype, device) and allowed("int4_mma") and CHECKS["mma_usable"](str(device), dtype)


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
        major, minor = capability(f"cuda:{index}")
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
        bad = CHECKS["first_use"](f"cuda:{index}", dtype, cfg, case, name)
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


def k8_mma(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, pqs: torch.Tensor | None, group: int,
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
                      shared=shared, pdl=pdl_on(x.device))
    return y


# ------------------------------------------------------------------------------------------------ x in its order
# At one row the tensor-core kernel builds each mma's B registers from x by byte permutes (pair_of: ~16 a block and
# thread). Given x in its input order instead (int4_codes.in_x_order: thread t's 32 inputs of a block in the order
# of its B registers) it loads them with four 16-byte loads and permutes nothing (bench/int4_mma_variants.py MODE 97:
# 1-2 us a layer at the 8B shapes in isolation; 15 us a token end to end). The layers reorder x by views that
# torch.compile folds into the op producing x (a norm); engine.kernels.disabled=[int4_xorder] turns it off.
def ordered_on(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether layers on this device and dtype hand their one-row GEMMs x in the kernel's input order: the
    tensor-core kernel runs here (mma_on) and engine.kernels does not disable int4_xorder (decided when the layers
    are built)."""
    return allowed("int4_xorder") and mma_on(device, dtype)


def k8_launch_ordered(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int) -> torch.Tensor:
    """x [1, K] in the kernel's input order (pre_quant_scale applied) -> y [1, N]: the tensor-core kernel of the
    shape's configuration reading x as ordered; where that kernel cannot run, x is put back in the layer's order and
    k8_launch runs (the same product)."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    try:
        return k8_mma(x, qweight, scales_t, None, group, {**one_row_cfg(m, n, k), "xp": True}, y)
    except MmaUnavailable as exc:
        _say_once(("ordered", str(x.device), k), "int4: %s; x is put back in order for the other kernels", exc)
        return k8_launch(from_x_order(x), qweight, scales_t, None, group)


# ------------------------------------------------------------------------------------------------ residual epilogue
# A layer whose one-row output is added to a residual and nothing else (a decoder layer's last projection, the hidden
# state it returns): the kernel adds it as it writes (EPI_RESIDUAL), the same two roundings as torch's residual + y in
# the compute dtype, and the add's kernel goes. The compiled layers are rewritten to it (quantlab.engines.fusion);
# engine.kernels.disabled=[int4_residual_epilogue] turns it off.
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
        out = k8_mma(x, qweight, scales_t, rows, group, {**one_row_cfg(m, n, k), "xp": True, "epi": EPI_RESIDUAL}, y)
    except MmaUnavailable as exc:
        _say_once(("residual", str(x.device), k), "int4: %s; the residual is added by torch", exc)
        out = rows + k8_launch_ordered(x, qweight, scales_t, group)
    return out.view(residual.shape)


# ------------------------------------------------------------------------------------------------ gated epilogue
# A gated MLP's gate|up GEMM at one row with SiLU applied in the kernel: the rows interleaved so that each 16-row tile
# holds 8 gate rows and the same 8 up rows (interleave_gated), the CTA then writes h = silu(gate) * up, times the down
# projection's pre_quant_scale, in the down projection's input order (the EPI flags of _int4_cuda): the activation's own
# kernel goes. engine.kernels.disabled=[int4_gated_epilogue] turns it off.

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
        return k8_mma(x, qweight, scales_t, scale, group, cfg, y)  # (the epilogue's scale in pqs's place)
    except MmaUnavailable as exc:
        _say_once(("gated", str(x.device), k), "int4: %s; the gated MLP's activation runs in torch", exc)
        return gated_torch(k8_launch(from_x_order(x), qweight, scales_t, None, group), scale, order_out)

