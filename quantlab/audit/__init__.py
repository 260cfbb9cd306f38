"""Silent-failure audit of an exported checkpoint, in seconds on a CPU, before any evaluation runs on it.

    python -m quantlab.audit CHECKPOINT [--reference MODEL_DIR] [--no-canary] [--json OUT]

    from quantlab.audit import audit
    report = audit("/exports/fp8", reference="/models/llama")   # an AuditReport; report.errors, report.to_dict()

It reads a unified HF checkpoint (hf_quant_config.json + safetensors, as ModelOpt's export_hf_checkpoint writes it)
and, where one is given, the unquantized reference model, and reports findings: severity (error / warning / info),
check, module names, message, likely cause, what a serving engine does with such a checkpoint, and the fix. Exit 0
without an error finding, 1 with one, 2 when the input cannot be audited at all (no such directory, no
hf_quant_config.json, no config.json, a corrupt safetensors header, no safetensors file).

The checks, in the order they run (each timed, wall and CPU; tensors are streamed one layer at a time):

- index        what serving engines load against what is on disk: vLLM / SGLang read the shards
               model.safetensors.index.json names, transformers model.safetensors when it exists. Shards missing, a
               stale index, stray copies, or loaders that would build different models are errors.
- declarations config.json's quantization_config (read by vLLM / SGLang) agrees with hf_quant_config.json (read by
               TensorRT-LLM): quant_method, quant_algo, config_groups' bits / types / group size, kv_cache_scheme,
               ignore vs exclude_modules, per-layer formats.
- metadata     with a reference: the model config and generation config are unchanged.
- tokenizer    with a reference: tokenizer.json section by section (model type, vocabulary, merges, added tokens,
               normalizer, pre-tokenizer, decoder, post-processor), tokenizer_config's token keys, the ids and the
               decoded text of a multilingual / code / whitespace / special-token sample, the chat template;
               without one, the export's tokenizer decodes what it encodes.
- coverage     per Linear, the format hf_quant_config.json declares against what is stored.
- head         a quantized embedding; a tied model's stored output head quantized, or drifted in dtype or value.
- scales       every scale tensor finite, positive, not underflowed.
- kv_cache     k_scale / v_scale for every attention module when the KV cache is declared FP8, not all 1.0.
- probe        with a reference: one forward of the reference on the canary's 2 x 128 held-out tokens, observed by hooks
               (quantlab.audit.probe): each static input / KV scale applied to the activations it quantizes, the
               norm whose output IS each Linear's input, the canary's reference logits.
- format       each quantized layer read by the QLAYERS class of its declared format (dtype, shapes, tensors).
- weights      with a reference: dequantized weight vs reference (cosine, SQNR, gain, and the spread of its
               per-input-channel factors: a smoothing scale lost), folds credited only to the norm that feeds the
               layer.
- activations  with a reference: each static input scale (after smoothing) and KV scale loses at most its format's
               bound of SQNR on held-out text against the best static scale (clipping), and reaches at most its
               bound past the text's max (wasted range: unit errors); layers sharing an input share a scale.
- tensors      every tensor the reference (or config.json) implies is present and unchanged where unquantized.
- canary       with a reference: top-1 agreement and mean KL of the export run with deployment numerics.

Every error and warning says what a serving engine does with the checkpoint (`consequence`) and the `fix`. The
bounds are each precision's (quantlab.precisions: AuditBounds; KV formats: KvFormat.audit), set from the healthy
exports measured by bench/audit_healthy.py; docs/audit.md lists what each check catches, its bounds and its
measured false-alarm rate.
"""
from quantlab.audit.checks import audit, open_checkpoint
from quantlab.audit.report import AUDIT_SCHEMA, AuditReport, Finding, abbreviate

__all__ = ["AUDIT_SCHEMA", "AuditReport", "Finding", "abbreviate", "audit", "open_checkpoint"]
