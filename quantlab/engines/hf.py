"""Any in-memory HF causal LM as an engine: the reference model, ModelOpt's fake-quant models and (as a subclass)
the torch engine's model built from the exported checkpoint. The output embedding is swapped for a capture, so a
forward pass yields final hidden states and the head makes logits chunk by chunk (quantlab.engines.head)."""
from __future__ import annotations

import logging

import torch
from torch import nn

from quantlab.engines.base import Engine, Limits, Outputs
from quantlab.engines.head import CapturedHead

log = logging.getLogger("quantlab")


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
        self.decode_capture: bool | None = None  # CUDA graphs for decode steps: None = wherever they apply
        self.decode_compile = False  # compile the decoder layers first (worth it for long generations only)
        self.decode_info: dict | None = None  # what the last greedy ran (quantlab.engines.decode)

    def _forward(self, tokens) -> Outputs:
        import torch

        self.routers.taken = []
        with torch.no_grad():
            self.model(tokens.to(self.device), use_cache=False)
        return Outputs(hidden=self.captured.take(), head=self.head, router=self.routers.take(*tokens.shape))

    def greedy(self, prompts, new_tokens: int):
        """Greedy continuation with a static KV cache: one prefill, then one token per step, captured in a CUDA
        graph on GPUs (quantlab.engines.decode); the same ids as re-running the full sequence every step (the
        base class's greedy, used when a model cannot take the cache)."""
        from quantlab.engines import decode

        self.limits.check(prompts.shape[0], prompts.shape[1], new_tokens)
        self.routers.taken = []
        try:
            ids, self.decode_info = decode.greedy(self.model, self.head, self.captured.take, prompts, new_tokens,
                                                  capture=self.decode_capture, compile=self.decode_compile)
        except decode.Unsupported as why:
            log.info("greedy: %s; re-running the full sequence each step", why)
            self.decode_info = {"cached": False, "why": str(why)}
            return super().greedy(prompts, new_tokens)
        except Exception as exc:  # noqa: BLE001 - a modeling file the cached path does not fit: same ids, slower
            log.warning("greedy: the cached decode failed (%s: %s); re-running the full sequence each step",
                        type(exc).__name__, str(exc)[:300])
            self.decode_info = {"cached": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            return super().greedy(prompts, new_tokens)
        finally:
            self.routers.taken = []
        self.forward_batches += new_tokens
        return ids.to(prompts.device)

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
