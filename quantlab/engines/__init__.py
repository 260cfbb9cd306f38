"""Engines: one small interface (logits for token batches) over what can run a model.

- reference: the unquantized HF model (also a sanity candidate: it must pass every gate against itself)
- fakequant: ModelOpt's simulated model, restored from the calibrated state
- torch:     the exported checkpoint executed with deployment numerics (quantlab.engines.torch_engine)
- trtllm:    TensorRT-LLM's LLM API on the exported checkpoint, where tensorrt_llm imports
"""
from quantlab.engines.base import Engine, Limits

__all__ = ["Engine", "Limits"]
