"""quantize: mtq.quantize(model, cfg, forward_loop) on the calibration set; save the ModelOpt state.

The saved state is pickle-free: ModelOpt's mode metadata as tagged JSON, and the tensors that calibration
created or changed (quantizer amax / pre_quant_scale buffers, smoothed weights) as safetensors.
`restore` rebuilds the identical fake-quant model from it.
"""
from __future__ import annotations

import inspect
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from quantlab.artifacts import Artifact, ArtifactStore
from quantlab.env import Device, versions
from quantlab.stages.data import TokenSet
from quantlab.stages.prepare import ModelRef, load_model, tensor_index

log = logging.getLogger("quantlab")

STATE_JSON = "modelopt_state.json"
STATE_TENSORS = "quant_state.safetensors"


@dataclass
class QuantizeRequest:
    recipe: dict  # precisions.describe(...)
    modelopt_cfg: dict
    batch_size: int


# ------------------------------------------------------------------------ pickle-free state codec
def encode_state(obj):
    import torch

    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: encode_state(v) for k, v in obj.items()}
        return {"__items__": [[encode_state(k), encode_state(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(x) for x in obj]}
    if isinstance(obj, list):
        return [encode_state(x) for x in obj]
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.Size):
        return {"__size__": list(obj)}
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.detach().cpu().tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in the ModelOpt state")


def decode_state(obj):
    import torch

    if isinstance(obj, list):
        return [decode_state(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__items__" in obj:
        return {decode_state(k): decode_state(v) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(decode_state(x) for x in obj["__tuple__"])
    if "__dtype__" in obj:
        return getattr(torch, obj["__dtype__"])
    if "__size__" in obj:
        return torch.Size(obj["__size__"])
    if "__tensor__" in obj:
        return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
    return {k: decode_state(v) for k, v in obj.items()}


# ---------------------------------------------------------------------------------------- stage
def key(store: ArtifactStore, ref: ModelRef, calib: TokenSet, req: QuantizeRequest, device: Device, dtype) -> str:
    # batch_size is part of it: AWQ's search accumulates its losses per calibration batch
    return store.key("quantize", model=ref.fingerprint, calib=calib.fingerprint, recipe=req.recipe,
                     batch_size=req.batch_size, device=device.type, dtype=str(dtype), versions=versions())


def calibrate(ref: ModelRef, calib: TokenSet, req: QuantizeRequest, device: Device, dtype, device_map=None,
              full_logits: bool = False):
    """Load the reference model and run ModelOpt calibration; returns (model, info)."""
    import modelopt.torch.quantization as mtq
    import torch

    model = load_model(ref, device, dtype, device_map)
    batches = list(torch.split(calib.tokens, req.batch_size))
    counter = {"batches": 0}
    first = model.get_input_embeddings().weight.device

    # Calibration observes the decoder layers only (lm_head is never quantized): skip the logits of every
    # position but the last, which on a 49K vocabulary are ~20% of the forward pass and most of its memory.
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    keep = {"logits_to_keep": 1} if takes_keep and not full_logits else {}

    def forward_loop(m):
        start = time.time()
        with torch.no_grad():
            for i, batch in enumerate(batches, 1):
                m(batch.to(first), use_cache=False, **keep)
                counter["batches"] += 1
                if i == len(batches) or i % max(1, len(batches) // 4) == 0:
                    log.info("  calibration batch %d/%d (%.1f s)", i, len(batches), time.time() - start)

    log.info("quantize: calibrating %s with %d x %d tokens", req.recipe["precision"]["name"], calib.num_windows, calib.seq_len)
    start = time.time()
    mtq.quantize(model, req.modelopt_cfg, forward_loop)
    info = {"calib_forward_batches": counter["batches"], "calib_seconds": round(time.time() - start, 2)}
    log.info("quantize: done in %.1f s (%d forward batches)", info["calib_seconds"], counter["batches"])
    return model, info


def save_state(model, ref: ModelRef, out: Path) -> dict:
    """Write ModelOpt's metadata and every tensor that differs from the checkpoint on disk."""
    import modelopt.torch.opt as mto
    import torch
    from safetensors.torch import save_file

    on_disk = tensor_index(ref.path)
    keep = {}
    for name, tensor in model.state_dict().items():
        if name in on_disk:
            original = on_disk[name].get_tensor(name).to(tensor.device, tensor.dtype)
            if torch.equal(original, tensor):
                continue
        keep[name] = tensor.detach().to("cpu").contiguous().clone()
    save_file(keep, str(out / STATE_TENSORS))
    (out / STATE_JSON).write_text(json.dumps(encode_state(mto.modelopt_state(model))))
    return {"tensors_saved": len(keep)}


def run(store: ArtifactStore, qkey: str, ref: ModelRef, calib: TokenSet, req: QuantizeRequest, device: Device, dtype,
        device_map=None, cost: dict | None = None) -> tuple[Artifact, object | None]:
    """The calibrated-state artifact, and the live model when it was calibrated in this call."""
    live = {}

    def build(out: Path) -> dict:
        model, info = calibrate(ref, calib, req, device, dtype, device_map)
        info.update(save_state(model, ref, out))
        live["model"] = model
        return info

    art = store.get_or_build("quantize", qkey, build, {"recipe": req.recipe, "model": ref.fingerprint,
                                                        "calib": calib.fingerprint, "versions": versions(),
                                                        "device": device.describe()},
                             describe="calibration", cost=cost)
    return art, live.get("model")


def restore(art: Artifact, ref: ModelRef, device: Device, dtype, device_map=None):
    """The fake-quant model exactly as calibration left it, rebuilt from the saved state."""
    import modelopt.torch.opt as mto
    from safetensors.torch import load_file

    model = load_model(ref, device, dtype, device_map)
    state = decode_state(json.loads((art.path / STATE_JSON).read_text()))
    mto.restore_from_modelopt_state(model, state)
    tensors = load_file(str(art.path / STATE_TENSORS), device=str(next(model.parameters()).device))
    missing_unexpected = model.load_state_dict(tensors, strict=False)
    if missing_unexpected.unexpected_keys:
        raise RuntimeError(f"calibrated state does not fit the model: {missing_unexpected.unexpected_keys[:5]}")
    return model.eval()
