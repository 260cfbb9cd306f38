"""probe: one short forward of the reference model on held-out text (the canary's windows), observed through hooks.

What it records, for the checks that need the reference's activations:
- per quantized Linear with a static input scale, its input as the export's GEMM would see it (times its
  pre_quant_scale, or the scale export folded into the norm that feeds it) quantized with the stored input_scale:
  the SQNR of that, the SQNR with the best static scale for this text (max |x| / qmax), and the ratio of max |x| to
  what the stored scale reaches (activations);
- per attention module with a quantized KV cache, the same for K (after RoPE) and V as they reach the attention
  function, with k_scale / v_scale (ModelOpt's KV quantizers see exactly these tensors);
- which module's output IS which Linear's input (a norm feeding q/k/v, gate/up): the relation a fold of smoothing
  scales into a norm must respect (weights), and the Linears that share one input;
- the reference logits, which the canary compares with the export's (one reference forward per audit).

Modules the forward does not reach as nn.Linear (experts fused into one parameter in memory) are not observed; the
checks say so."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

# norms whose forward multiplies by (1 + weight): export folds a smoothing scale s as w' = (1 + w) s - 1
PLUS_ONE_NORMS = ("LayerNorm1P", "GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


@dataclass
class ProbeResult:
    """What one probe forward of the reference saw."""

    ids: object  # LongTensor [windows, tokens]
    logits: object  # FloatTensor [windows, tokens, vocab] on the CPU
    inputs: dict[str, dict] = field(default_factory=dict)  # Linear (disk name) -> activations.Tally fields
    kv: dict[str, dict] = field(default_factory=dict)  # "<attention>.k_proj" / ".v_proj" -> Tally fields
    seen: set[str] = field(default_factory=set)  # Linears the forward ran
    feeds: dict[str, str] = field(default_factory=dict)  # Linear -> the module whose output is its input
    shared: dict[str, str] = field(default_factory=dict)  # Linear -> the first Linear reading the same input
    seconds: float = 0.0


def run_probe(a, windows: int, tokens: int, inputs: dict, kv: dict) -> ProbeResult:
    """The reference forward on the canary's windows. inputs: Linear -> activations.Static (its format's static
    quantization); kv: attention module -> (k Static, v Static). One model in memory; hooks removed after."""
    import torch

    from quantlab.audit import activations
    from quantlab.audit.canary import canary_ids
    from quantlab.models import load_model

    start = time.time()
    ids = canary_ids(a, windows, tokens)
    model = load_model(a.ref, a.device, a.dtype)
    result = ProbeResult(ids, None)
    modules = dict(model.named_modules())
    outputs: dict[int, tuple[str, object]] = {}  # id(output) -> (producer, the tensor: kept alive for the forward)
    firsts: dict[int, tuple[str, object]] = {}  # id(input) -> (first Linear reading it, the tensor)
    tallies: dict[str, activations.Tally] = {}
    done: dict[tuple, activations.Tally] = {}  # (input, quantization, smoothing) -> its tally: q/k/v share one
    handles = []

    def record_output(name):
        def hook(_module, _args, out):
            if isinstance(out, torch.Tensor):
                outputs[id(out)] = (name, out)
        return hook

    def record_input(name):
        def hook(_module, args):
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                return
            result.seen.add(name)
            producer = outputs.get(id(x))
            if producer is not None and producer[1] is x:
                result.feeds[name] = producer[0]
            first = firsts.setdefault(id(x), (name, x))
            if first[1] is x and first[0] != name:
                result.shared[name] = first[0]
            if name in inputs:
                feeder = result.feeds.get(name)
                _tally(a, x, name, inputs[name], (feeder, modules.get(feeder)), tallies, done)
        return hook

    try:
        for name, module in modules.items():
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Linear) and name in a.layout.linears:
                handles.append(module.register_forward_pre_hook(record_input(name)))
            elif isinstance(weight, torch.Tensor) and weight.dim() == 1 and not list(module.children()):
                handles.append(module.register_forward_hook(record_output(name)))
        names = {id(m): n for n, m in modules.items()}
        kv_tallies: dict[str, activations.Tally] = {}
        with torch.no_grad(), _watch_attention(model, names, kv, kv_tallies):
            result.logits = model(ids.to(a.device.torch), use_cache=False).logits.float().cpu()
    finally:
        for h in handles:
            h.remove()
        outputs.clear()
        firsts.clear()
        done.clear()
        modules.clear()
        del model
    result.inputs = {n: t.row() for n, t in tallies.items()}
    result.kv = {n: t.row() for n, t in kv_tallies.items()}
    result.seconds = round(time.time() - start, 2)
    return result


def _tally(a, x, name: str, spec, feeder: tuple, tallies: dict, done: dict) -> None:
    """Tally one Linear's input quantized as its format does, after its smoothing: its pre_quant_scale, or the
    scale folded into the norm that feeds it (feeder: (name, module) of the module whose output x is, or None)."""
    from quantlab.audit import activations

    smoothing = spec.pre_quant_scale
    how = "pre_quant_scale" if smoothing is not None else None
    if smoothing is None and feeder[0] is not None:
        smoothing = _fold_scale(a, feeder[0], feeder[1])
        how = f"folded into {feeder[0]}" if smoothing is not None else None
    key = (id(x), spec.algo, spec.scale, id(spec.pre_quant_scale), how)
    tally = tallies.setdefault(name, activations.Tally(spec, how))
    if key in done and done[key] is not tally and done[key].signal and not tally.signal:
        tally.merge(done[key])  # the same tensor quantized the same way (q/k/v, gate/up): computed once
    else:
        tally.add(x, smoothing)
        done[key] = tally


def _fold_scale(a, norm: str, module):
    """The smoothing scale export folded into the norm that feeds a Linear: exported weight / reference weight
    ((1 + w') / (1 + w) for norms that multiply by 1 + w), None when the norm is unchanged."""
    import torch

    name = f"{norm}.weight"
    if module is None or name not in a.t or a.t.dtype_of(name) not in ("F32", "F16", "BF16", "F64"):
        return None
    ours, ref = a.t.get(name).float().cpu(), module.weight.detach().float().cpu()
    if ours.shape != ref.shape or torch.equal(ours, ref):
        return None
    if type(module).__name__ in PLUS_ONE_NORMS or getattr(module, "zero_centered_gamma", False):
        ours, ref = 1 + ours, 1 + ref
    safe = ref.abs() > 1e-12
    return torch.where(safe, ours / torch.where(safe, ref, torch.ones_like(ref)), torch.ones_like(ref))


@contextmanager
def _watch_attention(model, names: dict[int, str], specs: dict, tallies: dict):
    """Every attention function call of the forward quantizes K and V (after RoPE, before any repeat for grouped
    heads) with the export's k_scale / v_scale, tallied under "<attention>.k_proj" / ".v_proj": the implementation
    the model runs (sdpa, or its module's eager function) is wrapped for the forward and restored after."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from quantlab.audit import activations

    if not specs:
        yield
        return
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("Attention")}

    def wrap(original):
        def watched(module, query, key, value, *args, **kwargs):
            name = names.get(id(module))
            if name in specs and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor):
                for tensor, proj, spec in ((key, "k_proj", specs[name][0]), (value, "v_proj", specs[name][1])):
                    if spec is not None:
                        tallies.setdefault(f"{name}.{proj}", activations.Tally(spec, None)).add(tensor, None)
            return original(module, query, key, value, *args, **kwargs)
        return watched

    saved_eager = {m: m.eager_attention_forward for m in modules if hasattr(m, "eager_attention_forward")}
    saved_impl = ALL_ATTENTION_FUNCTIONS[impl] if impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS else None
    try:
        for mod, fn in saved_eager.items():
            mod.eager_attention_forward = wrap(fn)
        if saved_impl is not None:
            ALL_ATTENTION_FUNCTIONS[impl] = wrap(saved_impl)
        yield
    finally:
        for mod, fn in saved_eager.items():
            mod.eager_attention_forward = fn
        if saved_impl is not None:
            ALL_ATTENTION_FUNCTIONS[impl] = saved_impl
