"""The engine interface, what an engine is built from, and build limits (checked the way a serving gateway
would check a request)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from quantlab.errors import QuantlabError


class EngineInputs(Protocol):
    """What a run hands an engine's build function (quantlab.engines.registry: EngineSpec.build). The run graph
    implements it; an engine calls only what its `runs` needs, and each call builds or loads lazily."""

    ref: Any  # quantlab.models.ModelRef
    device: Any  # quantlab.env.Device
    dtype: Any
    device_map: str | None
    store: Any  # quantlab.artifacts.ArtifactStore

    def checkpoint(self) -> Any:
        """The exported checkpoint (an Artifact: .path, .fingerprint), for engines that run checkpoints."""

    def calibrated_model(self) -> Any:
        """A fresh copy of ModelOpt's calibrated fake-quant model."""

    def reference_model(self) -> Any:
        """A fresh copy of the unquantized model."""


@dataclass(frozen=True)
class Limits:
    max_input_len: int
    max_seq_len: int
    max_batch_size: int

    def check(self, batch: int, length: int, new_tokens: int = 0) -> None:
        if batch > self.max_batch_size:
            raise QuantlabError(f"request batch {batch} is over the engine's max_batch_size={self.max_batch_size}",
                                fix=f"lower eval.batch_size to {self.max_batch_size} or rebuild with a larger engine.max_batch_size")
        if length > self.max_input_len:
            raise QuantlabError(f"request input length {length} is over the engine's max_input_len={self.max_input_len}",
                                fix=f"lower eval.seq_len to {self.max_input_len} or rebuild with a larger engine.max_input_len")
        if length + new_tokens > self.max_seq_len:
            raise QuantlabError(f"request length {length} + {new_tokens} new tokens is over the engine's "
                                f"max_seq_len={self.max_seq_len}", fix="lower eval.seq_len / eval.gen_tokens or raise engine.max_seq_len")

    def describe(self) -> dict:
        return asdict(self)


class Engine:
    """Runs token batches; subclasses implement _logits. Every request passes the limit check first."""

    name = "engine"

    def __init__(self, limits: Limits, device):
        self.limits = limits
        self.device = device
        self.forward_batches = 0

    def logits(self, tokens):
        """tokens [B, T] int64 (any device) -> logits [B, T, V] float32 on the engine's device."""
        self.limits.check(*tokens.shape)
        self.forward_batches += 1
        return self._logits(tokens)

    def _logits(self, tokens):
        raise NotImplementedError

    def greedy(self, prompts, new_tokens: int):
        """Greedy continuation of equal-length prompts [B, P] -> new ids [B, new_tokens].

        Re-runs the full sequence each step: slower than a KV cache, but identical numerics for every engine
        (quantized K/V are written and read on every step)."""
        import torch

        self.limits.check(prompts.shape[0], prompts.shape[1], new_tokens)
        seq = prompts
        for _ in range(new_tokens):
            self.forward_batches += 1
            nxt = self._logits(seq)[:, -1].argmax(-1, keepdim=True).to(seq.device)
            seq = torch.cat([seq, nxt], dim=1)
        return seq[:, prompts.shape[1]:]

    def close(self) -> None:
        pass
