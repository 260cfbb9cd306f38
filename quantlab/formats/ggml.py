"""GGUF (ggml) quantization blocks, dequantized with torch from their documented layouts (ggml's block_* structs).

Each row of a quantized tensor is a run of blocks along the input dimension; `dequantize(raw, type)` turns rows of
raw bytes [rows, row_bytes] into float32 [rows, columns]. The arithmetic follows ggml's reference dequantizers
(dequantize_row_*) operation for operation in float32, so the values are theirs bit for bit.

    type   block  bytes  layout (little-endian)
    Q8_0    32     34    f16 d, 32 x int8 q                        w = d * q
    Q4_0    32     18    f16 d, 16 bytes: low nibbles = 0..15, high = 16..31      w = d * (n - 8)
    Q4_1    32     20    f16 d, f16 m, nibbles as Q4_0             w = d * n + m
    Q5_0    32     22    f16 d, u32 high bits, nibbles as Q4_0     w = d * (n | h << 4 - 16)
    Q5_1    32     24    f16 d, f16 m, u32 high bits, nibbles      w = d * (n | h << 4) + m
    Q2_K   256     84    16 x u8 (scale | min << 4), 64 B of 2-bit q, f16 d, f16 dmin
    Q3_K   256    110    32 B high-bit mask, 64 B of 2-bit q, 12 B of 6-bit scales, f16 d
    Q4_K   256    144    f16 d, f16 dmin, 12 B of 6-bit scales and mins, 128 B of nibbles
    Q5_K   256    176    f16 d, f16 dmin, 12 B scales/mins, 32 B high bits, 128 B of nibbles
    Q6_K   256    210    128 B low nibbles, 64 B high 2 bits, 16 x int8 scales, f16 d
"""
from __future__ import annotations

import torch

# type name -> (values per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def bits_of(ggml_type: str) -> float:
    """Stored bits per weight of a block type (scales included): Q4_0 4.5, Q4_K 4.5, Q6_K 6.5625."""
    values, size = BLOCKS[ggml_type]
    return size * 8 / values


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte offset `at` of every block [n, bytes] -> float32 [n, 1]."""
    return raw[:, at:at + 2].contiguous().view(torch.float16).float()


def _u32(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian uint32 at byte offset `at` of every block -> int64 [n, 1]."""
    b = raw[:, at:at + 4].to(torch.int64)
    return (b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24).unsqueeze(1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> 32 values: the low nibbles (elements 0..15), then the high ones (16..31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.int32)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit j of a uint32 per block -> [n, count] values 0/1."""
    return ((qh >> torch.arange(count, dtype=torch.int64)) & 1).to(torch.int32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:34].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_nibbles(b[:, 2:18]) - 8).float() * _f16(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:20]).float() * _f16(b, 0) + _f16(b, 2)


def _q5(b: torch.Tensor, at: int) -> torch.Tensor:
    """The 5-bit values of Q5_0 / Q5_1 blocks whose high-bit word is at byte `at`."""
    return _nibbles(b[:, at + 4:at + 20]) | (_high_bits(_u32(b, at), 32) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return (_q5(b, 2) - 16).float() * _f16(b, 0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _q5(b, 4).float() * _f16(b, 0) + _f16(b, 2)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16].to(torch.int32)
    qs = b[:, 16:80].to(torch.int32).view(n, 2, 1, 32)  # two halves of 128 values, 32 bytes each
    d, dmin = _f16(b, 80), _f16(b, 82)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)
    q = ((qs >> shifts) & 3).reshape(n, 16, 16)  # [half][shift][32] = 16 runs of 16 values, in output order
    dl = (d * (scales & 0xF).float()).unsqueeze(-1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    return (dl * q.float() - ml).reshape(n, 256)


def _q3_k_scales(raw: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 six-bit scales (ggml's kmask unpacking, one byte at a time)."""
    a = raw.to(torch.int32)
    low = torch.cat([a[:, 0:8] & 0x0F, a[:, 0:8] >> 4], dim=1)  # 16 low nibbles: scale j from byte j % 8
    top = a[:, 8:12]  # 2 high bits of scale j: byte 8 + j % 4, bits 2 * (j // 4)
    high = torch.cat([(top >> (2 * k)) & 3 for k in range(4)], dim=1)
    return low | (high << 4)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask = b[:, 0:32].to(torch.int32)
    qs = b[:, 32:96].to(torch.int32).view(n, 2, 1, 32)
    scales = _q3_k_scales(b[:, 96:108]) - 32
    d = _f16(b, 108)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)
    low = ((qs >> shifts) & 3).reshape(n, 8, 32)  # 8 runs of 32 values (half, shift)
    bit = torch.arange(8, dtype=torch.int32).view(1, 8, 1)  # run r reads bit r of the high mask
    high = (hmask.view(n, 1, 32) >> bit) & 1
    q = (low - torch.where(high == 1, 0, 4)).reshape(n, 16, 16)
    dl = (d * scales.float()).unsqueeze(-1)
    return (dl * q.float()).reshape(n, 256)


def _k4_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    q = raw.to(torch.int32)
    sc_low, m_low = q[:, 0:4] & 63, q[:, 4:8] & 63
    sc_high = (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)
    m_high = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return torch.cat([sc_low, sc_high], dim=1), torch.cat([m_low, m_high], dim=1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales(b[:, 4:16])
    qs = b[:, 16:144].to(torch.int32).view(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)  # runs of 32: low nibbles then high, per 64
    d1 = (d * sc.float()).unsqueeze(-1)
    m1 = (dmin * mn.float()).unsqueeze(-1)
    return (d1 * q.float() - m1).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k4_scales(b[:, 4:16])
    qh = b[:, 16:48].to(torch.int32).view(n, 1, 32)
    qs = b[:, 48:176].to(torch.int32).view(n, 4, 1, 32)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    high = (qh >> torch.arange(8, dtype=torch.int32).view(1, 8, 1)) & 1  # run r reads bit r of qh
    q = low + (high << 4)
    d1 = (d * sc.float()).unsqueeze(-1)
    m1 = (dmin * mn.float()).unsqueeze(-1)
    return (d1 * q.float() - m1).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].to(torch.int32).view(n, 2, 64)
    qh = b[:, 128:192].to(torch.int32).view(n, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().view(n, 2, 8)
    d = _f16(b, 208).view(n, 1, 1)
    parts = []
    for k, (lo, shift_lo) in enumerate(((0, 0), (32, 0), (0, 4), (32, 4))):  # the 4 runs of 32 in each half
        low = (ql[:, :, lo:lo + 32] >> shift_lo) & 0x0F
        high = (qh >> (2 * k)) & 3
        parts.append((low | (high << 4)) - 32)
    q = torch.stack(parts, dim=2)  # [n, half, run, 32]
    scale = (d * sc).view(n, 2, 4, 2, 1)  # run k of a half uses scales 2k, 2k+1 (one per 16 values)
    return (scale * q.view(n, 2, 4, 2, 16).float()).reshape(n, 256)


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k, "Q3_K": _q3_k,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """Rows of blocks: uint8 [rows, row_bytes] -> float32 [rows, row_bytes / bytes * values]."""
    values, size = BLOCKS[ggml_type]
    rows, row_bytes = raw.shape
    if row_bytes % size:
        raise ValueError(f"{ggml_type} rows of {row_bytes} bytes are not whole {size}-byte blocks")
    blocks = raw.reshape(-1, size)
    return _DEQUANT[ggml_type](blocks).reshape(rows, row_bytes // size * values)


def block_scales(raw: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """The f16 super-scale d of every block of rows of raw bytes -> float32 [rows, blocks] (where each type keeps
    it: first for the 32-blocks and Q4_K / Q5_K, last for Q6_K and Q3_K, after the codes for Q2_K)."""
    _, size = BLOCKS[ggml_type]
    at = {"Q6_K": 208, "Q3_K": 108, "Q2_K": 80}.get(ggml_type, 0)
    rows, row_bytes = raw.shape
    blocks = raw.reshape(-1, size)
    return _f16(blocks, at).reshape(rows, row_bytes // size)
