"""W4A16 model passes over the torch engine's packed INT4 layers (qlayers.Int4AwqLinear): every packed layer
rewritten into the k8 layout where its kernels take it (repack_int4), then the layers reading one input fused into
one GEMM over their concatenated codes - q/k/v (SiblingGemm) and gated MLPs (Int4GatedMLP, with the kernel's
SiLU * up epilogue at one row where engine.kernels allows it) - and the attention output's projection given its
pre_quant_scale inside the op. Each output is the value its own layer computes. The kernels are called through
quantlab.engines.kernels.int4.linear (the layers know no op names).
"""
from __future__ import annotations

import torch
from torch import nn

from quantlab.engines.int4_codes import in_x_order
from quantlab.engines.kernels.int4.linear import w4a16
from quantlab.engines.qlayers import Int4AwqLinear


def _cat_packed(layers: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed siblings' codes and scales concatenated along the outputs (both layouts; k8 scales are [K/g, N])."""
    k8 = layers[0].layout == "k8"
    return (torch.cat([m.weight_packed for m in layers]),
            torch.cat([m.weight_scale for m in layers], dim=1 if k8 else 0))


class SiblingGemm:
    """Packed W4A16 siblings reading one input (q/k/v, one pre_quant_scale after export's resmoothing) as one GEMM
    over their concatenated codes and scales: the first sibling called computes every output, the others take
    theirs, matched by input identity as SharedActivation matches. Each output is the same dot product, in the
    same order, as its own layer's GEMM (the kernels tile N, never K, across programs): one launch, wider N,
    identical values (the k8 kernels: where the wider N is given the same configuration - split and mode - as each
    layer's own; another split only reorders the fp32 accumulation). The siblings' codes and scales are views into
    the concatenation (no copy is kept)."""

    def __init__(self, layers: list[Int4AwqLinear]):
        self.packed, self.scales = _cat_packed(layers)
        self.pqs, self.block, self.ordered = layers[0].pre_quant_scale, layers[0].block, layers[0].ordered
        self.bounds, start = [], 0
        k8 = layers[0].layout == "k8"
        for m in layers:
            end = start + m.out_features
            self.bounds.append((start, end))
            m.weight_packed = self.packed[start: end] if k8 else self.packed[start // 2: end // 2]
            m.weight_scale = self.scales[:, start: end] if k8 else self.scales[start: end]
            start = end
        self.count = len(layers)
        self._held = None  # (the input object, the fused output, takers left)

    def output(self, x: torch.Tensor, rows: torch.Tensor, index: int) -> torch.Tensor:
        """Sibling `index`'s output for input x (rows: x as [M, K]): one GEMM for every sibling, held until each
        took its columns."""
        held = self._held
        if held is None or held[0] is not x:
            held = (x, w4a16(rows, self.packed, self.scales, self.pqs, self.block, ordered=self.ordered), self.count)
        left = held[2] - 1
        self._held = None if left == 0 else (held[0], held[1], left)
        lo, hi = self.bounds[index]
        return held[1][:, lo:hi]


class Int4GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with packed W4A16 gate/up as one GEMM over their concatenated codes (the same
    values as the two layers', see SiblingGemm), then the activation and product in the compute dtype as the
    modeling code computes them, then down.

    Where the activation is SiLU and the one-row tensor-core kernel reads x in its input order here (gate.ordered), the
    gate|up rows are interleaved (int4.interleave_gated) and one row runs the kernel's gated epilogue
    (quantlab::w4a16_k8_gated: silu(gate) * up, times down's pre_quant_scale, in down's input order), then down's GEMM
    on that as is; more rows take the plain GEMM's output apart (int4.deinterleave_gated).
    engine.kernels.disabled=[int4_gated_epilogue] keeps the rows and the activation as they are."""

    @property
    def layout(self) -> str:
        """k8 (int32 codes) or export (uint8 codes)."""
        return "k8" if self.weight_packed.dtype == torch.int32 else "export"

    def __init__(self, gate: Int4AwqLinear, up: Int4AwqLinear, down: nn.Module, act_fn):
        super().__init__()
        packed, scales = _cat_packed([gate, up])
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scales)
        self.register_buffer("pre_quant_scale", gate.pre_quant_scale)
        self.block, self.inter, self.ordered = gate.block, gate.out_features, gate.ordered
        self.down, self.act_fn = down, act_fn
        self.kernel = f"{gate.kernel}: gate|up one GEMM, down"
        self.gated = self._gated_epilogue(gate, down)
        if self.gated:
            from quantlab.engines.kernels import int4

            self.weight_packed, self.weight_scale = int4.interleave_gated(self.weight_packed, self.weight_scale)
            self.kernel = f"{gate.kernel}: gate|up one GEMM (one row: SiLU * up in its epilogue), down"

    def _gated_epilogue(self, gate: Int4AwqLinear, down: nn.Module) -> bool:
        """Whether one row takes the gated epilogue: the input-order kernels here (gate.ordered: k8 layout, a 16-bit
        dtype, the tensor-core kernel checked), the switch on, 8-row groups, an activation that computes SiLU (probed:
        its values equal torch's silu over [-20, 20]), and a down projection that is a packed k8 layer reading its input
        as given (no bias, its pre_quant_scale not in its op)."""
        from quantlab.engines.kernels import device

        if not gate.ordered or self.inter % 8 or not device.allowed("int4_gated_epilogue"):
            return False
        if not (isinstance(down, Int4AwqLinear) and down.layout == "k8" and down.bias is None and not down.pqs_in_op
                and down.in_features == self.inter):
            return False
        probe = torch.linspace(-20, 20, 4097, device=self.weight_scale.device).to(self.weight_scale.dtype)
        with torch.no_grad():
            return bool(torch.equal(self.act_fn(probe), nn.functional.silu(probe)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)), gate|up one packed GEMM."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.gated and rows.shape[0] == 1:
            return self._gated_row(rows).to(x.dtype).reshape(*shape[:-1], -1)
        y = w4a16(rows, self.weight_packed, self.weight_scale, self.pre_quant_scale, self.block, ordered=self.ordered)
        y = y.to(x.dtype)
        if self.gated:
            from quantlab.engines.kernels import int4

            gate, up = int4.deinterleave_gated(y)
        else:
            gate, up = y[:, : self.inter], y[:, self.inter:]
        h = self.act_fn(gate) * up
        return self.down(h).reshape(*shape[:-1], -1)

    def _gated_row(self, rows: torch.Tensor) -> torch.Tensor:
        """One row: gate|up with the gated epilogue writing down's input (scaled, in down's input order where it reads
        that), then down's GEMM."""
        down = self.down
        x = rows.to(self.weight_scale.dtype)
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        h = torch.ops.quantlab.w4a16_k8_gated(in_x_order(x), self.weight_packed, self.weight_scale,
                                              down.pre_quant_scale, self.block, down.ordered)
        if down.ordered:
            y = torch.ops.quantlab.w4a16_k8_ordered(h, down.weight_packed, down.weight_scale, down.block)
        else:
            y = torch.ops.quantlab.w4a16_k8(h, down.weight_packed, down.weight_scale, None, down.block)
        return y.float()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def repack_int4(model: nn.Module) -> int:
    """Every packed W4A16 layer rewritten into the k8 layout (Int4AwqLinear.repack); returns how many were."""
    return sum(m.repack() for m in list(model.modules()) if isinstance(m, Int4AwqLinear))


def fuse_int4_siblings(model: nn.Module) -> int:
    """Packed W4A16 layers are first repacked into the k8 layout (repack_int4); then layers reading one input
    become one GEMM: q/k/v (SiblingGemm) and gated MLPs (Int4GatedMLP), where the layers share their layout, group
    size and pre_quant_scale and have no bias; an attention block's output projection (o_proj / out_proj / dense)
    multiplies by its pre_quant_scale inside the op (pqs_in_op). Returns the groups fused."""
    repack_int4(model)
    fused = 0
    for name, module in list(model.named_modules()):
        qkv = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if (all(isinstance(m, Int4AwqLinear) and m.packed_kernel and m.bias is None for m in qkv)
                and len({(m.block, m.layout) for m in qkv}) == 1
                and all(_same(m.pre_quant_scale, qkv[0].pre_quant_scale) for m in qkv)):
            group = SiblingGemm(qkv)
            for i, m in enumerate(qkv):
                m.siblings, m.sibling_index = group, i
            fused += 1
        if any(isinstance(m, Int4AwqLinear) for m in qkv):  # an attention block: its output projection reads the
            for out_name in ("o_proj", "out_proj", "dense"):  # attention op's output (opaque to torch.compile)
                out = getattr(module, out_name, None)
                if isinstance(out, Int4AwqLinear) and out.layout == "k8" and out.pre_quant_scale is not None:
                    out.pqs_in_op = True
        gate, up, down = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        act = getattr(module, "act_fn", None)
        if (all(isinstance(m, Int4AwqLinear) and m.packed_kernel and m.bias is None for m in (gate, up))
                and isinstance(down, nn.Module) and act is not None
                and (gate.block, gate.layout) == (up.block, up.layout)
                and _same(gate.pre_quant_scale, up.pre_quant_scale) and getattr(down, "bias", None) is None):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child,
                    Int4GatedMLP(gate, up, down, act))
            fused += 1
    return fused
