"""The weight layouts of the W4A16 kernels and their plain-torch readings: the export layout's reference GEMM; the k8
layout (repack, its offsets, its codes and dequantized weights); the gate|up interleave of the gated epilogue (and how
its output is taken apart). What a kernel's `prepare` calls; the checks compare the kernels with these."""
from __future__ import annotations

import torch

from quantlab.engines.int4_codes import in_x_order, unpack_int4
from quantlab.engines.kernels.int4.configs import K8_TILE


def reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
              group: int) -> torch.Tensor:
    """The same arithmetic in plain torch (export layout): dequantize (q * scale in fp32, rounded to the compute
    dtype), GEMM."""
    dtype = x.dtype
    if pqs is not None:
        x = x * pqs
    w = (unpack_int4(packed).float() * scales.float().repeat_interleave(group, dim=1)).to(dtype)
    return x @ w.t()



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

