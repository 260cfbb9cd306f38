"""The packed INT4 weight codes of ModelOpt's AWQ export, unpacked (shared by the layers and the kernels' checks), and
the input order the one-row INT4 kernels read (shared by the layers that hand it over and the kernels' checks)."""
from __future__ import annotations

import torch


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N/2, K] (rows 2r in the low nibble, 2r+1 in the high nibble, two's complement) -> int8 [N, K]."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    low = torch.where(low >= 8, low - 16, low)
    high = torch.where(high >= 8, high - 16, high)
    out = torch.stack([low, high], dim=1)  # [N/2, 2, K]
    return out.reshape(packed.shape[0] * 2, packed.shape[1]).to(torch.int8)


def in_x_order(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 128) in the order the x-order INT4 kernels read (XP of kernels._int4_cuda: thread t's
    32 inputs of a block in the order of its B registers): position 128b + 32t + 8e + 2j + s holds input
    128b + 16(j + 4s) + 4t + e. By views (reshape, permute): index arithmetic torch.compile folds into the op
    producing x, no index tensor to load (a gather through one made each norm 2 us slower on the H200)."""
    m, k = x.shape
    return x.reshape(m, k // 128, 2, 4, 4, 4).permute(0, 1, 4, 5, 3, 2).reshape(m, k)


def from_x_order(x: torch.Tensor) -> torch.Tensor:
    """in_x_order's inverse: x [M, K] in the x order -> the layer's order."""
    m, k = x.shape
    return x.reshape(m, k // 128, 4, 4, 4, 2).permute(0, 1, 5, 4, 2, 3).reshape(m, k)
