"""The compiled layers' graph rewrite (quantlab.engines.fusion): a one-row INT4 projection added to a residual becomes
the projection with the residual epilogue exactly where the values are the same (views and exact dtype round trips
between them, nothing else reading the projection, no broadcasting, no scaled add), and nowhere else. The graphs are
aten graphs traced with fake tensors (what inductor's post-grad pass sees); the kernel's sums are checked on a GPU
(int4.check_residual at first use, bench/decode.py --check)."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from quantlab.engines import fusion
from quantlab.engines.kernels import int4  # noqa: F401 - registers the quantlab ops

N, K = 64, 256


def _inputs(dtype=torch.bfloat16, residual_shape=(1, 1, N), residual_dtype=None):
    return (torch.zeros(1, K, dtype=dtype), torch.zeros(N, K // 8, dtype=torch.int32),
            torch.zeros(K // 128, N, dtype=dtype), torch.zeros(*residual_shape, dtype=residual_dtype or dtype))


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _rewritten(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    count = fusion.fuse_residual_adds(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return count, gm


def _proj(x, q, s):
    return torch.ops.quantlab.w4a16_k8_ordered(x, q, s, 128)


@pytest.mark.skipif(not fusion.available, reason="this torch's inductor has no custom graph passes")
@pytest.mark.parametrize("order", ["residual_first", "residual_last"])
def test_projection_then_residual_add_becomes_one_op(order):
    def layer_end(x, q, s, residual):  # the MLP's return (float, back to the layer's dtype, its shape) and the add
        h = _proj(x, q, s).float().to(torch.bfloat16).reshape(1, 1, -1)
        return residual + h if order == "residual_first" else h + residual

    count, gm = _rewritten(layer_end, *_inputs())
    assert count == 1
    assert _ops(gm) == ["quantlab.w4a16_k8_ordered_add.default"], gm.graph
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert [a.name if isinstance(a, torch.fx.Node) else a for a in node.args] == ["x_1", "q_1", "s_1", 128,
                                                                                   "residual_1"]
    assert tuple(node.meta["val"].shape) == (1, 1, N) and node.meta["val"].dtype == torch.bfloat16


@pytest.mark.skipif(not fusion.available, reason="this torch's inductor has no custom graph passes")
def test_rewrite_leaves_adds_whose_values_would_change():
    def read_twice(x, q, s, residual):  # the projection read by something else too
        h = _proj(x, q, s).reshape(1, 1, -1)
        return residual + h, h * 2

    def in_float32(x, q, s, residual):  # the add in float32: one rounding fewer than the fused op's
        return residual.float() + _proj(x, q, s).float().reshape(1, 1, -1)

    def through_fp16(x, q, s, residual):  # bf16 -> fp16 rounds: not the projection's values
        return residual + _proj(x, q, s).to(torch.float16).to(torch.bfloat16).reshape(1, 1, -1)

    def scaled(x, q, s, residual):
        return torch.add(residual, _proj(x, q, s).reshape(1, 1, -1), alpha=2)

    def normed(x, q, s, residual):  # a post-feedforward norm between them (Gemma 2 / 3)
        return residual + torch.nn.functional.rms_norm(_proj(x, q, s), (N,)).reshape(1, 1, -1)

    def doubled(x, q, s, residual):  # the projection added to itself
        h = _proj(x, q, s).reshape(1, 1, -1)
        return h + h

    for fn in (read_twice, in_float32, through_fp16, scaled, normed, doubled):
        count, gm = _rewritten(fn, *_inputs())
        assert count == 0, fn.__name__
        assert "quantlab.w4a16_k8_ordered.default" in _ops(gm), fn.__name__

    def broadcast(x, q, s, residual):  # residual [2, 1, N] + projection [1, 1, N]
        return residual + _proj(x, q, s).reshape(1, 1, -1)

    assert _rewritten(broadcast, *_inputs(residual_shape=(2, 1, N)))[0] == 0

    def fp32_everything(x, q, s, residual):  # a float32 layer's add: the kernel's epilogue is for 16-bit types
        return residual + _proj(x, q, s).reshape(1, 1, -1)

    assert _rewritten(fp32_everything, *_inputs(dtype=torch.float32))[0] == 0


def test_fused_op_refuses_a_residual_of_another_shape_or_dtype():
    x, q, s, residual = _inputs()
    for bad in (torch.zeros(1, N + 8, dtype=torch.bfloat16), torch.zeros(1, N, dtype=torch.float16)):
        with pytest.raises(ValueError, match="residual epilogue"):
            int4.k8_launch_ordered_add(x, q, s, 128, bad)
