"""metadata: config.json's quantization_config against hf_quant_config.json; with a reference, the model config,
tokenizer, chat template and generation config unchanged."""
from __future__ import annotations

import json
from pathlib import Path

from quantlab.audit.report import ERROR, INFO, WARNING
from quantlab.audit.state import AuditState, read_json
from quantlab.checkpoint import TOKENIZER_FILES
from quantlab.errors import QuantlabError

BENIGN_CONFIG_KEYS = ("quantization_config", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
                      "use_cache", "output_attentions", "output_hidden_states", "return_dict")
TOKEN_ID_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


def check_metadata(a: AuditState) -> None:
    """config.json's quantization_config against hf_quant_config.json; with a reference, the model config, tokenizer,
    chat template and generation config unchanged."""
    q, declared = a.config.get("quantization_config"), a.quant
    if not isinstance(q, dict):
        a.add(ERROR, "metadata", [], "config.json has no quantization_config although hf_quant_config.json "
              f"declares {declared.quant_algo}",
              "config.json was replaced by the unquantized model's (copied over the export, or saved again by "
              "transformers): vLLM / transformers then load the stored codes as plain weights")
    else:
        if q.get("quant_algo") != declared.quant_algo:
            a.add(ERROR, "metadata", [], f"config.json says quant_algo={q.get('quant_algo')}, "
                  f"hf_quant_config.json says {declared.quant_algo}",
                  "one of the two files was edited or comes from another export; loaders read one or the other")
        kv_scheme = q.get("kv_cache_scheme")
        if bool(kv_scheme) != bool(declared.kv_cache_quant_algo):
            a.add(ERROR, "metadata", [], f"config.json {'has' if kv_scheme else 'has no'} kv_cache_scheme, "
                  f"hf_quant_config.json says kv_cache_quant_algo={declared.kv_cache_quant_algo}",
                  "the two files disagree on the KV cache: engines reading config.json run another cache")
        ignore = q.get("ignore")
        if not declared.mixed and isinstance(ignore, list) and sorted(ignore) != sorted(declared.exclude_modules):
            only_cfg = sorted(set(ignore) - set(declared.exclude_modules))
            only_hf = sorted(set(declared.exclude_modules) - set(ignore))
            a.add(ERROR, "metadata", only_cfg + only_hf, "config.json quantization_config.ignore and "
                  "hf_quant_config.json exclude_modules list different modules",
                  "one of the files was edited: engines reading the other quantize (or keep) other modules")
    if a.ref is None:
        a.skipped.append("metadata against the reference (no --reference): model config, tokenizer, chat "
                            "template and generation config not compared")
        return
    _compare_config(a)
    _compare_tokenizer(a)
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
              "rope scaling or vocabulary), or config.json was edited after export: engines build a model "
              "other than the one calibrated")


def _compare_tokenizer(a: AuditState) -> None:
    """Same tokenization as the reference: vocabulary, special tokens and the ids of a sample text (files that
    differ only in bytes, e.g. re-saved by another library version, are an info finding), and chat template."""
    ref_dir = a.ref.path
    files = [n for n in TOKENIZER_FILES if (ref_dir / n).is_file()]
    missing = [n for n in files if not (a.ckpt / n).is_file()]
    differ = [n for n in files if n not in missing and not _same_file(ref_dir / n, a.ckpt / n)]
    if not any((a.ckpt / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        a.add(WARNING, "metadata", [], "the export has no tokenizer (tokenizer.json, tokenizer.model or "
              "vocab.json)", "export_hf_checkpoint() writes no tokenizer: copy the reference's tokenizer files "
              "beside the export (quantlab's export stage does); engines need one")
    else:
        if missing:
            a.add(WARNING, "metadata", [], f"tokenizer file(s) of the reference missing from the export: "
                  f"{', '.join(missing)}", "only part of the tokenizer was copied beside the export")
        if differ or missing:
            changes = _tokenizer_changes(ref_dir, a.ckpt)
            if changes:
                a.add(ERROR, "metadata", [], f"the export's tokenizer differs from the reference's: "
                      f"{'; '.join(changes)}", "the tokenizer was taken from another model or version, or "
                      "edited: token ids in deployment are not the ones calibrated and evaluated")
            elif differ:
                a.add(INFO, "metadata", [], f"tokenizer file(s) {', '.join(differ)} differ in bytes from the "
                      "reference's but tokenize identically (vocabulary, special tokens, sample ids)")
    ref_template, template = _chat_template(ref_dir), _chat_template(a.ckpt)
    if ref_template and not template:
        a.add(ERROR, "metadata", [], "the reference has a chat template, the export has none",
              "chat_template.jinja or tokenizer_config.json's chat_template was not copied with the export: "
              "chat requests are formatted as plain text")
    elif template != ref_template:
        a.add(ERROR, "metadata", [], "the export's chat template differs from the reference's"
              + ("" if ref_template else " (the reference has none)"),
              "the tokenizer files come from another model or version: prompts are formatted differently "
              "from the ones the model was trained and evaluated with")


def _compare_generation_config(a: AuditState) -> None:
    ref_gen = read_json(a.ref.path / "generation_config.json", "generation config")
    gen = read_json(a.ckpt / "generation_config.json", "generation config")
    if ref_gen is None:
        return
    if gen is None:
        a.add(WARNING, "metadata", [], "the reference has a generation_config.json, the export has none",
              "the file was not copied with the export: engines fall back to their default stop tokens")
        return
    changed = [k for k in sorted(set(ref_gen) | set(gen)) if k != "transformers_version"
               and ref_gen.get(k) != gen.get(k)]
    ids = [k for k in changed if k in TOKEN_ID_KEYS]
    if changed:
        shown = ", ".join(f"{k}: {json.dumps(ref_gen.get(k))} -> {json.dumps(gen.get(k))}" for k in changed[:6])
        a.add(ERROR if ids else WARNING, "metadata", [], f"generation_config.json differs from the "
              f"reference's: {shown}", "the export wrote the generation config of the model object it was "
              "given (an edited or default one): stop tokens / sampling defaults change in deployment")


def _same_file(a: Path, b: Path) -> bool:
    if a.read_bytes() == b.read_bytes():
        return True
    if a.suffix == ".json":  # formatting and key order do not matter
        try:
            return json.loads(a.read_text(encoding="utf-8")) == json.loads(b.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return False
    return False


TOKENIZER_SAMPLE = ("The quick brown fox jumps over the lazy dog. def f(x):\n\treturn x ** 2  # 42\n"
                    "Ünïcödé, 数字 123, emoji \U0001F600, trailing spaces   \n\n")


def _tokenizer_changes(ref_dir: Path, ckpt: Path) -> list[str]:
    """How the export's tokenizer tokenizes differently from the reference's (empty: identically)."""
    from quantlab.models import check_tokenizer

    try:
        ours = check_tokenizer(ckpt)
    except QuantlabError as exc:
        return [f"it does not load ({exc.problem})"]
    theirs = check_tokenizer(ref_dir)
    changes = []
    a, b = theirs.get_vocab(), ours.get_vocab()
    if a != b:
        moved = sum(1 for k in a.keys() & b.keys() if a[k] != b[k])
        changes.append(f"vocabulary ({len(a)} -> {len(b)} entries, {moved} with another id, "
                       f"{len(a.keys() ^ b.keys())} added or removed)")
    special = {k: (getattr(theirs, k, None), getattr(ours, k, None)) for k in
               ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    changed = {k: v for k, v in special.items() if v[0] != v[1]}
    if changed:
        changes.append("special tokens (" + ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in changed.items()) + ")")
    sample = TOKENIZER_SAMPLE + "".join(str(t) for t in theirs.all_special_tokens)
    if theirs(sample)["input_ids"] != ours(sample)["input_ids"]:
        changes.append("the ids of a sample text")
    return changes


def _chat_template(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = read_json(directory / "tokenizer_config.json", "tokenizer config") or {}
    template = cfg.get("chat_template")
    return json.dumps(template, sort_keys=True) if isinstance(template, (list, dict)) else template
