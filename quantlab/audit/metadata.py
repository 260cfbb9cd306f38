"""metadata: with a reference, the model config (every key but the quantization and bookkeeping ones) and the
generation config unchanged."""
from __future__ import annotations

import json

from quantlab.audit.report import ERROR, WARNING
from quantlab.audit.state import AuditState, read_json

BENIGN_CONFIG_KEYS = ("quantization_config", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
                      "use_cache", "output_attentions", "output_hidden_states", "return_dict")
TOKEN_ID_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


def check_metadata(a: AuditState) -> None:
    """With a reference: the model config and the generation config unchanged (the quantization declarations are
    the declarations check's, the tokenizer and chat template the tokenizer check's)."""
    if a.ref is None:
        a.skipped.append("metadata against the reference (no --reference): model config and generation config not "
                         "compared")
        return
    _compare_config(a)
    _compare_generation_config(a)


def _compare_config(a: AuditState) -> None:
    ref_cfg, cfg = a.ref.config, a.config
    changed = [k for k in sorted(set(ref_cfg) | set(cfg)) if k not in BENIGN_CONFIG_KEYS
               and ref_cfg.get(k) != cfg.get(k) and not (k == "architectures" and not ref_cfg.get(k))]
    if changed:
        shown = ", ".join(f"{k}: {json.dumps(ref_cfg.get(k))[:60]} -> {json.dumps(cfg.get(k))[:60]}"
                          for k in changed[:6])
        a.add(ERROR, "metadata", [], f"config.json differs from the reference's in {len(changed)} key(s): "
              f"{shown}",
              "the export was made from another model or another config (a resized context window, a changed "
              "rope scaling or vocabulary), or config.json was edited after export",
              consequence="every engine builds its model from config.json: a model other than the one calibrated "
              "and evaluated (another context length, RoPE, vocabulary or shape), or the load fails on shapes",
              fix="copy the reference's config.json fields back (keep only quantization_config from the export), "
              "or re-export from the intended model")


def _compare_generation_config(a: AuditState) -> None:
    ref_gen = read_json(a.ref.path / "generation_config.json", "generation config")
    gen = read_json(a.ckpt / "generation_config.json", "generation config")
    if ref_gen is None:
        return
    if gen is None:
        a.add(WARNING, "metadata", [], "the reference has a generation_config.json, the export has none",
              "the file was not copied with the export",
              consequence="vLLM and transformers fall back to config.json's eos_token_id and their own sampling "
              "defaults: generation may not stop where the model was tuned to stop",
              fix="copy generation_config.json from the reference beside the export")
        return
    changed = [k for k in sorted(set(ref_gen) | set(gen)) if k != "transformers_version"
               and ref_gen.get(k) != gen.get(k)]
    ids = [k for k in changed if k in TOKEN_ID_KEYS]
    if changed:
        shown = ", ".join(f"{k}: {json.dumps(ref_gen.get(k))} -> {json.dumps(gen.get(k))}" for k in changed[:6])
        a.add(ERROR if ids else WARNING, "metadata", [], f"generation_config.json differs from the "
              f"reference's: {shown}", "the export wrote the generation config of the model object it was "
              "given (an edited or default one)",
              consequence="vLLM and transformers read stop tokens and sampling defaults from it: generations stop "
              "elsewhere (or run to the length limit) and sample differently from the evaluated model",
              fix="copy generation_config.json from the reference beside the export")
