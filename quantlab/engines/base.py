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
    """An engine's build limits: the longest input, the longest sequence (input + new tokens) and the largest
    batch a request may have."""

    max_input_len: int
    max_seq_len: int
    max_batch_size: int

    def check(self, batch: int, length: int, new_tokens: int = 0) -> None:
        """Refuse a request over the limits: batch > max_batch_size, length > max_input_len or
        length + new_tokens > max_seq_len is a QuantlabError (exit 2) naming the knob to change."""
        if batch > self.max_batch_size:
            raise QuantlabError(f"request batch {batch} is over the engine's max_batch_size={self.max_batch_size}",
                                fix=f"lower eval.batch_size to {self.max_batch_size} "
                                    "or rebuild with a larger engine.max_batch_size")
        if length > self.max_input_len:
            raise QuantlabError(f"request input length {length} is over the engine's "
                                f"max_input_len={self.max_input_len}",
                                fix=f"lower eval.seq_len to {self.max_input_len} "
                                    "or rebuild with a larger engine.max_input_len")
        if length + new_tokens > self.max_seq_len:
            raise QuantlabError(f"request length {length} + {new_tokens} new tokens is over the engine's "
                                f"max_seq_len={self.max_seq_len}",
                                fix="lower eval.seq_len / eval.gen_tokens or raise engine.max_seq_len")

    def describe(self) -> dict:
        """The limits as a dict (in engine build records and candidate cache keys)."""
        return asdict(self)


class Outputs:
    """One forward pass: final hidden states and the head that turns any range of positions into float32 logits,
    or (engines that only give logits) the logits themselves, or (engines behind an API: quantlab.engines.served)
    sparse log-probabilities: the target token's and the top k per predicted position, no logits at all. Nothing
    of size [positions x vocabulary] is made for more positions than asked for."""

    def __init__(self, hidden=None, head=None, logits=None, router=None, sparse=None):
        self.hidden, self.head, self._logits = hidden, head, logits
        self.router = router  # [B, T, MoE layers, k] sorted expert ids (None: a dense model)
        self.sparse = sparse  # quantlab.engines.served.SparseLogprobs (None: the engine gives logits)

    @property
    def length(self) -> int:
        """Positions T of the pass (from the hidden states, else the logits, else the sparse log-probs)."""
        if self.sparse is not None:
            return int(self.sparse.target.shape[1]) + 1
        return int((self.hidden if self.hidden is not None else self._logits).shape[1])

    def logits(self, lo: int, hi: int):
        """Float32 logits [B, hi - lo, V] of positions lo..hi-1."""
        if self._logits is not None:
            return self._logits[:, lo:hi].float()
        return self.head(self.hidden[:, lo:hi])


class Engine:
    """Runs token batches; subclasses implement _forward. Every request passes the limit check first."""

    name = "engine"

    def __init__(self, limits: Limits, device):
        self.limits = limits
        self.device = device
        self.forward_batches = 0

    def forward(self, tokens) -> Outputs:
        """tokens [B, T] int64 (any device) -> Outputs on the engine's device."""
        self.limits.check(*tokens.shape)
        self.forward_batches += 1
        return self._forward(tokens)

    def logits(self, tokens):
        """tokens [B, T] -> float32 logits [B, T, V] (small inputs only: tests and short prompts)."""
        out = self.forward(tokens)
        return out.logits(0, out.length)

    def _forward(self, tokens) -> Outputs:
        raise NotImplementedError

    def greedy(self, prompts, new_tokens: int):
        """Greedy continuation of equal-length prompts [B, P] -> new ids [B, new_tokens].

        Re-runs the full sequence each step: slower than a KV cache, but identical numerics for every engine
        (quantized K/V are written and read on every step). Engines over HF models (HFModelEngine, the torch engine
        included) decode with a static KV cache instead (quantlab.engines.decode), to the same ids; this stays
        their fallback and the reference their tests compare with."""
        import torch

        self.limits.check(prompts.shape[0], prompts.shape[1], new_tokens)
        seq = prompts
        for _ in range(new_tokens):
            self.forward_batches += 1
            out = self._forward(seq)
            nxt = out.logits(out.length - 1, out.length)[:, -1].argmax(-1, keepdim=True).to(seq.device)
            seq = torch.cat([seq, nxt], dim=1)
        return seq[:, prompts.shape[1]:]

    def close(self) -> None:
        """Release the model (engines hold GPU memory)."""
