"""engine=trtllm: TensorRT-LLM's LLM API on the exported checkpoint; logits via context logits.

Only where `tensorrt_llm` imports (Linux, CUDA GPU). Elsewhere a clear error before any compute.
Engines of the `tensorrt` backend are saved in the artifact store, keyed by GPU arch x tensorrt_llm version x
model x checkpoint x build config, and loaded on a rerun instead of rebuilt.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from quantlab.checkpoint import read_quant_config
from quantlab.engines.base import Engine, Limits, Outputs
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")
INSTALL_HINT = ("pip install tensorrt_llm on a Linux machine with an NVIDIA GPU (or use NVIDIA's TensorRT-LLM "
                "container); otherwise use engine=torch, which runs the same checkpoint with deployment numerics")
BACKENDS = ("pytorch", "tensorrt")


def check_available() -> None:
    """TensorRT-LLM must import here (exit 2 with install instructions otherwise)."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise QuantlabError("engine=trtllm needs TensorRT-LLM, which is not installed here", fix=INSTALL_HINT)


def check_backend(cfg) -> None:
    """engine.trtllm_backend must be one TensorRT-LLM has."""
    if cfg.trtllm_backend not in BACKENDS:
        raise QuantlabError(f"engine.trtllm_backend={cfg.trtllm_backend!r} is unknown",
                            fix=f"use one of {', '.join(BACKENDS)}")


def llm_kwargs(cfg, checkpoint: Path, limits: Limits, kv_cache_quant_algo: str | None) -> dict:
    """quantlab config (TrtllmEngineConfig) -> keyword arguments of tensorrt_llm.LLM (plain data, testable anywhere)."""
    check_backend(cfg)
    kwargs = {
        "model": str(checkpoint),
        "tokenizer": str(checkpoint),
        "backend": cfg.trtllm_backend,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "max_batch_size": limits.max_batch_size,
        "max_seq_len": limits.max_seq_len,
        "max_num_tokens": limits.max_batch_size * limits.max_input_len,
        # FP8 KV cache as exported; block reuse off, or shared prefixes would return logits for the suffix only
        "kv_cache_config": {"dtype": "fp8" if kv_cache_quant_algo == "FP8" else "auto", "enable_block_reuse": False},
    }
    if cfg.trtllm_backend == "tensorrt":
        kwargs["max_input_len"] = limits.max_input_len
        kwargs["gather_generation_logits"] = False
    return kwargs


class TrtllmEngine(Engine):
    """The exported checkpoint run by TensorRT-LLM's LLM API (logits of prompt positions)."""
    name = "trtllm"

    def __init__(self, llm, limits: Limits):
        super().__init__(limits, "cuda")
        self.llm = llm

    def _forward(self, tokens) -> Outputs:
        import torch
        from tensorrt_llm import SamplingParams

        params = SamplingParams(max_tokens=1, return_context_logits=True)
        outputs = self.llm.generate([row.tolist() for row in tokens], params, use_tqdm=False)
        return Outputs(logits=torch.stack([o.context_logits.float() for o in outputs]).to("cuda"))

    def close(self) -> None:
        """Shut the LLM down (it holds GPU memory and worker processes)."""
        self.llm.shutdown()


def build(cfg, ctx, limits: Limits) -> TrtllmEngine:
    """engine=trtllm: TensorRT-LLM's LLM over the exported checkpoint, with the run's limits and KV cache."""
    check_available()
    import tensorrt_llm
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import KvCacheConfig

    ckpt = ctx.checkpoint()
    kwargs = llm_kwargs(cfg, ckpt.path, limits, read_quant_config(ckpt.path, required=True).kv_cache_quant_algo)
    kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
    if cfg.trtllm_backend != "tensorrt":
        return TrtllmEngine(LLM(**kwargs), limits)
    key = ctx.store.key("engine", engine="trtllm", arch=ctx.device.arch, trtllm=tensorrt_llm.__version__,
                        model=ctx.ref.fingerprint, checkpoint=ckpt.fingerprint,
                        build={k: str(v) for k, v in kwargs.items()})
    stored = ctx.store.load("engine", key)
    if stored is not None:
        log.info("engine: loading the stored TensorRT engine %s", stored.path)
        return TrtllmEngine(LLM(**{**kwargs, "model": str(stored.path / "engine")}), limits)

    def save(out: Path) -> dict:
        llm = LLM(**kwargs)
        llm.save(str(out / "engine"))
        llm.shutdown()
        return {"limits": limits.describe(), "tensorrt_llm": tensorrt_llm.__version__}

    art, _ = ctx.store.get_or_build("engine", key, save, {"checkpoint": ckpt.fingerprint},
                                    describe="TensorRT engine build")
    return TrtllmEngine(LLM(**{**kwargs, "model": str(art.path / "engine")}), limits)
