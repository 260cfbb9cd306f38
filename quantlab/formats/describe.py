"""What a report says about a checkpoint of any format: the tool and scheme, its size on disk, and its bits per weight
(every stored tensor of its quantized Linear layers over the weights they represent)."""
from __future__ import annotations

from quantlab.formats.base import Opened


def linear_shapes(opened: Opened) -> dict[str, tuple[int, int, bool]]:
    """module (checkpoint name) -> (out, in, has bias) of every Linear of the model the checkpoint's config builds,
    on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantlab.families import memory_to_disk

    config = opened.transformers_config() or AutoConfig.from_pretrained(opened.directory)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    to_disk = memory_to_disk(model)
    return {to_disk.get(f"{name}.weight", f"{name}.weight").removesuffix(".weight"):
            (m.out_features, m.in_features, m.bias is not None)
            for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def describe(opened: Opened) -> dict:
    """format, tool, scheme, size_bytes (weight files on disk), bits_per_weight, quantized_layers, quantized_weights,
    and what quantlab read but does not apply (notes)."""
    return {"format": opened.format, "tool": opened.tool, "scheme": opened.scheme, "size_bytes": opened.size_bytes(),
            **opened.weight_bits(linear_shapes(opened)), "notes": list(opened.notes)}
