"""Silent-failure audit of an exported checkpoint, in seconds on a CPU, before any evaluation runs on it.

    python -m quantlab.audit CHECKPOINT [--reference MODEL_DIR] [--no-canary] [--json OUT]

    from quantlab.audit import audit
    report = audit("/exports/fp8", reference="/models/llama")   # an AuditReport; report.errors, report.to_dict()

It reads a unified HF checkpoint (hf_quant_config.json + safetensors, as ModelOpt's export_hf_checkpoint writes it)
and, where one is given, the unquantized reference model, and reports findings: severity (error / warning / info),
check, module names, message and likely cause. Exit 0 without an error finding, 1 with one, 2 when the input cannot
be audited at all (no such directory, no hf_quant_config.json, no config.json, a corrupt safetensors header).

The checks, in the order they run (each timed; tensors are streamed one layer at a time, float32 per layer only):

- metadata   config.json's quantization_config agrees with hf_quant_config.json; with a reference: the model config
             (max positions, vocabulary, ...), tokenizer files, chat template and generation config are unchanged.
- coverage   per Linear, the format hf_quant_config.json declares (exclude_modules and per-layer formats honoured)
             against what is stored: 8-bit codes, or plain float weights. Declared but stored plain, or stored
             quantized but declared excluded, is an error; an output head / router / vision module quantized at
             all is a warning. An info finding counts quantized modules per module class.
- scales     every scale tensor (weight_scale, weight_scale_2, input_scale, pre_quant_scale, k_scale, v_scale)
             finite, positive, not underflowed (0 in an FP8 block scale, a float32 subnormal).
- kv_cache   k_scale / v_scale for every attention module when the KV cache is declared FP8, none otherwise,
             and not all exactly 1.0 (a default, not a calibration result).
- format     each quantized layer is built by the QLAYERS class of its declared format, which reads every tensor
             with the dtype and shape that format and its group size imply: a wrong dtype (another format's
             tensors), a scale of the wrong shape, or a missing scale is an error naming the tensor. In mixed-precision
             exports, layers that engines fuse (q/k/v, gate/up, w1/w3) must share format and group size.
- weights    with a reference: per layer, the dequantized weight (QLAYERS' dequantized_weight, times the layer's
             pre_quant_scale, or the scale export folded into the preceding norm, recovered from the norm's change)
             against the reference weight: cosine, SQNR and gain (the factor that best maps it onto the reference;
             halved scales give 2.0), with the bounds its precision states (quantlab.precisions: AuditBounds).
- tensors    every reference tensor (or, without a reference, every tensor config.json implies) is in the export,
             none dropped by a tied-weight dedupe; unquantized tensors keep their shapes and values (norms that
             export changed by folding AWQ scales into them are recognised by the weights check); no unexplained
             extra tensors.
- canary     with a reference: 2 windows x 128 tokens of held-out pydoc text through the exported checkpoint run
             with deployment numerics (engine=torch's load_exported) and through the reference; top-1 agreement and
             mean KL(ref || export) against the bounds its precision states. It catches what tensors alone
             cannot, such as activation scales that saturate.

Bounds were set from healthy exports of every precision (tiny test models and SmolLM2-135M, bench/audit_bench.py)
with a wide margin below the worst healthy value; the damage the audit exists for lands far outside them.
"""
from quantlab.audit.checks import audit, open_checkpoint
from quantlab.audit.report import AUDIT_SCHEMA, AuditReport, Finding, abbreviate

__all__ = ["AUDIT_SCHEMA", "AuditReport", "Finding", "abbreviate", "audit", "open_checkpoint"]
