"""Mixture-of-Experts in the torch engine: the exported experts, each projection by its own QLAYERS format.

transformers 5 holds experts as fused 3-D parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I]) with no module
per expert; ModelOpt exports them per expert under the hub names (Mixtral: block_sparse_moe.experts.e.w1 / w3 / w2;
Qwen3-MoE: mlp.experts.e.gate_proj / up_proj / down_proj). QuantExperts replaces the fused module and runs the same
loop as transformers' eager experts (route, gate/up, activation, down, weight, add) with one quantized layer per
expert projection. The router is not replaced: it runs in high precision from the exported router weight.
"""
from __future__ import annotations

import torch
from torch import nn

from quantlab.checkpoint import CheckpointTensors, QuantConfig
from quantlab.engines.qlayers import QLAYERS, LayerContext, plain_linear
from quantlab.errors import QuantlabError

ROLES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def is_fused_experts(module: nn.Module) -> bool:
    """Whether a module holds experts as fused 3-D parameters (transformers 5's layout)."""
    return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and \
        isinstance(getattr(module, "down_proj", None), torch.Tensor) and getattr(module, "num_experts", None)


class QuantExperts(nn.Module):
    """Experts with per-expert quantized projections:
    forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, gate: list[nn.Module], up: list[nn.Module], down: list[nn.Module], act_fn):
        super().__init__()
        self.gate, self.up, self.down = nn.ModuleList(gate), nn.ModuleList(up), nn.ModuleList(down)
        self.act_fn = act_fn
        self.num_experts = len(gate)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Route each token to its top-k experts and sum their weighted outputs."""
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            if expert >= self.num_experts:
                continue
            token, slot = torch.where(top_k_index == expert)
            x = hidden_states[token]
            h = self.act_fn(self.gate[expert](x)) * self.up[expert](x)
            y = self.down[expert](h) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def _expert_names(t: CheckpointTensors, prefix: str, expert: int) -> dict[str, str]:
    """role -> checkpoint module name of one expert's projections under a disk prefix."""
    found = {}
    for proj, role in ROLES.items():
        name = f"{prefix}.experts.{expert}.{proj}"
        if f"{name}.weight" in t:
            found[role] = name
    return found


def swap_experts(model: nn.Module, t: CheckpointTensors, quant: QuantConfig, device, dtype, where, to_disk) -> int:
    """Replace every fused experts module by QuantExperts built from the exported per-expert tensors; returns how
    many expert projections were loaded. `to_disk` maps in-memory names to checkpoint names (the router's disk
    name gives the block's disk prefix)."""
    loaded = 0
    for name, module in list(model.named_modules()):
        if not is_fused_experts(module):
            continue
        block = name.rpartition(".")[0]
        router = to_disk.get(f"{block}.gate.weight", f"{block}.gate.weight")
        prefix = router.rpartition(".gate.weight")[0]
        hidden, inter = module.down_proj.shape[1], module.down_proj.shape[2]
        target = where(name)
        layers: dict[str, list] = {"gate": [], "up": [], "down": []}
        for e in range(module.num_experts):
            names = _expert_names(t, prefix, e)
            if set(names) != {"gate", "up", "down"}:
                raise QuantlabError(f"exported checkpoint {t.ckpt} lacks expert {e} of {prefix} "
                                    f"(found {sorted(names) or 'nothing'})",
                                    fix="re-export the checkpoint; every expert must be written")
            for role, (out_f, in_f) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                fmt = quant.format_of(names[role])
                if fmt is None or f"{names[role]}.weight_scale" not in t:
                    layers[role].append(plain_linear(t, names[role], out_f, in_f, dtype, target))
                    continue
                ctx = LayerContext(target, device.type == "cuda" and device.has_fp8 and target.startswith("cuda"),
                                   dtype)
                layers[role].append(QLAYERS[fmt.quant_algo].from_checkpoint(names[role], out_f, in_f, False, t, fmt,
                                                                            ctx).to(target))
                loaded += 1
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, QuantExperts(layers["gate"], layers["up"], layers["down"],
                                                                 module.act_fn))
    return loaded
