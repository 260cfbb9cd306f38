"""The output head, apart from the model: logits = post(lm_head(h)) for a chunk of final hidden states h.

Evaluation never forms a [positions x vocabulary] tensor for a whole window: engines give the final hidden states
(the input of the output embedding) and the head turns a chunk of positions at a time into logits. The reference's
hidden states are what its cache keeps, so its exact full-vocabulary distribution is recomputed at comparison
time (KL over every token, no top-k bound) at the cost of one head GEMM.

The post-processing a family applies after lm_head (Gemma 2/3 final soft-capping, Granite's division by
logits_scaling, Cohere's logit_scale) is read from the config and then verified against the model's own logits
on the first batch: a head that does not reproduce them is refused, never guessed.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from quantlab.errors import QuantlabError


class HiddenCapture(nn.Module):
    """Stands in for the output embedding during a forward: records its input, returns an empty [B, T, 0]."""

    def __init__(self):
        super().__init__()
        self.hidden = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Record the hidden states; return an empty [B, T, 0] in place of logits."""
        self.hidden = h
        return h.new_empty(*h.shape[:-1], 0)


def post_processing(config) -> tuple[str, float] | None:
    """(kind, constant) of what the family does to logits after lm_head, from its config."""
    text = getattr(config, "text_config", None) or config
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        return "softcap", float(cap)
    scaling = getattr(text, "logits_scaling", None)
    if scaling and float(scaling) != 1.0:
        return "divide", float(scaling)
    scale = getattr(text, "logit_scale", None)
    if isinstance(scale, (int, float)) and float(scale) != 1.0:
        return "multiply", float(scale)
    return None


class Head:
    """The output head as a function of the final hidden states: raw logits from the head module itself (a plain
    Linear, or a quantized layer if an export quantized it) or from stored weights, then the family's
    post-processing, applied in the head's own dtype (as the model does) and returned as float32."""

    def __init__(self, raw, post: tuple[str, float] | None, vocab: int, device):
        self.raw, self.post, self.vocab, self.device = raw, post, vocab, device

    @classmethod
    def of(cls, model: nn.Module) -> Head:
        """The head of a model: its output embedding and the family's post-processing (from its config)."""
        module = model.get_output_embeddings()
        weight = getattr(module, "weight", None)
        if module is None or not isinstance(weight, torch.Tensor):
            raise QuantlabError(f"{type(model).__name__} has no output embedding quantlab can read",
                                fix="quantlab evaluates causal LMs with a linear output head")
        vocab = getattr(module, "out_features", None) or weight.shape[0]
        return cls(module, post_processing(model.config), int(vocab), weight.device)

    @classmethod
    def from_weights(cls, weight: torch.Tensor, bias: torch.Tensor | None, post) -> Head:
        """A head from stored weights (the reference's cached head)."""
        def raw(h):
            return nn.functional.linear(h.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))

        return cls(raw, post, int(weight.shape[0]), weight.device)

    @torch.no_grad()
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states h [..., H]: the raw head, then the family's post-processing; float32."""
        logits = self.raw(h.to(self.device))
        if self.post is not None:
            kind, c = self.post
            if kind == "softcap":
                logits = torch.tanh(logits / c) * c
            elif kind == "divide":
                logits = logits / c
            else:
                logits = logits * c
        return logits.float()

    def verify(self, model: nn.Module, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """The head must reproduce the model's own logits from the captured hidden states."""
        with torch.no_grad():
            direct = model(tokens, use_cache=False).logits.float()
            ours = self(hidden)
        scale = float(direct.abs().max().clamp_min(1.0))
        tol = 1e-3 if direct.dtype == torch.float32 and hidden.dtype == torch.float32 else 2e-2
        worst = float((direct - ours.to(direct.device)).abs().max())
        if worst > tol * scale:
            raise QuantlabError(f"{type(model).__name__}: quantlab cannot reproduce this family's logits from its "
                                f"final hidden states (max difference {worst:.3g}; post-processing {self.post})",
                                fix="this model family is not supported yet (see the README's support table)")


class CapturedHead:
    """A model whose output embedding is swapped for a HiddenCapture; `head` computes its logits chunk by chunk,
    `original()` puts the real module back for the duration of a with-block."""

    def __init__(self, model: nn.Module):
        self.head = Head.of(model)
        self.module = model.get_output_embeddings()
        name = next((n for n, m in model.named_modules() if m is self.module), None)
        if not name:
            raise QuantlabError(f"{type(model).__name__}: the output embedding is not a submodule")
        parent, _, self.attr = name.rpartition(".")
        self.parent = model.get_submodule(parent) if parent else model
        self.holder = HiddenCapture()
        setattr(self.parent, self.attr, self.holder)

    def take(self) -> torch.Tensor:
        """The hidden states of the last forward pass (handed out once)."""
        hidden, self.holder.hidden = self.holder.hidden, None
        return hidden

    @contextmanager
    def original(self):
        """Put the real output module back for the duration of a with-block."""
        setattr(self.parent, self.attr, self.module)
        try:
            yield
        finally:
            setattr(self.parent, self.attr, self.holder)
