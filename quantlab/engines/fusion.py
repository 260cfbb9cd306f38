"""Graph rewrites of the compiled decoder layers (inductor's post-grad graph, before code generation).

ResidualAdd: a one-row INT4 projection (quantlab::w4a16_k8_ordered) whose output reaches an add with another tensor
only through views and exact round trips of its dtype (bf16 -> fp32 -> bf16), and feeds nothing else, becomes
quantlab::w4a16_k8_ordered_add: the kernel adds the other operand as it writes (the same two roundings as the add in
the compute dtype), so the add's own kernel goes. In a decoder layer that is the MLP's down projection and the residual
add the layer ends with (a graph output: nothing fuses it otherwise); the attention output's add feeds the next norm,
which inductor already fuses with it, and is left alone. engine.kernels.disabled=[int4_residual_epilogue] turns
the rewrite off.
"""
from __future__ import annotations

import torch

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
except ImportError:  # an inductor without custom passes: the rewrite is not offered (decode checks `available`)
    CustomGraphPass, get_hash_for_files = object, None

_VIEWS = ("view.default", "reshape.default", "_unsafe_view.default")


def _is(node: torch.fx.Node, namespace: str, names: tuple[str, ...]) -> bool:
    """Whether node calls one of the operator overloads `names` ("add.Tensor") of `namespace`."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == namespace and target.__name__ in names)


def _dtype(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _conversion(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype a node converts its input to where that is all it does (prims.convert_element_type, or
    aten._to_copy with a dtype alone), else None."""
    if _is(node, "prims", ("convert_element_type.default",)):
        return node.args[1]
    if _is(node, "aten", ("_to_copy.default",)) and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def _source(node: torch.fx.Node, dtype: torch.dtype) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """The projection behind an add operand and the chain of nodes between them (each used once), or None. The chain
    holds views and dtype conversions to float32 or back to `dtype` (the add's): from a 16-bit dtype a conversion to
    float32 and back is exact, so the operand's values are the projection's."""
    chain = []
    while True:
        if len(node.users) != 1:
            return None
        if _is(node, "quantlab", ("w4a16_k8_ordered.default",)):
            return (node, chain) if _dtype(node) == dtype else None
        if _is(node, "aten", _VIEWS) or _conversion(node) in (torch.float32, dtype):
            chain.append(node)
            node = node.args[0]
            if not isinstance(node, torch.fx.Node):
                return None
            continue
        return None


def fuse_residual_adds(graph: torch.fx.Graph) -> int:
    """Rewrite every add of a one-row INT4 projection's output and another tensor of the same shape and 16-bit dtype
    into the projection with the residual epilogue; returns how many were."""
    fused = 0
    for add in list(graph.nodes):
        if not _is(add, "aten", ("add.Tensor",)) or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
            continue
        dtype = _dtype(add)
        if dtype not in (torch.bfloat16, torch.float16):
            continue
        for mine, other in ((add.args[0], add.args[1]), (add.args[1], add.args[0])):
            if not isinstance(mine, torch.fx.Node) or not isinstance(other, torch.fx.Node):
                continue
            found = _source(mine, dtype)
            shape = add.meta["val"].shape
            if found is None or _dtype(other) != dtype or other.meta["val"].shape != shape:
                continue
            proj, chain = found
            if other is proj or other in chain:  # the projection added to itself: no residual to take
                continue
            if shape[-1] != proj.meta["val"].shape[-1] or add.meta["val"].numel() != proj.meta["val"].numel():
                continue
            with graph.inserting_before(add):
                new = graph.call_function(torch.ops.quantlab.w4a16_k8_ordered_add.default, (*proj.args, other))
            new.meta.update(add.meta)
            add.replace_all_uses_with(new)
            graph.erase_node(add)
            for node in chain:  # from the add back to the projection: each one's single user is gone
                graph.erase_node(node)
            graph.erase_node(proj)
            fused += 1
            break
    return fused


class ResidualAdd(CustomGraphPass):
    """fuse_residual_adds as inductor's post-grad custom pass (its uuid: this file's hash, for inductor's cache)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        """Rewrite the graph in place (STATS counts the graphs seen and the adds fused in this process; a graph
        inductor finds in its cache is not seen)."""
        STATS["graphs"] += 1
        STATS["fused"] += fuse_residual_adds(graph)

    def uuid(self):
        """This file's hash (a changed rewrite invalidates inductor's cached graphs)."""
        return get_hash_for_files((__file__,)) if get_hash_for_files else None


STATS = {"graphs": 0, "fused": 0}
available = get_hash_for_files is not None
RESIDUAL_ADD = ResidualAdd() if available else None
