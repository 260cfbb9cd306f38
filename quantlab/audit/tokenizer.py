"""tokenizer: the export tokenizes, decodes and formats chats as the reference does. Behaviour, not only the
vocabulary: tokenizer.json's sections (model type, vocabulary, merges, added tokens, normalizer, pre-tokenizer,
decoder, post-processor, truncation / padding) compared one by one, the token-relevant keys of tokenizer_config.json,
and a sample (several scripts, code, runs of whitespace, every special token) encoded and decoded by both; the chat
template. Without a reference: the export's tokenizer loads and decodes what it encodes back to the same text."""
from __future__ import annotations

import json
from pathlib import Path

from quantlab.audit.report import ERROR, INFO, WARNING
from quantlab.audit.state import AuditState, read_json
from quantlab.checkpoint import TOKENIZER_FILES
from quantlab.errors import QuantlabError

# a little of everything tokenizers treat specially: scripts, digits, code with tabs and indentation, runs of
# spaces and newlines, punctuation clusters, an emoji (byte fallback), a zero-width joiner, accents
TOKENIZER_SAMPLE = (
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?\n"
    "def f(x):\n\treturn x ** 2  # 42\n    if x != 0:\n        yield {'k': [1, 2]}\n"
    "Ünïcödé café naïve — déjà vu; Straße; İstanbul; ﬁne\n"
    "数字 123 中文分词；日本語のテキスト、カタカナ。한국어 문장입니다.\n"
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया\n"
    "emoji \U0001F600\U0001F468\u200d\U0001F469\u200d\U0001F467 tab\tsep   three spaces\n\n\n"
    "trailing spaces   \n  leading spaces and a very_long_identifier_name_42 <tag attr=\"v\">&amp;</tag>")
CONFIG_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token",
               "add_prefix_space", "clean_up_tokenization_spaces", "legacy", "do_lower_case", "tokenizer_class",
               "padding_side", "model_max_length", "added_tokens_decoder", "extra_special_tokens",
               "additional_special_tokens")
SETTINGS = ("truncation", "padding")  # tokenizer.json sections that do not change how a text is tokenized
SERVED_AS = ("vLLM / SGLang / TensorRT-LLM tokenize requests and detokenize outputs with the export's tokenizer "
             "files: token ids in deployment are not the ones calibrated and evaluated")
COPY_FIX = ("copy the reference's tokenizer files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, "
            "chat_template.jinja, tokenizer.model / vocab.json / merges.txt) beside the export, byte for byte "
            "(quantlab's export stage does); do not re-save them through another library version")


def check_tokenizer(a: AuditState) -> None:
    """With a reference: same tokenizer sections, config keys, ids and decoded text on a sample, chat template;
    without: the export's tokenizer round-trips the sample."""
    if a.ref is None:
        _round_trip_alone(a)
        return
    ref_dir = a.ref.path
    files = [n for n in TOKENIZER_FILES if (ref_dir / n).is_file()]
    missing = [n for n in files if not (a.ckpt / n).is_file()]
    differ = [n for n in files if n not in missing and not _same_file(ref_dir / n, a.ckpt / n)]
    if not any((a.ckpt / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        a.add(WARNING, "tokenizer", [], "the export has no tokenizer (tokenizer.json, tokenizer.model or "
              "vocab.json)", "export_hf_checkpoint() writes no tokenizer: copy the reference's tokenizer files "
              "beside the export (quantlab's export stage does)",
              consequence="vLLM / TensorRT-LLM refuse to start without --tokenizer pointing elsewhere",
              fix=COPY_FIX)
    else:
        if missing:
            a.add(WARNING, "tokenizer", [], f"tokenizer file(s) of the reference missing from the export: "
                  f"{', '.join(missing)}", "only part of the tokenizer was copied beside the export",
                  consequence="engines fall back to what the remaining files define (default special tokens, "
                  "no chat template)", fix=COPY_FIX)
        if differ or missing:
            _compare(a, ref_dir, differ)
    _compare_chat_template(a, ref_dir)


def _compare(a: AuditState, ref_dir: Path, differ: list[str]) -> None:
    sections = _section_changes(ref_dir, a.ckpt)
    changes = [c for c in sections if c.startswith(SETTINGS)] + _config_changes(ref_dir, a.ckpt)
    behaviour = _behaviour_changes(ref_dir, a.ckpt) + [c for c in sections if not c.startswith(SETTINGS)]
    if behaviour:
        a.add(ERROR, "tokenizer", [], "the export's tokenizer differs from the reference's: "
              + "; ".join((behaviour + changes)[:6]),
              "the tokenizer was taken from another model or version, edited, or re-saved by a library that "
              "rewrote it (dropped merges, another decoder or pre-tokenizer, added tokens lost)",
              consequence=SERVED_AS, fix=COPY_FIX)
    elif changes:
        a.add(WARNING, "tokenizer", [], "the export's tokenizer files differ from the reference's in settings "
              "that do not change the sample's ids: " + "; ".join(changes[:6]),
              "the tokenizer was re-saved by another library version or edited",
              consequence="engines read these settings (special tokens, padding, truncation, length limits): "
              "requests near them are handled differently", fix=COPY_FIX)
    elif differ:
        a.add(INFO, "tokenizer", [], f"tokenizer file(s) {', '.join(differ)} differ in bytes from the reference's "
              "but every section, token setting, the sample's ids and its decoded text are identical")


def _round_trip_alone(a: AuditState) -> None:
    """No reference: the export's tokenizer loads and decodes the sample back to itself (tokenizer.json read by the
    tokenizers library itself, a fraction of a second; other formats through transformers)."""
    if not any((a.ckpt / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        a.skipped.append("tokenizer: the export has no tokenizer files and no --reference to compare with")
        return
    try:
        encode, decode = _codec(a.ckpt)
    except QuantlabError as exc:
        a.add(ERROR, "tokenizer", [], f"the export's tokenizer does not load: {exc.problem}",
              "a damaged or partial tokenizer file", consequence="engines refuse to start, or start with "
              "another tokenizer given by hand", fix=COPY_FIX)
        return
    back = decode(encode(TOKENIZER_SAMPLE))
    if back != TOKENIZER_SAMPLE:
        at = _first_difference(back, TOKENIZER_SAMPLE)
        a.add(WARNING, "tokenizer", [], "the export's tokenizer does not decode what it encodes back to the same "
              f"text (first difference at character {at}: {back[at:at + 24]!r}); without --reference it cannot be "
              "told from a tokenizer that normalizes text", "a decoder or normalizer lost or replaced (byte-level "
              "tokens decode as 'Ġ' characters without the ByteLevel decoder)",
              consequence="served text is detokenized wrongly (stray characters, lost spaces)",
              fix="pass --reference to compare with the original tokenizer; " + COPY_FIX)
    a.skipped.append("tokenizer against the reference (no --reference): only the export's own round trip checked")


def _codec(directory: Path):
    """(encode, decode) of a directory's tokenizer, without special tokens added or skipped."""
    file = directory / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - the Rust library raises its own exception types
            raise QuantlabError(f"{file} does not load: {str(exc)[:200]}",
                                fix="re-save the tokenizer with tokenizer.save_pretrained(dir)") from None
        return (lambda text: tok.encode(text, add_special_tokens=False).ids,
                lambda ids: tok.decode(ids, skip_special_tokens=False))
    from quantlab.models import check_tokenizer as load

    tok = load(directory)
    return (lambda text: tok(text, add_special_tokens=False)["input_ids"],
            lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _first_difference(x: str, y: str) -> int:
    return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))


def _section_changes(ref_dir: Path, ckpt: Path) -> list[str]:
    """tokenizer.json section by section: what differs, named (empty when both lack it or it is identical)."""
    ref, ours = _tokenizer_json(ref_dir), _tokenizer_json(ckpt)
    if ref is None or ours is None:
        return [] if ref is ours else ["tokenizer.json " + ("missing" if ours is None else "added")]
    out = []
    ref_model, our_model = ref.get("model") or {}, ours.get("model") or {}
    if ref_model.get("type") != our_model.get("type"):
        out.append(f"model type {ref_model.get('type')} -> {our_model.get('type')}")
    out += _vocab_change(ref_model.get("vocab"), our_model.get("vocab"))
    out += _merges_change(ref_model.get("merges"), our_model.get("merges"))
    for key in sorted((set(ref_model) | set(our_model)) - {"type", "vocab", "merges"}):
        if ref_model.get(key) != our_model.get(key):
            out.append(f"model {key} {json.dumps(ref_model.get(key))[:40]} -> {json.dumps(our_model.get(key))[:40]}")
    ref_added = {t.get("content"): t for t in ref.get("added_tokens") or []}
    our_added = {t.get("content"): t for t in ours.get("added_tokens") or []}
    lost, new = sorted(set(ref_added) - set(our_added)), sorted(set(our_added) - set(ref_added))
    moved = sorted(k for k in set(ref_added) & set(our_added) if ref_added[k] != our_added[k])
    if lost or new or moved:
        out.append(f"added_tokens ({len(lost)} removed, {len(new)} added, {len(moved)} changed"
                   + (f", e.g. {(lost + new + moved)[0]!r}" if lost or new or moved else "") + ")")
    for key in ("normalizer", "pre_tokenizer", "decoder", "post_processor", "truncation", "padding"):
        if ref.get(key) != ours.get(key):
            out.append(f"{key} {_kind(ref.get(key))} -> {_kind(ours.get(key))}")
    return out


def _kind(section) -> str:
    if section is None:
        return "none"
    if isinstance(section, dict) and "type" in section:
        inner = section.get("decoders") or section.get("normalizers") or section.get("pretokenizers") \
            or section.get("processors")
        return section["type"] + (f"[{', '.join(_kind(s) for s in inner)}]" if isinstance(inner, list) else "")
    return json.dumps(section)[:40]


def _vocab_change(ref, ours) -> list[str]:
    if ref == ours:
        return []
    if not isinstance(ref, dict) or not isinstance(ours, dict):
        return [f"vocab {type(ref).__name__} -> {type(ours).__name__}"]
    moved = sum(1 for k in ref.keys() & ours.keys() if ref[k] != ours[k])
    return [f"vocab ({len(ref)} -> {len(ours)} entries, {moved} with another id, "
            f"{len(ref.keys() ^ ours.keys())} added or removed)"]


def _merges_change(ref, ours) -> list[str]:
    if ref == ours:
        return []
    norm = [[" ".join(m) if isinstance(m, list) else m for m in (x or [])] for x in (ref, ours)]
    if norm[0] == norm[1]:
        return []  # the same merges in the other serialization ("a b" vs ["a", "b"])
    a, b = norm
    gone, extra = [m for m in a if m not in set(b)], [m for m in b if m not in set(a)]
    if not gone and not extra:
        return [f"merges reordered ({len(a)} merges; merge priority changes tokenization)"]
    example = (gone or extra)[0]
    return [f"merges ({len(a)} -> {len(b)}: {len(gone)} removed, {len(extra)} added, e.g. {example!r})"]


def _config_changes(ref_dir: Path, ckpt: Path) -> list[str]:
    ref = read_json(ref_dir / "tokenizer_config.json", "tokenizer config") or {}
    ours = read_json(ckpt / "tokenizer_config.json", "tokenizer config") or {}
    out = []
    for key in CONFIG_KEYS:
        if ref.get(key) != ours.get(key):
            out.append(f"tokenizer_config {key} {json.dumps(ref.get(key))[:40]} -> {json.dumps(ours.get(key))[:40]}")
    return out


def _behaviour_changes(ref_dir: Path, ckpt: Path) -> list[str]:
    """How the export's tokenizer encodes and decodes differently (empty: identically)."""
    from quantlab.models import check_tokenizer as load

    try:
        ours = load(ckpt)
    except QuantlabError as exc:
        return [f"it does not load ({exc.problem})"]
    theirs = load(ref_dir)
    changes = []
    special = {k: (getattr(theirs, k, None), getattr(ours, k, None)) for k in
               ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    changed = {k: v for k, v in special.items() if v[0] != v[1]}
    if changed:
        changes.append("special tokens (" + ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in changed.items()) + ")")
    specials = "".join(str(t) for t in theirs.all_special_tokens)
    for name, text, add in (("the sample", TOKENIZER_SAMPLE + specials, False),
                            ("the sample with special tokens added", TOKENIZER_SAMPLE, True)):
        ids_a = theirs(text, add_special_tokens=add)["input_ids"]
        ids_b = ours(text, add_special_tokens=add)["input_ids"]
        if ids_a != ids_b:
            at = _first_difference(ids_a, ids_b)
            changes.append(f"the ids of {name} ({len(ids_a)} -> {len(ids_b)} tokens, first difference at token "
                           f"{at}: {theirs.convert_ids_to_tokens(ids_a[at:at + 1])} -> "
                           f"{ours.convert_ids_to_tokens(ids_b[at:at + 1])})")
            break
    ids = theirs(TOKENIZER_SAMPLE + specials, add_special_tokens=False)["input_ids"]
    text_a = theirs.decode(ids, skip_special_tokens=False)
    try:
        text_b = ours.decode(ids, skip_special_tokens=False)
    except Exception as exc:  # noqa: BLE001 - ids outside the export's vocabulary
        text_b = f"<decode failed: {type(exc).__name__}>"
    if text_a != text_b:
        at = _first_difference(text_a, text_b)
        changes.append(f"decoded text (the reference's ids decode differently from character {at}: "
                       f"{text_a[at:at + 16]!r} -> {text_b[at:at + 16]!r})")
    return changes


def _compare_chat_template(a: AuditState, ref_dir: Path) -> None:
    ref_template, template = _chat_template(ref_dir), _chat_template(a.ckpt)
    if ref_template and not template:
        a.add(ERROR, "tokenizer", [], "the reference has a chat template, the export has none",
              "chat_template.jinja or tokenizer_config.json's chat_template was not copied with the export",
              consequence="vLLM's chat endpoint refuses requests (no template) or formats them with a default "
              "template: prompts reach the model as plain text", fix=COPY_FIX)
    elif template != ref_template:
        a.add(ERROR, "tokenizer", [], "the export's chat template differs from the reference's"
              + ("" if ref_template else " (the reference has none)"),
              "the tokenizer files come from another model or version",
              consequence="chat requests are formatted differently from the prompts the model was trained and "
              "evaluated with", fix=COPY_FIX)


def _tokenizer_json(directory: Path) -> dict | None:
    return read_json(directory / "tokenizer.json", "tokenizer")


def _same_file(x: Path, y: Path) -> bool:
    if x.read_bytes() == y.read_bytes():
        return True
    if x.suffix == ".json":  # formatting and key order do not matter
        try:
            return json.loads(x.read_text(encoding="utf-8")) == json.loads(y.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return False
    return False


def _chat_template(directory: Path) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = read_json(directory / "tokenizer_config.json", "tokenizer config") or {}
    template = cfg.get("chat_template")
    return json.dumps(template, sort_keys=True) if isinstance(template, (list, dict)) else template
