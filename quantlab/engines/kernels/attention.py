"""Decode attention: one query token per sequence over quantlab's static KV cache (quantlab.engines.decode), in one
Triton kernel that the decode step's CUDA graph captures.

softmax(scaling * q k^T (soft-capped: softcap * tanh(. / softcap)) over the allowed positions) v, where the allowed
positions are 0..pos (pos: the step's position tensor, read by the kernel, so one captured step replays at any
position) or, for a layer with a sliding window, pos - window + 1..pos (transformers' window: key > query - window).
GQA: a program holds the query heads that share a KV head, so the cache is read once per KV head. Flash-decoding:
the positions are split over programs (enough of them to fill the GPU at batch 1), each keeps an online softmax in
fp32, and the program that finishes last for its (sequence, KV head) combines the splits in a fixed order. K and V
are read as stored: the compute dtype, or E4M3 bytes dequantized in registers with the exported per-tensor scale
(value * scale rounded to the compute dtype: what the cache's read gives today, without materializing the whole
dequantized cache every step). Products are exact and accumulated in fp32; the probabilities are rounded to the
compute dtype for the product with V (as flash attention does; fp32 models keep them fp32).

`reference` is the same arithmetic in plain torch; `check` compares the kernel with it (tests: Triton's CPU
interpreter; bench/decode.py --check and `usable`: the GPU).
"""
from __future__ import annotations

import functools
import logging
import math

import torch

from quantlab.engines.kernels.device import available, interpreted, pdl_on, sm_count, triton_pdl
from quantlab.engines.kernels.scratch import Scratch

log = logging.getLogger("quantlab")
# cache positions per loop step: 64 for heads up to 128 wide (H200, 8B shape, 544 positions: 6.7 us a call against
# 8.7 us at 32 for one sequence, 11.8 against 13.5 us for 16; bench/results/h200-2026-12-02/attention_block.log),
# 32 for wider heads (two [64, 256] tiles in four warps' registers would spill)
BLOCK_L = 64
BLOCK_L_WIDE = 32
TARGET_PROGRAMS = 2  # per SM: the positions are split until the grid holds this many programs per SM
_SCRATCH = Scratch(1 << 20, 1 << 14)  # the split combine's workspace and counters


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def block_l(head_dim: int) -> int:
    """Cache positions per loop step for heads of this width."""
    return BLOCK_L if head_dim <= 128 else BLOCK_L_WIDE


def plan(batch: int, kv_heads: int, max_len: int, device: str, head_dim: int) -> tuple[int, int]:
    """(tiles per program, splits) for a cache of max_len positions read block_l(head_dim) positions a tile:
    splits until batch x KV heads x splits reaches TARGET_PROGRAMS per SM (at most one split per tile)."""
    tiles = -(-max_len // block_l(head_dim))
    splits = max(1, min(tiles, -(-TARGET_PROGRAMS * sm_count(device) // (batch * kv_heads))))
    per = -(-tiles // splits)
    return per, -(-tiles // per)


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
           scales: tuple[torch.Tensor, torch.Tensor] | None, scaling: float, window: int = 0,
           softcap: float = 0.0) -> torch.Tensor:
    """q [B, Hq, 1, D]; k_cache / v_cache [B, Hkv, L, D] (compute dtype, or uint8 E4M3 with scales = (k_scale,
    v_scale)); pos [1] (int) -> o [B, 1, Hq, D] in q's dtype. window 0: none; softcap 0: none."""
    import triton

    from quantlab.engines.kernels import _attention_triton

    b, hq, t, d = q.shape
    hkv, length = k_cache.shape[1], k_cache.shape[2]
    if t != 1 or hq % hkv or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"decode attention takes one query token and grouped heads (q {tuple(q.shape)}, "
                         f"cache {tuple(k_cache.shape)})")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = hq // hkv
    block_g, block_d = _pow2(group, 16), _pow2(d, 16)
    per, nsplit = plan(b, hkv, length, str(q.device), d)
    out = torch.empty(b, 1, hq, d, dtype=q.dtype, device=q.device)
    ws, cnt = _SCRATCH.get(q.device, b * hkv * nsplit * block_g * (block_d + 2), b * hkv)
    k_scale, v_scale = scales if scales is not None else (ws, ws)
    pdl = not interpreted() and pdl_on(q.device) and triton_pdl()
    _attention_triton.decode_attention[(b * hkv, nsplit)](
        q, k_cache, v_cache, out, pos, k_scale, v_scale, ws, cnt,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(2), hkv,
        float(scaling), float(softcap or 1.0), int(window or 0),
        G=group, D=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_L=block_l(d), TILES=per, SPLITS=nsplit,
        FP8=scales is not None, SOFTCAP=bool(softcap), F32_DOT=q.dtype == torch.float32 or interpreted(),
        PDL=pdl, num_warps=4, num_stages=2, **({"launch_pdl": True} if pdl else {}))
    del triton
    return out


@torch.library.custom_op("quantlab::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,  # noqa: PLR0913
                     k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, scaling: float, window: int,
                     softcap: float) -> torch.Tensor:
    """The decode attention kernel as one opaque op (traced by torch.compile, captured by CUDA graphs)."""
    scales = (k_scale, v_scale) if k_scale is not None else None
    return launch(q, k_cache, v_cache, pos, scales, scaling, window, softcap)


@decode_attention.register_fake
def _(q, _k_cache, _v_cache, _pos, _k_scale, _v_scale, _scaling, _window, _softcap):
    return q.new_empty(q.shape[0], 1, q.shape[1], q.shape[3])


def dequantize_e4m3(store: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 E4M3 bytes -> value * scale in dtype (the cache's read)."""
    return (store.view(torch.float8_e4m3fn).float() * scale.float()).to(dtype)


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int,
              scales: tuple[torch.Tensor, torch.Tensor] | None, scaling: float, window: int = 0,
              softcap: float = 0.0) -> torch.Tensor:
    """The same attention in plain torch (fp64 logits and softmax over the allowed positions) -> [B, 1, Hq, D]."""
    if scales is not None:
        k_cache, v_cache = dequantize_e4m3(k_cache, scales[0], q.dtype), dequantize_e4m3(v_cache, scales[1], q.dtype)
    groups = q.shape[1] // k_cache.shape[1]
    lo = max(0, pos - window + 1) if window else 0
    k = k_cache[:, :, lo: pos + 1].double().repeat_interleave(groups, 1)
    v = v_cache[:, :, lo: pos + 1].double().repeat_interleave(groups, 1)
    s = q.double() @ k.transpose(-1, -2) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return (torch.softmax(s, -1) @ v).transpose(1, 2).to(q.dtype)


CHECK_CASES = (  # batch, query heads, KV heads, head dim, cache length, position, window, softcap, fp8
    (2, 4, 2, 16, 70, 45, 0, 0.0, False), (1, 8, 2, 64, 100, 99, 16, 0.0, True),
    (2, 4, 4, 32, 40, 7, 0, 30.0, False), (1, 6, 2, 80, 64, 63, 20, 50.0, True),
)


def check(device: str = "cpu", dtypes=(torch.float16, torch.float32), cases=CHECK_CASES, seed: int = 0) -> list[dict]:
    """The kernel against `reference`, case by case: `err` is the largest |difference| over the output's scale
    (ok below 3 roundings of a 16-bit compute dtype, 1e-5 for fp32)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for batch, hq, hkv, d, length, pos, window, softcap, fp8 in cases:
        for dtype in dtypes:
            q = torch.randn(batch, hq, 1, d, generator=g).to(dtype)
            k = torch.randn(batch, hkv, length, d, generator=g) * 2
            v = torch.randn(batch, hkv, length, d, generator=g)
            scales = None
            if fp8:
                scales = (torch.tensor(0.02), torch.tensor(0.01))
                k = (k / scales[0]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
                v = (v / scales[1]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            else:
                k, v = k.to(dtype), v.to(dtype)
            want = reference(q, k, v, pos, scales, d ** -0.5, window, softcap).double()
            row = {"case": [batch, hq, hkv, d, length, pos, window, softcap, fp8],
                   "dtype": str(dtype).removeprefix("torch."), "err": float("inf"), "ok": False}
            try:
                args = [t.to(device) for t in (q, k, v, torch.tensor([pos]))]
                dev_scales = tuple(s.to(device) for s in scales) if scales else None
                got = launch(*args, dev_scales, d ** -0.5, window, softcap).cpu().double()
                row["splits"] = plan(batch, hkv, length, device, d)[1]
                row["err"] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
                row["ok"] = row["err"] < (1e-5 if dtype == torch.float32 else 3 * torch.finfo(dtype).eps)
            except Exception as exc:  # noqa: BLE001 - reported as a failed case
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                _SCRATCH.clear()
            out.append(row)
    return out


@functools.cache
def usable(device: str, dtype: torch.dtype) -> bool:
    """Whether the kernel runs and matches the reference on this device and dtype (checked once per process; False
    where Triton cannot run: the decode then uses today's attention)."""
    if not available() or (not device.startswith("cuda") and not interpreted()):
        return False
    try:
        bad = [r for r in check(device, dtypes=(dtype,)) if not r["ok"]]
    except Exception as exc:  # noqa: BLE001 - no kernel then, said once
        bad = [{"error": f"{type(exc).__name__}: {exc}"}]
    if bad:
        log.warning("decode attention: the Triton kernel failed its check on %s (%s); using sdpa / eager", device,
                    bad[:2])
    return not bad
