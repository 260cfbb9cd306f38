"""Any in-memory HF causal LM as an engine: the reference model and ModelOpt's fake-quant models."""
from __future__ import annotations

from quantlab.engines.base import Engine, Limits


class HFModelEngine(Engine):
    def __init__(self, model, limits: Limits, name: str):
        super().__init__(limits, next(model.parameters()).device)
        self.model = model
        self.name = name

    def _logits(self, tokens):
        import torch

        with torch.no_grad():
            return self.model(tokens.to(self.device), use_cache=False).logits.float()

    def close(self) -> None:
        del self.model


def reference(engine_cfg, inputs, limits: Limits) -> HFModelEngine:
    """engine=reference: the unquantized model as its own candidate."""
    return HFModelEngine(inputs.reference_model(), limits, "reference")
