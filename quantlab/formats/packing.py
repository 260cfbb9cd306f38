"""Integer codes packed into int32 words, as compressed-tensors, GPTQ and AWQ store them: `32 // bits` fields per word,
field j at bit offset j * bits (little-endian inside the word), laid out along one dimension of the tensor, and in
AWQ's GEMM layout interleaved inside each word of 8 nibbles. Plain torch; both directions (the packer builds test
checkpoints from the documented layout)."""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: the nibble at shift 4 * i holds column AWQ_ORDER[i] of its 8


def fields_per_word(bits: int) -> int:
    """How many `bits`-wide fields one int32 holds (2, 4 and 8 bit: 16, 8, 4)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"{bits}-bit codes do not tile an int32 word")
    return 32 // bits


def unpack(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> unsigned codes (int32), expanding `dim` (0: rows, 1: columns) by 32 // bits. `order[i]` is
    the position, inside its group of fields, of the field stored at shift bits * i (None: in order)."""
    per = fields_per_word(bits)
    words = packed.to(torch.int64) & 0xFFFFFFFF  # the words as unsigned 32-bit values
    shifts = torch.arange(per, dtype=torch.int64, device=packed.device) * bits
    mask = (1 << bits) - 1
    if dim == 1:
        fields = (words.unsqueeze(-1) >> shifts) & mask  # [R, C/per, per]: fields in storage order
        if order is not None:
            fields = fields[..., _inverse(order)]
        return fields.reshape(packed.shape[0], -1).to(torch.int32)
    fields = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [R/per, per, C]
    if order is not None:
        fields = fields[:, _inverse(order), :]
    return fields.reshape(-1, packed.shape[1]).to(torch.int32)


def pack(codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of unpack: unsigned codes (0 .. 2^bits - 1) -> int32 words along `dim`."""
    per = fields_per_word(bits)
    codes = codes.to(torch.int64)
    if codes.shape[dim] % per:
        raise ValueError(f"dimension {dim} ({codes.shape[dim]}) is not a multiple of {per}")
    if bool((codes < 0).any()) or bool((codes >> bits).any()):
        raise ValueError(f"codes outside 0 .. {(1 << bits) - 1}")
    shifts = torch.arange(per, dtype=torch.int64) * bits
    if dim == 1:
        fields = codes.reshape(codes.shape[0], -1, per)
        if order is not None:
            fields = fields[..., list(order)]
        words = (fields << shifts).sum(-1)
    else:
        fields = codes.reshape(-1, per, codes.shape[1])
        if order is not None:
            fields = fields[:, list(order), :]
        words = (fields << shifts.view(1, -1, 1)).sum(1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _inverse(order: tuple[int, ...]) -> list[int]:
    """Storage index of each logical position (AWQ: [0, 4, 1, 5, 2, 6, 3, 7])."""
    return [order.index(i) for i in range(len(order))]
