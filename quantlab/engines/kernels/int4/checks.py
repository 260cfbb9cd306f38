"""The W4A16 kernels checked against the exact arithmetic they implement: check() (every kernel, case by case; the
tests under Triton's interpreter, bench/decode.py --check and the GPU tests), the startup checks that decide whether a
device uses the k8 kernels (k8_usable) and the tensor-core kernel (mma_usable), the first-use checks of each
tensor-core instantiation (and its epilogues), and the sweep's candidate configurations."""
from __future__ import annotations

import logging
import math

import torch

from quantlab.engines.int4_codes import in_x_order, unpack_int4
from quantlab.engines.kernels._int4_cuda import EPI_GATED, EPI_ORDER, EPI_RESIDUAL, EPI_SCALE
from quantlab.engines.kernels.api import failed_rows
from quantlab.engines.kernels.device import available, interpreted, sm_count
from quantlab.engines.kernels.int4 import launch
from quantlab.engines.kernels.int4.configs import (
    MMA_SHAPES,
    default_split,
    k8_gemv_config,
    k8_supported,
    mma_applies,
    mma_config,
    valid_splits,
)
from quantlab.engines.kernels.int4.launch import (
    _SCRATCH,
    k8_launch,
    k8_mma,
    mma_on,
    tma_applies,
    w4a16_launch,
)
from quantlab.engines.kernels.int4.layout import gated_torch, interleave_gated, repack

log = logging.getLogger("quantlab")

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
    ref = residual + k8_mma(xo, qweight, scales_t, None, group, plain,
                             torch.empty(rows, n, dtype=dtype, device=device), explicit=True)
    got = k8_mma(xo, qweight, scales_t, residual, group, cfg, torch.empty(rows, n, dtype=dtype, device=device),
                  explicit=True)
    equal = bool(torch.equal(got, ref))
    return [{"kernel": "residual epilogue", "dtype": str(dtype), "k": k, "rows": rows,
             "worst": 0.0 if equal else float((got.float() - ref.float()).abs().max()), "ok": equal}]


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
    ref = gated_torch(k8_mma(xo, qweight, scales_t, None, group, plain, torch.empty(rows, n, dtype=dtype,
                                                                                   device=device), explicit=True),
                      scale, order_out).float()
    got = k8_mma(xo, qweight, scales_t, scale, group, cfg, torch.empty(rows, n // 2, dtype=dtype, device=device),
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


def bound(xs: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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
    exact, limit = bound(xs, w, dtype)
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

        _SCRATCH.check_case(row, run, exact, limit, (rows, n), dtype)
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
_MMA_USABLE: dict = {}


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


def sweep_candidates(m: int, n: int, k: int) -> list[dict]:
    """k8 configurations bench/decode.py --check times for M rows of an [N, K] layer (all valid for K): for one row
    the one-row kernel over tile widths and steps, each at its default split and the two next to it; for more rows,
    tensor-core tiles of the row class, each at the default's split and the next larger."""
    sms = sm_count("cuda") if torch.cuda.is_available() else 132
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


def first_use(device: str, dtype: torch.dtype, cfg: dict, case: tuple, name: str) -> list[dict]:
    """The failed rows of one tensor-core instantiation's first-use check on one small case (rows, N, K, group, with
    pre_quant_scale): its epilogue's check where it has one, else check() of that instantiation alone."""
    rows, _, k, group, _ = case
    epi = cfg.get("epi", 0)
    if epi & EPI_GATED:
        return failed_rows(lambda: check_gated(device, dtype, cfg, k, group, rows))
    if epi & EPI_RESIDUAL:
        return failed_rows(lambda: check_residual(device, dtype, cfg, k, group, rows))
    return failed_rows(lambda: check(device, dtypes=(dtype,), cases=(case,), layouts=("mma",),
                                     variants=((name, cfg),)))


launch.CHECKS.update(mma_usable=mma_usable, first_use=first_use)
