"""The tensor-core W4A16 kernel (CUDA C++, compiled by NVRTC) where no GPU is: its source compiles for the GPUs the
engine targets without spilling registers, its fragment mapping multiplies the k8 layout correctly, and the engine
never picks it where it cannot run. Its numbers are checked on a GPU (int4.mma_usable, bench/decode.py --check)."""
from __future__ import annotations

import struct

import pytest
import torch

from quantlab.engines.int4_codes import from_x_order, in_x_order, unpack_int4
from quantlab.engines.kernels import _int4_cuda, api, cuda_rtc, int4


def _names(shapes, groups, dtypes, flags=((False, False),)) -> list[str]:
    """Instantiations; flags: (pre_quant_scale, x in x_order) pairs."""
    return [_int4_cuda.name(w, u, r, gs, bf16, p, xp) for w, u, r in shapes for gs in groups for bf16 in dtypes
            for p, xp in flags]


@pytest.mark.parametrize("arch", ["80", "90"])
def test_source_compiles_for_every_configuration_without_spills(arch):
    try:
        cuda_rtc.nvrtc()
    except cuda_rtc.RtcError as exc:
        pytest.skip(str(exc))
    if arch == "90":  # every configuration the sweep times, the groups inside a block on one of them, bulk copies
        # (x in x_order wherever the sweep may put a shape; pre_quant_scale in the kernel on one tile a warp)
        names = _names(int4.MMA_SHAPES, (0, 128), (True,), ((False, False), (False, True)))
        names += _names([shape for shape in int4.MMA_SHAPES if shape[2] == 1], (128,), (True,), ((True, False),))
        names += _names([(4, 1, 1), (16, 1, 1)], (0, 64), (True, False), ((True, False),))
        names += _names([(8, 2, 1), (4, 1, 2)], (16, 32, 64), (True, False))
        names += [_int4_cuda.tma_name(w, spw, bf16, xp) for w, spw in ((4, 8), (8, 4), (16, 2), (4, 1), (8, 8))
                  for bf16 in (True, False) for xp in (False, True)]
        # the gated epilogue (flags: gated, + scale, + order)
        names += [_int4_cuda.tma_name(w, spw, bf16, True, epi) for w, spw in ((4, 8), (8, 4), (16, 2))
                  for bf16 in (True, False) for epi in (1, 3, 7)]
    else:
        names = _names([(8, 2, 1), (16, 1, 1), (8, 1, 2)], (0, 64, 128), (True, False), ((False, False), (False, True)))
        # pre_quant_scale in the kernel (the attention output's projection, one tile a warp unless CONFIGS says
        # otherwise; with two tiles and groups of 64 it spills 8 bytes on sm_80)
        names += _names([(8, 2, 1), (16, 1, 1)], (0, 64, 128), (True, False), ((True, False),))
    names += [_int4_cuda.name(w, u, 1, gs, bf16, False, True, epi) for w, u in ((4, 1), (16, 1))
              for gs in (64, 128) for bf16 in (True, False) for epi in (1, 7)]
    # the residual epilogue (a layer's last projection, x in x_order; the widest and the most-unrolled shapes)
    names += [_int4_cuda.name(w, u, r, 128, True, False, True, 8) for w, u, r in ((16, 1, 1), (8, 2, 1), (4, 1, 2))]
    if arch == "90":
        names += [_int4_cuda.tma_name(w, spw, True, True, 8) for w, spw in ((4, 8), (8, 4), (16, 2))]
    log: list[str] = []
    cubin, lowered = cuda_rtc.compile_kernels(_int4_cuda.SOURCE, names, arch, ("--ptxas-options=--warn-on-spills",),
                                              log)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(names) and all(sym.startswith("_Z") for sym in lowered.values())
    assert "spill" not in "".join(log), log


def test_epilogue_flags_refuse_combinations_no_kernel_has():
    assert _int4_cuda.name(16, 1, 2, 128, True, False, True, 8).endswith(", 8>")  # residual: any row tiles
    for epi in (8 | 1, 8 | 2, 2, 4, 6):
        with pytest.raises(ValueError):
            _int4_cuda.name(16, 1, 1, 128, True, False, True, epi)
        with pytest.raises(ValueError):
            _int4_cuda.tma_name(8, 4, True, True, epi)
    with pytest.raises(ValueError):
        _int4_cuda.name(16, 1, 2, 128, True, False, True, 1)  # the gated epilogue: one tile a warp
    with pytest.raises(ValueError):
        _int4_cuda.name(16, 1, 1, 128, True, True, False, 8)  # p is the residual: no pre_quant_scale


def test_programmatic_launch_structs_have_the_driver_layout():
    """cuLaunchKernelEx reads CUlaunchConfig and CUlaunchAttribute as the CUDA headers lay them out (64-bit): the
    config's stream at byte 32 after seven 32-bit fields and padding, the attribute's value union at byte 8."""
    import ctypes

    assert ctypes.sizeof(cuda_rtc._LaunchAttribute) == 72 and cuda_rtc._LaunchAttribute.value.offset == 8
    config = cuda_rtc._LaunchConfig
    assert (config.sharedMemBytes.offset, config.hStream.offset, config.attrs.offset, config.numAttrs.offset) == (
        24, 32, 40, 48)
    assert ctypes.sizeof(config) == 56
    attr = bytes(cuda_rtc.pdl_attribute())  # id 6 (programmatic stream serialization), then the allowed flag at 8
    assert attr[:4] == (6).to_bytes(4, "little") and attr[8:12] == (1).to_bytes(4, "little") and not any(attr[12:])


def test_compile_error_is_reported_with_the_compiler_log():
    try:
        cuda_rtc.nvrtc()
    except cuda_rtc.RtcError as exc:
        pytest.skip(str(exc))
    with pytest.raises(cuda_rtc.RtcError, match="undefined_thing"):
        cuda_rtc.compile_kernels("__global__ void k() { undefined_thing(); }", ["k"], "90")


def _f(bits: int) -> float:
    """A bf16 bit pattern -> its value."""
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _bits(value: float) -> int:
    """A value -> its bf16 bit pattern, rounded to nearest even once (torch's conversion from float64)."""
    return int(torch.tensor([value], dtype=torch.float64).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF


def _dq_pair(t: int, sp: int) -> int:
    """dq_pair<true> of _int4_cuda.SOURCE on Python ints: LOP3 (t & 0x000F000F) | 0x43004300, times 1 minus 136
    (bf16x2 FMA), times the scale pair plus -0 (one RN rounding) -> the packed bf16 pair."""
    v = (t & 0x000F000F) | 0x43004300
    halves = []
    for shift in (0, 16):
        u = _f(v >> shift)
        q = _f(_bits(u * 1.0 - 136.0))
        halves.append(_bits(q * _f(sp >> shift)))
    return halves[0] | (halves[1] << 16)


def _pair_of(p: tuple[int, int], q: tuple[int, int], e: int) -> int:
    """pair_of of the source: word e // 2 of two uint2 values, __byte_perm with 0x5410 (low halves) or 0x7632."""
    a, b = p[e // 2], q[e // 2]
    return ((a >> 16) | (b & 0xFFFF0000)) if e & 1 else ((a & 0xFFFF) | ((b & 0xFFFF) << 16))


def _scale_x(v: tuple[int, int], p: tuple[int, int]) -> tuple[int, int]:
    """scale_x: each bf16 of two packed pairs times the other's, rounded once to bf16 (RN)."""
    def mul2(a: int, b: int) -> int:
        lo = torch.tensor([_f(a) * _f(b)], dtype=torch.float64).to(torch.bfloat16)  # the exact product, one RN
        hi = torch.tensor([_f(a >> 16) * _f(b >> 16)], dtype=torch.float64).to(torch.bfloat16)
        return (int(lo.view(torch.int16)) & 0xFFFF) | ((int(hi.view(torch.int16)) & 0xFFFF) << 16)
    return mul2(v[0], p[0]), mul2(v[1], p[1])


def _x_words(xr: list, pb: list | None, b: int, t: int, ordered: bool) -> list:
    """load_x of the register-fed kernel for block b, thread t of one row's 16-bit patterns xr: XRow's 8 uint2 (x
    at 128b + 16j + 4t, times pre_quant_scale pb through scale_x where given), or XPerm's 16 words (xp = x + 32t,
    four 16-byte loads at xp + 128b + 8i)."""
    if ordered:
        base = 128 * b + 32 * t
        return [xr[base + 2 * w] | (xr[base + 2 * w + 1] << 16) for w in range(16)]

    def pair(v: list, j: int) -> tuple[int, int]:
        i = 128 * b + 16 * j + 4 * t
        return v[i] | (v[i + 1] << 16), v[i + 2] | (v[i + 3] << 16)

    return [pair(xr, j) if pb is None else _scale_x(pair(xr, j), pair(pb, j)) for j in range(8)]


def _bfrag(xv: list, e: int, j: int, ordered: bool) -> int:
    """bfrag: B register (e, j) from a block's x as loaded - XPerm's word 4e + j, or XRow's pair_of."""
    return xv[4 * e + j] if ordered else _pair_of(xv[j], xv[j + 4], e)


def _emulate(x: torch.Tensor, qweight: torch.Tensor, scales_t: torch.Tensor, group: int,
             tma_warps: int = 0, pqs: torch.Tensor | None = None, ordered: bool = False) -> torch.Tensor:
    """The kernel (one warp a row tile, UNROLL 1) on bit patterns, expression for expression as _int4_cuda.SOURCE
    writes them: the 128-bit word loads, the scale pairs, the uint2 x loads, dq_pair, pair_of, the mma fragments
    (A rows g / g + 8, k slots 2t, 2t+1, 2t+8, 2t+9; B column g = batch row min(g, M-1)), accumulated in float64.
    tma_warps: w4a16_k8_tma with that many warps instead (one row, group 128): each CTA's staging built from its
    chunk copies, the codes read from it and x and the scales from global memory, as that kernel reads them.
    pqs: the register-fed kernel's PQS instantiation - pre_quant_scale read at the addresses of x's loads (pp) and
    scale_x. ordered: the XP instantiations - x given in the x order, thread t's block b read as 16 words from
    128b + 32t, B register (e, j) = word 4e + j (bfrag of XPerm)."""
    m, k = x.shape
    n = qweight.shape[0]
    words = [int(v) & 0xFFFFFFFF for v in qweight.flatten().tolist()]  # the memory the kernel reads
    tile = (k // 128) * 64  # 128-bit words in a tile of 16 rows
    xb = [[int(v) & 0xFFFF for v in row] for row in x.view(torch.int16).tolist()]
    pb = None if pqs is None else [int(v) & 0xFFFF for v in pqs.view(torch.int16).tolist()]
    sb = [[int(v) & 0xFFFF for v in row] for row in scales_t.view(torch.int16).tolist()]
    per = 128 // group if group < 128 else 1
    ns = per // 2 if group < 128 else 1
    out = torch.zeros(m, n, dtype=torch.float64)
    nb = k // 128

    def fetch_mma(n0: int, b: int, g: int, t: int):
        xr = xb[min(g, m - 1)]
        at = [(n0 >> 4) * tile + 4 * g + t + b * 64 + 32 * half for half in range(2)]  # wt + b * 64 + 32 * half
        wv = [[words[4 * a + e] for e in range(4)] for a in at]
        xv = _x_words(xr, pb, b, t, ordered)
        sv = []
        for r in (n0 + g, n0 + g + 8):
            pairs = []
            for q in range(ns):
                lo = per * b + q if group < 128 else (128 * b) // group
                hi = lo + per // 2 if group < 128 else lo
                pairs.append(sb[lo][r] | (sb[hi][r] << 16))
            sv.append(pairs)
        return wv, xv, sv

    staged: dict = {}  # tile -> the CTA's shared memory as 32-bit words: codes [nb * 64 * 4]
    xw = [xb[0][2 * i] | (xb[0][2 * i + 1] << 16) for i in range(k // 2)]  # x (one row) as 32-bit words

    def fetch_tma(n0: int, b: int, g: int, t: int):
        warps = tma_warps
        spw = nb // warps
        if n0 not in staged:
            src = (n0 // 16) * nb * 64  # w + blockIdx.x * NB * 64 (uint4)
            mem = [0] * (nb * 64 * 4)
            for c in range(spw):  # bulk_load(staged + c * WARPS * 64, src + c * WARPS * 64, WARPS * 1024)
                lo = 4 * (c * warps * 64)
                mem[lo: lo + warps * 256] = words[4 * (src + c * warps * 64): 4 * (src + c * warps * 64) + warps * 256]
            staged[n0] = mem
        mem = staged[n0]
        i = b // warps  # block b = warp + i * WARPS: that warp waits bar[i], whose copy must hold the block
        assert i * warps * 64 <= b * 64 and b * 64 + 64 <= (i + 1) * warps * 64
        wv = [[mem[4 * ((b * 16 + g + 8 * half) * 4 + t) + e] for e in range(4)] for half in range(2)]
        xs = 2 * t  # (const uint2*)x + t, then xs[32 * b + 4 * j]
        xv = [(xw[xs + 2 * (32 * b + 4 * j)], xw[xs + 2 * (32 * b + 4 * j) + 1]) for j in range(8)]
        if ordered:  # xs = (const uint2*)x + 8t, then load_x: 16 words from 128b + 32t
            xv = [xw[64 * b + 16 * t + w] for w in range(16)]
        sv = [[sb[b][n0 + g + 8 * half] | (sb[b][n0 + g + 8 * half] << 16)] for half in range(2)]
        return wv, xv, sv

    fetch = fetch_tma if tma_warps else fetch_mma
    for n0 in range(0, n, 16):
        for b in range(k // 128):
            frag = {(g, t): fetch(n0, b, g, t) for g in range(8) for t in range(4)}  # words, x pairs, scale pairs
            for e in range(4):
                for h in range(2):
                    j0, j1 = 2 * h, 2 * h + 1
                    q0, q1 = j0 * ns // 4, j1 * ns // 4
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    bm = torch.zeros(16, 8, dtype=torch.float64)
                    for (g, t), (wv, xv, sv) in frag.items():
                        regs = {0: _dq_pair(wv[0][e] >> (4 * j0), sv[0][q0]),  # a0: row g, nibbles j0 / j0+4
                                1: _dq_pair(wv[1][e] >> (4 * j0), sv[1][q0]),  # a1: row g + 8
                                2: _dq_pair(wv[0][e] >> (4 * j1), sv[0][q1]),  # a2: row g, slots 2t+8, 2t+9
                                3: _dq_pair(wv[1][e] >> (4 * j1), sv[1][q1])}
                        for reg, word in regs.items():
                            row, col = g + 8 * (reg & 1), 2 * t + 8 * (reg >> 1)
                            a[row, col], a[row, col + 1] = _f(word), _f(word >> 16)
                        b01 = (_bfrag(xv, e, j0, ordered), _bfrag(xv, e, j1, ordered))
                        for reg, word in enumerate(b01):
                            bm[2 * t + 8 * reg, g], bm[2 * t + 8 * reg + 1, g] = _f(word), _f(word >> 16)
                    out[:, n0: n0 + 16] += (a @ bm)[:, :m].t()
    return out


@pytest.mark.parametrize(("group", "tma_warps", "k", "with_pqs", "ordered"),
                         [(16, 0, 256, False, False), (64, 0, 256, False, False), (128, 0, 256, False, False),
                          (256, 0, 256, False, False), (128, 4, 1024, False, False), (128, 8, 1024, False, False),
                          (64, 0, 256, True, False), (128, 0, 1024, True, False), (32, 0, 256, False, True),
                          (128, 0, 256, False, True), (128, 4, 1024, False, True)])
def test_kernel_arithmetic_emulated_multiplies_the_k8_layout(group, tma_warps, k, with_pqs, ordered):
    g = torch.Generator().manual_seed(3)
    n, m = 32, 1 if tma_warps else 3
    packed = torch.randint(0, 256, (n // 2, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    qweight, scales_t = int4.repack(packed, scales)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    pqs = (torch.rand(k, generator=g) * 3 + 0.1).to(torch.bfloat16) if with_pqs else None
    xs = x * pqs if with_pqs else x  # torch's product in bf16: what the PQS instantiation must equal
    assert not with_pqs or not torch.equal(xs, x)
    exact = xs.double() @ int4.k8_dequantized(qweight, scales_t, group).double().t()
    if ordered:  # the layers hand the kernel x in the x order (in_x_order's views: the order _x_order spells out)
        order = _x_order(k)
        assert torch.equal(order.sort().values, torch.arange(k))
        assert torch.equal(in_x_order(x), x[:, order]) and torch.equal(from_x_order(in_x_order(x)), x)
        x = in_x_order(x)
    torch.testing.assert_close(_emulate(x, qweight, scales_t, group, tma_warps, pqs, ordered), exact, rtol=1e-12,
                               atol=1e-12)


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
    assert int4.tma_shape(1, 28672, 4096, 128, torch.bfloat16, 8)  # the bulk-copy variant: gate|up at one row
    assert not int4.tma_shape(2, 28672, 4096, 128, torch.bfloat16, 8)  # one row only
    assert not int4.tma_shape(1, 28672, 4096, 64, torch.bfloat16, 8)  # group 128 only
    assert not int4.tma_shape(1, 28672, 4096, 128, torch.bfloat16, 3)  # blocks in whole rounds of the warps
    assert not int4.tma_shape(1, 4096, 14336, 128, torch.bfloat16, 16)  # staging over TMA_MAX_SHARED
    assert not int4.tma_applies(1, 64, 512, 128, torch.bfloat16, "cpu", 4)
    cfg = int4.mma_config(14336)
    assert cfg["mma"] and 4 <= cfg["warps"] <= 16 and (cfg["warps"], cfg["unroll"], cfg["tiles"]) in int4.MMA_SHAPES
    with pytest.raises(ValueError, match="up to 8 rows"):
        int4.k8_mma(torch.zeros(9, 256, dtype=torch.bfloat16), qweight, scales_t, None, 64,
                     {"mma": True, "warps": 4, "unroll": 1}, torch.empty(9, 64, dtype=torch.bfloat16))


def test_route_keeps_the_sweeps_entry_and_falls_back_where_the_kernel_cannot_run(monkeypatch):
    mma = {"mma": True, "warps": 4, "unroll": 1, "tiles": 1}
    monkeypatch.setitem(int4.CONFIGS, (1, 64, 256), mma)
    assert int4.k8_route(1, 64, 256, "cpu", lambda: True) == mma
    fallback = int4.k8_route(1, 64, 256, "cpu", lambda: False)  # committed entry, kernel not usable here
    assert fallback.get("gemv") and not fallback.get("mma")
    monkeypatch.setitem(int4.CONFIGS, (16, 64, 256), mma)  # a tensor-core entry in the 16-row class
    assert int4.k8_route(5, 64, 256, "cpu", lambda: True) == mma
    assert int4.k8_route(12, 64, 256, "cpu", lambda: True).get("dot")  # more rows than an mma's 8 columns
    triton = {"gemv": True, "block_n": 64, "bpi": 1, "split_k": 2, "num_warps": 4}
    monkeypatch.setitem(int4.CONFIGS, (1, 64, 256), triton)  # the sweep's winner is the Triton kernel: kept
    assert int4.k8_route(1, 64, 256, "cpu", lambda: True) == triton
    assert int4.k8_route(1, 128, 256, "cpu", lambda: True)["mma"]  # no entry: one row takes it where ready
    assert not int4.k8_route(1, 128, 256, "cpu", lambda: False).get("mma")
    assert not int4.k8_route(2, 128, 256, "cpu", lambda: True).get("mma")  # 2-8 rows only by a sweep entry


def test_k8_layout_holds_every_code_where_k8_offset_says():
    g = torch.Generator().manual_seed(5)
    n, k = 48, 384
    packed = torch.randint(0, 256, (n // 2, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // 128, generator=g).to(torch.bfloat16)
    qweight, _ = int4.repack(packed, scales)
    codes = unpack_int4(packed)  # [N, K] signed, input order
    assert torch.equal(int4.k8_codes(qweight), codes.to(torch.int8))
    flat = qweight.flatten()
    for row in (0, 15, 16, 33, 47):
        for word in (0, 5, 16, 47):
            b, i = divmod(word, 16)
            value = int(flat[int4.k8_offset(row, word, k // 8)]) & 0xFFFFFFFF
            nibbles = [(value >> (4 * j)) & 15 for j in range(8)]
            assert nibbles == [int(codes[row, 128 * b + 16 * j + i]) + 8 for j in range(8)]
    with pytest.raises(ValueError, match="tiles of 16"):
        int4.repack(packed[:20], scales[:40])


def test_a_kernel_check_that_ran_nothing_or_raised_is_a_failure():
    assert api.failed_rows(lambda: [{"ok": True}]) == []
    assert api.failed_rows(lambda: [{"ok": True}, {"ok": False, "kernel": "k"}]) == [{"ok": False, "kernel": "k"}]
    assert api.failed_rows(lambda: []) == [{"error": "the check ran no case"}]
    assert "ValueError: boom" in api.failed_rows(lambda: (_ for _ in ()).throw(ValueError("boom")))[0]["error"]
    assert int4.tma_shared(4096) == 32 * 1024  # a 16-row tile's codes at K 4096


def _x_order(k: int) -> torch.Tensor:
    """The x order as the kernel's B registers define it (XPerm's bfrag): position 128b + 32t + 8e + 2j + s holds
    input 128b + 16(j + 4s) + 4t + e."""
    b, t, e, j, s = torch.meshgrid(*(torch.arange(n) for n in (k // 128, 4, 4, 4, 2)), indexing="ij")
    return (128 * b + 16 * (j + 4 * s) + 4 * t + e).reshape(-1)


def _x_position(i: int) -> int:
    """_int4_cuda's x_position, expression for expression."""
    r, jj = i & 127, (i & 127) >> 4
    return (i & ~127) + 32 * ((r >> 2) & 3) + 8 * (r & 3) + 2 * (jj & 3) + (jj >> 2)


def test_gated_epilogue_indexing_matches_the_torch_path():
    """The gated epilogue's indexing on the CPU: interleave_gated puts gate row 8i + r at tile row r and up row 8i + r
    at tile row 8 + r of tile i, so the CTA of tile i writes output 8i + r (finish: n0 / 2 + row) from its rows r and
    8 + r; with ORDER at x_position(out), the x order's inverse. The same values as gated_torch (deinterleave, silu, up,
    scale, order) and as the layers' unfused gate / up."""
    g = torch.Generator().manual_seed(11)
    inter, k = 256, 256
    packed = torch.randint(0, 256, (inter, k), generator=g, dtype=torch.uint8)  # gate|up: 2 * inter rows
    scales = (torch.rand(2 * inter, k // 64, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    qweight, scales_t = int4.repack(packed, scales)
    w = int4.k8_dequantized(qweight, scales_t, 64).float()
    wi = int4.k8_dequantized(*int4.interleave_gated(qweight, scales_t), 64).float()
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).float()
    y, yi = (x @ w.t()).to(torch.bfloat16), (x @ wi.t()).to(torch.bfloat16)
    gate, up = int4.deinterleave_gated(yi)
    assert torch.equal(gate, y[:, :inter]) and torch.equal(up, y[:, inter:])
    order = _x_order(inter)
    assert all(int(order[_x_position(i)]) == i for i in range(inter))  # x_position inverts the x order
    scale = (torch.rand(inter, generator=g) + 0.5).to(torch.bfloat16)
    h = torch.zeros(1, inter, dtype=torch.bfloat16)
    for tile in range(2 * inter // 16):  # finish's gated loop, per CTA (n0 = 16 tile) and row
        for row in range(8):
            out = tile * 8 + row
            a = torch.nn.functional.silu(yi[0, 16 * tile + row])
            h[0, _x_position(out)] = (a * yi[0, 16 * tile + 8 + row]) * scale[out]
    assert torch.equal(h, int4.gated_torch(yi, scale, True))
    natural = h[:, torch.argsort(order)]  # input i sits at x_position(i)
    assert torch.equal(natural, (torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]) * scale)


def test_int4_priority_list_records_why_each_kernel_was_refused(tmp_path):
    """The kernel seam on this machine (no GPU): every packed kernel refuses a CPU layer and says why, the torch
    reference takes it; engine.kernels.disabled=[all] refuses them as disabled; the layer built from a checkpoint
    carries the choice, and the engine's plan lists it per shape."""
    from safetensors.torch import save_file

    from quantlab.checkpoint import CheckpointTensors, LayerFormat
    from quantlab.engines.kernels.device import KernelContext
    from quantlab.engines.kernels.int4.linear import PRIORITY
    from quantlab.engines.qlayers import Int4AwqLinear, LayerContext
    from quantlab.engines.torch_engine import kernel_choices

    names = [k.name for k in PRIORITY]
    assert names == ["int4_tma", "int4_mma", "int4_k8", "int4_export", "torch"]
    spec = api.LinearSpec("int4_awq", 64, 256, 64, torch.bfloat16, pqs=True, device="cpu")
    choice = api.choose(spec, KernelContext(), PRIORITY)
    assert choice.kernel.name == "torch" and set(choice.refused) == set(names[:-1])
    assert choice.refused["int4_tma"].startswith("CONFIGS has no bulk-copy entry")
    assert all("CUDA" in choice.refused[n] or "Triton" in choice.refused[n] for n in names[1:-1]), choice.refused
    everything_off = api.choose(spec, KernelContext(frozenset({"all"})), PRIORITY).describe()
    assert everything_off == {"kernel": "torch", "refused": dict.fromkeys(names[:-1],
                                                                          "disabled (engine.kernels.disabled)")}
    assert not PRIORITY[2].can_implement(api.LinearSpec("int4_awq", 40, 256, 64, torch.bfloat16,
                                                        device="cuda"))[0]  # N not in tiles of 16 (or no Triton)
    with pytest.raises(ValueError, match="must end in the torch reference"):
        api.choose(spec, KernelContext(), PRIORITY[:-1])

    g = torch.Generator().manual_seed(0)
    save_file({"l.weight": torch.randint(0, 256, (32, 256), generator=g, dtype=torch.uint8),
               "l.weight_scale": torch.rand(64, 4, generator=g).to(torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    layer = Int4AwqLinear.from_checkpoint("l", 64, 256, False, CheckpointTensors(tmp_path),
                                          LayerFormat("W4A16_AWQ", 64), LayerContext("cpu", False, torch.bfloat16))
    assert layer.choice == choice.describe() and layer.weight is not None and layer.layout == "dense"
    assert kernel_choices(torch.nn.Sequential(layer, torch.nn.Linear(4, 4))) == {"64x256": choice.describe()}
