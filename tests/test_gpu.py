"""GPU-only checks (skipped without CUDA): the torch engine's native FP8 GEMM against the exact emulation."""
from __future__ import annotations

import pytest
import torch

from quantlab.engines import qlayers

pytestmark = pytest.mark.gpu
needs_fp8 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                               reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")


@needs_fp8
def test_native_fp8_matches_emulation():
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(256, 512, generator=g)
    ws = w.abs().max() / 448
    w8 = (w / ws).to(torch.float8_e4m3fn)
    x = torch.randn(64, 512, generator=g)
    xs = x.abs().max() / 448
    emulated = qlayers.Fp8Linear(w8, ws, xs, None, native=False)(x)
    native = qlayers.Fp8Linear(w8.cuda(), ws.cuda(), xs.cuda(), None, native=True).cuda()(x.cuda().bfloat16())
    assert torch.allclose(native.float().cpu(), emulated, rtol=2e-2, atol=2e-2 * emulated.abs().max().item())
