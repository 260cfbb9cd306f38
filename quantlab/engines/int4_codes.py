"""The packed INT4 weight codes of ModelOpt's AWQ export, unpacked (shared by the layers and the kernels' checks)."""
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
