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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quantlab import costs, progress
from quantlab.artifacts import Artifact, Built
from quantlab.checkpoint import tensor_index
from quantlab.env import Device, versions
from quantlab.models import ModelRef, load_model, quantized_in_dims
from quantlab.precisions import describe, modelopt_config, resolve_block_size
from quantlab.stages.data import TokenSet
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")

STATE_JSON = "modelopt_state.json"
# 2: LayerNorm input quantizers disabled (the export never ships them), fused-expert export adjustments
RECIPE_VERSION = 2
STATE_TENSORS = "quant_state.safetensors"


@dataclass
class QuantizeRequest:
    """What calibration runs: the recipe (precisions.describe, part of the cache key), the ModelOpt config
    (filled in only when building), the calibration batch size and how the block size was chosen."""

    recipe: dict  # precisions.describe(...)
    modelopt_cfg: dict
    batch_size: int
    block_note: str = ""  # how the block size was chosen (auto / explicit / fixed)


# ------------------------------------------------------------------------ pickle-free state codec
def encode_state(obj):
    """ModelOpt state -> JSON-safe data: non-string dict keys, tuples, torch dtypes, Sizes and tensors become
    tagged objects; any other type is a TypeError."""
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
    """Inverse of encode_state: tagged objects back to dicts, tuples, torch dtypes, Sizes and tensors."""
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
def calibrate(ref: ModelRef, calib: TokenSet, req: QuantizeRequest, device: Device, dtype, device_map=None,
              full_logits: bool = False):
    """Load the reference model and run ModelOpt calibration; returns (model, info). Progress is reported per pass,
    batch and decoder layer (quantlab.progress), with an ETA from the passes' measured rates and the cost model."""
    progress.note("importing NVIDIA ModelOpt")
    import modelopt.torch.quantization as mtq
    import torch

    progress.note(f"loading {ref.name}")
    model = load_model(ref, device, dtype, device_map)
    batches = list(torch.split(calib.tokens, req.batch_size))
    counter = {"batches": 0}
    first = model.get_input_embeddings().weight.device

    # Calibration observes the decoder layers only (lm_head is never quantized): skip the logits of every
    # position but the last, which on a 49K vocabulary are ~20% of the forward pass and most of its memory.
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    keep = {"logits_to_keep": 1} if takes_keep and not full_logits else {}
    layers = decoder_layers(model, ref.config)
    passes = costs.calibration_passes(req.modelopt_cfg.get("algorithm"), costs.linear_share(ref.config, calib.seq_len))
    tracker = progress.PassProgress(passes, len(batches), len(layers))

    pass_start = [0.0]

    def forward_loop(m):
        tracker.begin_pass()
        pass_start[0] = time.time()
        with torch.no_grad(), layer_hooks(layers, tracker):
            for i, batch in enumerate(batches, 1):
                tracker.at(i, 0)
                m(batch.to(first), use_cache=False, **keep)
                counter["batches"] += 1
                if i == len(batches) or i % max(1, len(batches) // 4) == 0:
                    log.info("  calibration batch %d/%d of pass %d/%d, %s (%.1f s into the pass)", i, len(batches),
                             tracker.index + 1, len(tracker.passes), tracker.name, time.time() - pass_start[0])
        tracker.end_pass()
        if "experts" in counter:
            counter["experts"].first_pass_done = True

    name = req.recipe["precision"]["name"]
    log.info("quantize: calibrating %s with %d x %d tokens in batches of %d: %s", name, calib.num_windows,
             calib.seq_len, req.batch_size, ", then ".join(p for p, _ in passes) or "no data pass")
    start = time.time()
    with progress.task(f"calibrating {name}", eta=tracker.eta) as task, expert_token_counts(model) as experts:
        tracker.task = task
        counter["experts"] = experts
        mtq.quantize(model, req.modelopt_cfg, forward_loop)
    info = {"calib_forward_batches": counter["batches"], "calib_seconds": round(time.time() - start, 2),
            "calib_passes": [{"pass": n, "passes_a_priori": round(w, 3), "seconds": round(t, 2)}
                             for (n, w), t in zip(tracker.passes, tracker.seconds, strict=False)]}
    if experts:
        info["expert_tokens"] = dict(experts)
        starved = {layer: [e for e, n in enumerate(counts) if n < MIN_EXPERT_TOKENS]
                   for layer, counts in experts.items()}
        starved = {layer: ids for layer, ids in starved.items() if ids}
        info["experts_below_min_tokens"] = starved
        if starved:
            log.warning("quantize: experts that calibration routed fewer than %d tokens to: %s. Their weight scales "
                        "come from their weights and their input scales are shared by all experts of the layer, so "
                        "none ships uncalibrated (README: Mixture-of-Experts)", MIN_EXPERT_TOKENS,
                        "; ".join(f"{layer} {ids}" for layer, ids in starved.items()))
    log.info("quantize: done in %.1f s (%d forward batches)", info["calib_seconds"], counter["batches"])
    return model, info


def decoder_layers(model, config: dict) -> list:
    """The model's decoder layers in order (the ModuleList as long as the config's num_hidden_layers); [] when none
    is found (progress is then per batch)."""
    import torch

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n = text.get("num_hidden_layers") or text.get("n_layer")
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    lists.sort(key=lambda item: (not item[0].endswith("layers"), item[0].count(".")))
    return list(lists[0][1]) if lists else []


@contextmanager
def layer_hooks(layers: list, tracker: progress.PassProgress):
    """Forward pre-hooks that tell the tracker which decoder layer the current batch has reached."""
    def hook(index):
        def pre(_module, _args):
            tracker.at(tracker.batch, index)
        return pre

    handles = [layer.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


MIN_EXPERT_TOKENS = 16  # an expert routed fewer calibration tokens than this is reported


class ExpertCounts(dict):
    """layer name -> tokens routed to each expert; counting stops after the first calibration pass (AWQ makes two)."""

    first_pass_done = False


@contextmanager
def expert_token_counts(model):
    """Tokens routed to each expert of each MoE layer during the first calibration pass."""
    import torch

    routers = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
    counts = ExpertCounts()

    def hook(name, _module):
        def count(mod, _args, output):
            if counts.first_pass_done or not (isinstance(output, tuple) and len(output) >= 3):
                return
            experts = getattr(mod, "num_experts", None) or mod.weight.shape[0]
            add = torch.bincount(output[2].reshape(-1).cpu(), minlength=experts).tolist()
            counts[name] = [a + b for a, b in zip(counts.get(name, [0] * experts), add, strict=True)]
        return count

    handles = [m.register_forward_hook(hook(n, m)) for n, m in routers]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


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


def build(out: Path, ref: ModelRef, calib: TokenSet, req: QuantizeRequest, device: Device, dtype,
          device_map=None) -> Built:
    """Calibrate and save the state; the live model is handed on (the export uses it without a reload)."""
    model, info = calibrate(ref, calib, req, device, dtype, device_map)
    info.update(save_state(model, ref, out))
    info["block_size"], info["block_size_choice"] = req.recipe["block_size"], req.block_note
    return Built(info, model)


class Calibrated:
    """The calibrated state, and the model calibration left in memory if this run calibrated it. take() hands that
    model out once (the export consumes it); fresh() always gives an unused copy (restored when needed)."""

    def __init__(self, art: Artifact, ref: ModelRef, device: Device, dtype, device_map, live=None):
        self.art, self.ref, self.device, self.dtype, self.device_map = art, ref, device, dtype, device_map
        self._live = live

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the calibrated state's artifact."""
        return self.art.fingerprint

    def take(self):
        """The model calibration left in memory, handed out once (the export consumes it); after that a
        restored copy."""
        model, self._live = self._live, None
        return model if model is not None else self.fresh()

    def fresh(self):
        """An unused fake-quant model: the live one if not yet handed out, else restored from the saved state."""
        if self._live is not None:
            return self.take()
        return restore(self.art, self.ref, self.device, self.dtype, self.device_map)


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


# ------------------------------------------------------------------------------------------- the step
def request(r) -> QuantizeRequest:
    """The run's quantization request: recipe (with the block size resolved on this model) and ModelOpt config."""
    ctx: RunContext = r.ctx
    if "quantize_request" not in ctx.memo:
        cfg = ctx.cfg
        ref = r.value("prepare")
        block, how = resolve_block_size(cfg.precision, quantized_in_dims(ref))
        if block and how.startswith("auto"):
            log.info("quantize: block size %d (%s)", block, how)
        ctx.memo["quantize_request"] = QuantizeRequest(describe(cfg.precision, cfg.kv_cache, block), {},
                                                       cfg.calib.batch_size, how)
    return ctx.memo["quantize_request"]


def recipe_label(ctx: RunContext) -> str:
    """The recipe label "<precision>/kv=<kv_cache dtype>" that cost records group build times by."""
    return f"{ctx.precision.name}/kv={ctx.cfg.kv_cache.dtype}"


def step(ctx: RunContext) -> Step:
    """Calibration, keyed by the model and calibration data fingerprints, the recipe (block size resolved on
    the model: exit 2 when none fits), batch size, device type, dtype and versions. Its value is a Calibrated."""
    cfg = ctx.cfg

    def key_of(r) -> str:
        req = request(r)
        # batch_size is part of it: AWQ's search accumulates its losses per calibration batch
        return ctx.store.key("quantize", model=r.fingerprint("prepare"), calib=r.fingerprint("data:calib"),
                             recipe=req.recipe, batch_size=req.batch_size, device=ctx.device.type,
                             dtype=str(ctx.dtype), versions=versions(), recipe_version=RECIPE_VERSION)

    def build_step(out: Path, r) -> Built:
        req = request(r)
        req.modelopt_cfg = modelopt_config(cfg.precision, cfg.kv_cache, req.recipe["block_size"])
        return build(out, r.value("prepare"), r.value("data:calib"), req, ctx.device, ctx.dtype, cfg.model.device_map)

    def load(art: Artifact, r, built: Built | None) -> Calibrated:
        return Calibrated(art, r.value("prepare"), ctx.device, ctx.dtype, cfg.model.device_map,
                          built.value if built else None)

    def work(r) -> dict:
        from quantlab import first_run, prior

        shape, params, config = first_run.model(r)
        tokens = first_run.calib_tokens(r)
        passes = costs.precision_passes(ctx.precision.name, config, cfg.calib.seq_len)
        tried = costs.searches(ctx.precision.name, tokens, cfg.calib.seq_len, cfg.calib.batch_size)
        return costs.work(costs.device_label(ctx.device), recipe_label(ctx), params, tokens, passes=passes,
                          units=shape and prior.calibration(shape, tokens, cfg.calib.seq_len, cfg.calib.batch_size,
                                                            passes, tried))

    def manifest(r) -> dict:
        return {"recipe": request(r).recipe, "model": r.fingerprint("prepare"), "calib": r.fingerprint("data:calib"),
                "versions": versions(), "device": ctx.device.describe()}

    return Step("quantize", "quantize", key_of, load, build_step, needs=("prepare", "data:calib"), work=work,
                manifest=manifest, describe="calibration")
