"""The tensor-core W4A16 kernel (CUDA C++, compiled by NVRTC) where no GPU is: its source compiles for the GPUs the
engine targets without spilling registers, its fragment mapping multiplies the k8 layout correctly, and the engine
never picks it where it cannot run. Its numbers are checked on a GPU (int4.mma_usable, bench/decode.py --check)."""
from __future__ import annotations

import pytest
import torch

from quantlab.engines.kernels import _int4_cuda, cuda_rtc, int4


def _names(shapes, groups, dtypes) -> list[str]:
    return [_int4_cuda.name(w, u, r, gs, bf16) for w, u, r in shapes for gs in groups for bf16 in dtypes]


@pytest.mark.parametrize("arch", ["80", "90"])
def test_source_compiles_for_every_configuration_without_spills(arch):
    try:
        cuda_rtc.nvrtc()
    except cuda_rtc.RtcError as exc:
        pytest.skip(str(exc))
    if arch == "90":  # every configuration the sweep times, the groups inside a block on one of them
        names = _names(int4.MMA_SHAPES, (0,), (True,)) + _names([(8, 2, 1), (4, 1, 2)], (16, 32, 64), (True, False))
    else:
        names = _names([(8, 2, 1), (16, 1, 1), (8, 1, 2)], (0, 64), (True, False))
    log: list[str] = []
    cubin, lowered = cuda_rtc.compile_kernels(_int4_cuda.SOURCE, names, arch, ("--ptxas-options=--warn-on-spills",),
                                              log)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(names) and all(sym.startswith("_Z") for sym in lowered.values())
    assert "spill" not in "".join(log), log


def test_compile_error_is_reported_with_the_compiler_log():
    try:
        cuda_rtc.nvrtc()
    except cuda_rtc.RtcError as exc:
        pytest.skip(str(exc))
    with pytest.raises(cuda_rtc.RtcError, match="undefined_thing"):
        cuda_rtc.compile_kernels("__global__ void k() { undefined_thing(); }", ["k"], "90")


def _emulate(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int) -> torch.Tensor:
    """The kernel's data flow in torch, index for index as _int4_cuda.SOURCE reads it: per warp 16 rows, per block
    of 128 inputs thread (g, t) takes words 4t..4t+3 of rows g and g + 8; mma (e, h) has in k slots (2t, 2t+1) the
    pair (2h, 2h+4) of word 4t+e and in (2t+8, 2t+9) the pair (2h+1, 2h+5); B the x values of the same inputs.
    Each mma is a [16, 16] x [16, M] product accumulated in float64 here (the kernel: fp32 on tensor cores)."""
    m, k = x.shape
    n = qweight.shape[0]
    w = int4.k8_dequantized(qweight, scales_t, group).double()  # [N, K]: the values the kernel dequantizes
    out = torch.zeros(m, n, dtype=torch.float64)
    for n0 in range(0, n, 16):
        for b in range(k // 128):
            for e in range(4):
                for h in range(2):
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    bm = torch.zeros(16, m, dtype=torch.float64)
                    for row in range(16):
                        for t in range(4):
                            word = 4 * t + e
                            nibbles = (2 * h, 2 * h + 4, 2 * h + 1, 2 * h + 5)  # slots 2t, 2t+1, 2t+8, 2t+9
                            for slot, j in zip((2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9), nibbles, strict=True):
                                kk = 128 * b + 16 * j + word
                                a[row, slot] = w[n0 + row, kk]
                                bm[slot] = x[:, kk].double()
                    out[:, n0: n0 + 16] += (a @ bm).t()
    return out


@pytest.mark.parametrize("group", [32, 128])
def test_fragment_mapping_multiplies_the_k8_layout(group):
    g = torch.Generator().manual_seed(3)
    n, k, m = 32, 256, 3
    packed = torch.randint(0, 256, (n // 2, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    qweight, scales_t = int4.repack(packed, scales)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    exact = x.double() @ int4.k8_dequantized(qweight, scales_t, group).double().t()
    torch.testing.assert_close(_emulate(x, qweight, scales_t, group), exact, rtol=1e-12, atol=1e-12)


def test_engine_does_not_pick_it_where_it_cannot_run():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (32, 256), generator=g, dtype=torch.uint8)
    scales = (torch.rand(64, 4, generator=g) * 0.02).to(torch.bfloat16)
    qweight, scales_t = int4.repack(packed, scales)
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    assert int4.mma_applies(1, 64, 256, 64, torch.bfloat16)
    assert not int4.mma_applies(9, 64, 256, 64, torch.bfloat16)  # more rows than an mma's 8 columns
    assert not int4.mma_applies(1, 40, 256, 64, torch.bfloat16)  # N not in tiles of 16
    assert not int4.mma_applies(1, 64, 256, 64, torch.float32)
    assert not int4.mma_ready(x, 64, 256, 64)  # a CPU tensor
    assert all(not c.get("mma") for c in int4.sweep_candidates(1, 64, 256)) or torch.cuda.is_available()
    cfg = int4.mma_config(4096, 14336)
    assert cfg["mma"] and 4 <= cfg["warps"] <= 16 and (cfg["warps"], cfg["unroll"], cfg["tiles"]) in int4.MMA_SHAPES
    with pytest.raises(ValueError, match="up to 8 rows"):
        int4._k8_mma(torch.zeros(9, 256, dtype=torch.bfloat16), qweight, scales_t, None, 64,
                     {"mma": True, "warps": 4, "unroll": 1}, torch.empty(9, 64, dtype=torch.bfloat16))
