"""Any in-memory HF causal LM as an engine: the reference model, ModelOpt's fake-quant models and (as a subclass)
the torch engine's model built from the exported checkpoint. The output embedding is swapped for a capture, so a
forward pass yields final hidden states and the head makes logits chunk by chunk (quantlab.engines.head)."""
from __future__ import annotations

import torch
from torch import nn

from quantlab.engines.base import Engine, Limits, Outputs
from quantlab.engines.head import CapturedHead


class HFModelEngine(Engine):
    """An HF causal LM in eval mode; `head` is its real output head (checked once by verify_head)."""

    def __init__(self, model, limits: Limits, name: str, device=None):
        super().__init__(limits, device if device is not None else next(model.parameters()).device)
        self.model = model
        self.name = name
        self.captured = CapturedHead(model)
        self.head = self.captured.head
        self.routers = RouterCapture(model)
        self._verified = False

    def _forward(self, tokens) -> Outputs:
        import torch

        self.routers.taken = []
        with torch.no_grad():
            self.model(tokens.to(self.device), use_cache=False)
        return Outputs(hidden=self.captured.take(), head=self.head, router=self.routers.take(*tokens.shape))

    def head_weights(self) -> tuple:
        """(weight, bias) of the real output module (the reference's head is stored as weights)."""
        module = self.captured.module
        return module.weight, getattr(module, "bias", None)

    def verify_head(self, tokens) -> None:
        """Check once that head(hidden) reproduces the model's own logits."""
        if self._verified:
            return
        hidden = self._forward(tokens).hidden
        with self.captured.original():
            self.head.verify(self.model, tokens.to(self.device), hidden)
        self.routers.taken = []
        self._verified = True

    def close(self) -> None:
        """Release the model."""
        del self.model, self.captured


def reference(_engine_cfg, inputs, limits: Limits) -> HFModelEngine:
    """engine=reference: the unquantized model as its own candidate."""
    return HFModelEngine(inputs.reference_model(), limits, "reference")


class RouterCapture:
    """Forward hooks on MoE routers recording each layer's top-k expert ids, for the router agreement metric."""

    def __init__(self, model: nn.Module):
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        self.taken: list = []
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, _module, _args, output):
        if isinstance(output, tuple) and len(output) >= 3:
            self.taken.append(output[2].detach())

    def take(self, batch: int, length: int):
        """[B, T, layers, k] sorted expert ids of the last forward (None for a dense model)."""
        if not self.taken:
            return None
        ids = torch.stack([i.reshape(batch, length, -1) for i in self.taken], dim=2).sort(-1).values
        self.taken = []
        return ids.int()
