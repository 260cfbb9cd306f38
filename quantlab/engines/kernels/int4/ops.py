"""The five W4A16 custom ops (torch.library: traced by torch.compile, captured by CUDA graphs) and their fake
implementations (shapes only). Each calls one launcher of launch.py."""
from __future__ import annotations

import torch

from quantlab.engines.kernels.int4.launch import (
    k8_launch,
    k8_launch_gated,
    k8_launch_ordered,
    k8_launch_ordered_add,
    w4a16_launch,
)


@torch.library.custom_op("quantlab::w4a16_mm", mutates_args=())
def w4a16_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, pqs: torch.Tensor | None,
             group: int) -> torch.Tensor:
    """The packed W4A16 GEMM as one opaque op (traced by torch.compile, captured by CUDA graphs)."""
    return w4a16_launch(x, packed, scales, pqs, group)


@w4a16_mm.register_fake
def _(x, packed, _scales, _pqs, _group):
    return x.new_empty(x.shape[0], 2 * packed.shape[0])



@torch.library.custom_op("quantlab::w4a16_k8", mutates_args=())
def w4a16_k8(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, pqs: torch.Tensor | None,
             group: int) -> torch.Tensor:
    """The k8 W4A16 GEMM as one opaque op (traced by torch.compile, captured by CUDA graphs)."""
    return k8_launch(x, qweight, scales_t, pqs, group)


@w4a16_k8.register_fake
def _(x, qweight, _scales_t, _pqs, _group):
    return x.new_empty(x.shape[0], qweight.shape[0])



@torch.library.custom_op("quantlab::w4a16_k8_ordered", mutates_args=())
def w4a16_k8_ordered(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int) -> torch.Tensor:
    """k8_launch_ordered as one opaque op."""
    return k8_launch_ordered(x, qweight, scales_t, group)


@w4a16_k8_ordered.register_fake
def _(x, qweight, _scales_t, _group):
    return x.new_empty(x.shape[0], qweight.shape[0])



@torch.library.custom_op("quantlab::w4a16_k8_ordered_add", mutates_args=())
def w4a16_k8_ordered_add(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int,
                         residual: torch.Tensor) -> torch.Tensor:
    """k8_launch_ordered_add as one opaque op (what quantlab.engines.fusion rewrites w4a16_k8_ordered + add into)."""
    return k8_launch_ordered_add(x, qweight, scales_t, group, residual)


@w4a16_k8_ordered_add.register_fake
def _(_x, _qweight, _scales_t, _group, residual):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)



@torch.library.custom_op("quantlab::w4a16_k8_gated", mutates_args=())
def w4a16_k8_gated(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, scale: torch.Tensor | None,
                   group: int, order_out: bool) -> torch.Tensor:
    """k8_launch_gated as one opaque op."""
    return k8_launch_gated(x, qweight, scales_t, scale, group, order_out)


@w4a16_k8_gated.register_fake
def _(x, qweight, _scales_t, _scale, _group, _order_out):
    return x.new_empty(x.shape[0], qweight.shape[0] // 2)

