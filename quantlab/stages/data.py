r"""data: calibration and evaluation token windows from a recipe, read and tokenized only as far as they are needed.

Sources, first match wins: `path` (a local file: plain text, JSON Lines, a JSON array of records, CSV / TSV or
Parquet, recognized by suffix, case-insensitively, or set with `format`), `dataset` (HF datasets, where available
locally), else the documentation text Python ships (pydoc_data.topics of Python 3.11.7, packaged with quantlab),
cut into groups of topics that share text, each group calibration or evaluation text (quantlab/stages/pydoc_text.py).

Documents are joined with "\n\n" and tokenized as one text, in chunks of about a million characters cut at
whitespace (the tokenizer's leading special tokens once, at the start), and cut into non-overlapping windows of
seq_len tokens (the tail is dropped). Reading stops as soon as the pool exists: calibration draws num_samples windows
at random (seeded) from the first pool_windows windows; evaluation keeps max_windows windows of its first
pool_windows, in the look order below. So a multi-GB corpus costs memory for the pool, not for the file. With
prefix_token=eos|bos each window is that token followed by seq_len - 1 text tokens; prefix_token=auto (the default)
is what the model expects (quantlab.conventions: its tokenizer, chat template or family), resolved before the key.

Documents (evaluation). Records (JSON Lines, JSON array, CSV / TSV, Parquet, dataset rows) and pydoc topics are
documents; plain text is cut at blank lines; with doc_separator a line of plain text (or a record's whole text) that
fully matches the regular expression starts a new document (WikiText: its ' = Title = ' article headings). A window
belongs to the document that holds most of its text tokens (windows straddle documents; ties go to the earlier
one); the document of a token is found from the tokenizer's character offsets, so the tokens are exactly those of
the joined text. The look order: window k of the order comes from the document furthest below its quota k n_d / N
(ties by a seeded document order; each document's windows in a seeded random order), so every prefix holds each
document's windows in proportion to its size, within one: an early look is a small version of the whole pool
(proportional stratified sampling), and the cap keeps the first max_windows of that order.
"""
from __future__ import annotations

import codecs
import csv
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from quantlab import costs
from quantlab.artifacts import ArtifactStore
from quantlab.config import DataConfig
from quantlab.errors import QuantlabError
from quantlab.stages.pydoc_text import _pydoc_docs, _pydoc_names, pydoc_topics
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")

CHUNK_CHARS = 1 << 20  # characters tokenized at a time
READ_BYTES = 1 << 20
FORMATS = {"text": (".txt", ".text", ".raw", ".md", ".rst"), "jsonl": (".jsonl", ".ndjson"), "json": (".json",),
           "csv": (".csv",), "tsv": (".tsv",), "parquet": (".parquet",)}
MAX_JSON_ARRAY = 512 << 20  # a JSON array is parsed whole: beyond this, JSON Lines is required


@dataclass(frozen=True)
class Role:
    """What a token set is for: calibration windows are drawn at random (seeded) from a pool of the first windows,
    evaluation windows are the first ones in order. `name` is also the config section (calib / eval) and the pydoc
    part."""

    name: str
    default_split: str
    sampled: bool

    def count(self, cfg: DataConfig) -> int | None:
        """Windows requested: calib.num_samples, or eval.max_windows (None: all)."""
        return cfg.num_samples if self.sampled else cfg.max_windows

    def needed(self, cfg: DataConfig) -> int | None:
        """Windows the text must give before reading can stop (None: read to the end)."""
        if self.sampled:
            return max(cfg.pool_windows, cfg.num_samples)
        if cfg.pool_windows is None or cfg.max_windows is None:
            return None
        return max(cfg.pool_windows, cfg.max_windows)


CALIB = Role("calib", "train", sampled=True)
EVAL = Role("eval", "test", sampled=False)


@dataclass
class TokenSet:
    """Token windows of one role: tokens [n_windows, seq_len] int64, the artifact's fingerprint and its build
    info (source, windows, characters read). Evaluation sets also hold, per window in the stored (look) order, its
    document (`docs`, numbered in text order) and its index among the text's windows (`positions`); the documents'
    labels are info["documents"]["labels"] (document number as a string -> label)."""

    role: str  # calib | eval
    fingerprint: str
    tokens: object  # torch.LongTensor [n_windows, seq_len]
    info: dict
    docs: object = None  # numpy int64 [n_windows] (evaluation)
    positions: object = None  # numpy int64 [n_windows] (evaluation)
    prefix: object = None  # quantlab.conventions.Prefix the windows were built with (set by the run graph)

    def doc_label(self, doc: int) -> str:
        """A document's short label (pydoc topic, record number, first heading or line)."""
        return (self.info.get("documents") or {}).get("labels", {}).get(str(int(doc)), f"document {int(doc)}")

    @property
    def num_windows(self) -> int:
        """Windows in the set."""
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """Tokens per window."""
        return int(self.tokens.shape[1])


# --------------------------------------------------------------------------------------------- sources
def file_format(cfg: DataConfig, knob: str) -> str:
    """The format of a data file: `format` if set, else from the suffix (case-insensitive); unknown is refused."""
    path = Path(cfg.path).expanduser()
    if cfg.format != "auto":
        if cfg.format not in FORMATS:
            raise QuantlabError(f"{knob}.format={cfg.format!r} is not a format quantlab reads",
                                fix=f"use one of auto, {', '.join(FORMATS)}")
        return cfg.format
    suffix = path.suffix.lower()
    for name, suffixes in FORMATS.items():
        if suffix in suffixes:
            return name
    known = ", ".join(s for group in FORMATS.values() for s in group)
    raise QuantlabError(f"{knob}.path {path.name}: quantlab does not know the file type {suffix or '(no suffix)'!r}",
                        fix=f"use a file ending in one of {known}, or say what it is with {knob}.format="
                            f"{'|'.join(FORMATS)}")


def _check_file(path: Path, knob: str) -> None:
    if not path.is_file():
        raise QuantlabError(f"{knob}.path {path} does not exist or is not a file",
                            fix=f"point {knob}.path at a text, JSON Lines, JSON, CSV or Parquet file")
    with open(path, "rb") as f:
        head = f.read(65536)
    if not head.strip():
        raise QuantlabError(f"{knob}.path {path} is empty", fix="give a file with text in it")
    if b"\x00" in head and path.suffix.lower() != ".parquet":
        raise QuantlabError(f"{knob}.path {path} looks binary (NUL bytes), not text",
                            fix="give a UTF-8 text, JSON Lines or CSV file (or .parquet)")


def _utf8_chunks(path: Path, knob: str) -> Iterator[str]:
    """The file decoded as UTF-8, a megabyte at a time; a bad byte is reported with its offset."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")  # a leading byte-order mark is not text
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(READ_BYTES)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                at = offset + exc.start
                raise QuantlabError(f"{knob}.path {path} is not UTF-8 (byte {at}: {raw[exc.start:exc.start + 4]!r})",
                                    fix=f"convert it, e.g. iconv -f latin1 -t utf-8 {path.name} > "
                                        f"{path.stem}.utf8{path.suffix}") from None
            offset += len(raw)
            if text:
                yield text
            if not raw:
                return


def _lines(path: Path, knob: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file, streamed (a line of any length is held once, never the file)."""
    pending, number = "", 0
    for chunk in _utf8_chunks(path, knob):
        parts = (pending + chunk).split("\n")
        pending = parts.pop()
        for line in parts:
            number += 1
            yield number, line
    if pending:
        yield number + 1, pending


def _refuse_records_named_as_text(path: Path, knob: str) -> None:
    """A text suffix on a file of records (JSON Lines, a JSON array) would turn their JSON syntax into calibration or
    evaluation text: the first non-blank line is read, and a JSON object or array there is refused with the fix."""
    with open(path, "rb") as f:
        head = f.read(1 << 16).removeprefix(codecs.BOM_UTF8)
    line = next((x.strip() for x in head.split(b"\n") if x.strip()), b"")
    if line[:1] not in (b"{", b"["):
        return
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        if line[:1] != b"[":
            return
        obj = []  # a JSON array spread over lines
    if isinstance(obj, dict) or line[:1] == b"[":
        kind = "JSON Lines" if isinstance(obj, dict) else "a JSON array"
        fields = f" (fields {sorted(obj)[:6]})" if isinstance(obj, dict) else ""
        fmt = "jsonl" if isinstance(obj, dict) else "json"
        raise QuantlabError(f"{knob}.path {path.name} has a text suffix but holds {kind}{fields}: read as text, its "
                            "JSON syntax would become the text", fix=f"set {knob}.format={fmt} (and "
                            f"{knob}.text_field), or {knob}.format=text if it really is plain text")


def _record_text(obj, where: str, cfg: DataConfig, knob: str) -> str:
    if not isinstance(obj, dict) or not isinstance(obj.get(cfg.text_field), str):
        fields = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise QuantlabError(f"{where} has no string field {cfg.text_field!r} (it has {fields})",
                            fix=f"set {knob}.text_field to the field that holds the text")
    return obj[cfg.text_field]


def _jsonl_docs(path: Path, cfg: DataConfig, knob: str) -> Iterator[tuple[str, str]]:
    for number, line in _lines(path, knob):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            msg = getattr(exc, "msg", "nesting too deep")
            raise QuantlabError(f"{path} line {number} is not JSON ({msg})", fix="one JSON object per line") from None
        yield _record_text(obj, f"{path} line {number}", cfg, knob), f"line {number}"


def _json_docs(path: Path, cfg: DataConfig, knob: str) -> Iterator[tuple[str, str]]:
    """A .json file: JSON Lines (what datasets' to_json writes) or one JSON array of records."""
    with open(path, "rb") as f:
        first = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()[:1]
    if first == b"{":
        yield from _jsonl_docs(path, cfg, knob)
        return
    if first != b"[":
        raise QuantlabError(f"{knob}.path {path} is neither JSON Lines nor a JSON array of records",
                            fix=f"write one JSON object per line, or set {knob}.format=text if it is plain text")
    if path.stat().st_size > MAX_JSON_ARRAY:
        raise QuantlabError(f"{knob}.path {path} is a JSON array of {path.stat().st_size >> 20} MiB, which would be "
                            "read whole",
                            fix="convert it to JSON Lines (one object per line), which is read as a stream")
    try:
        records = json.loads("".join(_utf8_chunks(path, knob)))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise QuantlabError(f"{path} is not valid JSON ({getattr(exc, 'msg', 'nesting too deep')})",
                            fix="check the file") from None
    if not isinstance(records, list):
        raise QuantlabError(f"{path} is JSON but not an array of records", fix="give a list of objects or JSON Lines")
    for i, obj in enumerate(records):
        yield _record_text(obj, f"{path} record {i}", cfg, knob), f"record {i}"


def _csv_docs(path: Path, cfg: DataConfig, knob: str, delimiter: str) -> Iterator[tuple[str, str]]:
    csv.field_size_limit(1 << 30)
    rows = csv.reader((line + "\n" for _, line in _lines(path, knob)), delimiter=delimiter)
    header = next(rows, None)
    if not header or cfg.text_field not in header:
        raise QuantlabError(f"{path} has no column {cfg.text_field!r} (columns: {header})",
                            fix=f"set {knob}.text_field to the column that holds the text")
    column = header.index(cfg.text_field)
    for number, row in enumerate(rows, 1):
        if len(row) > column and row[column]:
            yield row[column], f"row {number}"


def _parquet_docs(path: Path, cfg: DataConfig, knob: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise QuantlabError(f"{knob}.path {path.name} is Parquet, which needs pyarrow",
                            fix="pip install pyarrow (it comes with `datasets`), "
                                "or convert the file to JSON Lines") from None
    try:
        handle = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises many types for a damaged file
        raise QuantlabError(f"{knob}.path {path} is not a readable Parquet file ({str(exc)[:160]})",
                            fix="check the file") from None
    if cfg.text_field not in handle.schema_arrow.names:
        raise QuantlabError(f"{path} has no column {cfg.text_field!r} (columns: {handle.schema_arrow.names})",
                            fix=f"set {knob}.text_field to the column that holds the text")
    number = 0
    for batch in handle.iter_batches(columns=[cfg.text_field], batch_size=256):
        for value in batch.column(0).to_pylist():
            if isinstance(value, str):
                yield value, f"row {number}"
            number += 1


def _dataset_docs(cfg: DataConfig, role: Role, knob: str) -> tuple[Iterator[tuple[str, str]], str]:
    try:
        import datasets
    except ImportError:
        raise QuantlabError(f"{knob}.dataset={cfg.dataset} needs the `datasets` package, which is not installed",
                            fix=f"pip install datasets, or use a local file: {knob}.path=/path/to/file.txt") from None
    split = cfg.split or role.default_split
    try:
        ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=split)
    except Exception as exc:  # noqa: BLE001 - offline / missing datasets raise many types
        raise QuantlabError(
            f"dataset {cfg.dataset}/{cfg.dataset_config or ''} split {split} is not available here "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            fix=f"download it once where the hub is reachable, or use a local file: "
                f"{knob}.path=/path/to/file") from None
    if cfg.text_field not in ds.column_names:
        raise QuantlabError(f"dataset {cfg.dataset} has no column {cfg.text_field!r} (columns: {ds.column_names})",
                            fix=f"set {knob}.text_field")
    rows = ((row[cfg.text_field], f"row {i}") for i, row in enumerate(ds))
    return rows, f"datasets:{cfg.dataset}/{cfg.dataset_config}:{split}"


@dataclass
class Source:
    """Where a role's text comes from: its identity (hashed without holding the text), a description, and a fresh
    stream of its documents on each call of docs(): (text, label) records, or for plain text consecutive pieces of
    the one text (label None)."""

    knob: str
    description: str
    identity: dict
    docs: object  # () -> Iterator[tuple[str, str | None]]
    length: int  # characters or bytes of the whole source (cost estimates)
    plain: bool = False  # docs() yields consecutive pieces of one text (no "\n\n" between them)
    rule: str = "records"  # how the text is cut into documents (before doc_separator)


def source(cfg: DataConfig, role: Role) -> Source:
    """The role's text source, checked (existence, emptiness, binary, format) before anything is tokenized."""
    knob = role.name
    if cfg.path:
        path = Path(cfg.path).expanduser()
        _check_file(path, knob)
        fmt = file_format(cfg, knob)
        if fmt == "text" and cfg.format == "auto":
            _refuse_records_named_as_text(path, knob)
        readers = {"text": lambda: ((c, None) for c in _utf8_chunks(path, knob)),
                   "jsonl": lambda: _jsonl_docs(path, cfg, knob),
                   "json": lambda: _json_docs(path, cfg, knob), "csv": lambda: _csv_docs(path, cfg, knob, ","),
                   "tsv": lambda: _csv_docs(path, cfg, knob, "\t"), "parquet": lambda: _parquet_docs(path, cfg, knob)}
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(READ_BYTES):
                sha.update(block)
        # plain text is identified by its bytes (the same key as the text itself); records also by their field
        identity = {"text": sha.hexdigest()} if fmt == "text" else {"file": sha.hexdigest(), "format": fmt,
                                                                     "field": cfg.text_field}
        if fmt == "text":
            return Source(knob, str(path), identity, readers[fmt], path.stat().st_size, plain=True,
                          rule="blank lines")
        return Source(knob, f"{path} ({fmt})", identity, readers[fmt], path.stat().st_size)
    if cfg.dataset:
        _, desc = _dataset_docs(cfg, role, knob)  # fails now if the dataset is not here
        return Source(knob, desc, {"dataset": desc}, lambda: _dataset_docs(cfg, role, knob)[0], 0)
    topics = pydoc_topics()
    names = _pydoc_names(role)
    text = "\n\n".join(topics[n].strip() for n in names)
    desc = f"pydoc topics of Python 3.11.7 ({role.name} part, {len(names)} topics)"
    return Source(knob, desc, {"text": hashlib.sha256(text.encode()).hexdigest()}, lambda: _pydoc_docs(role),
                  len(text), rule="pydoc topics")


@dataclass
class Documents:
    """Where the documents of a text start (character offsets into the joined text) and their labels; filled while
    the text is read."""

    rule: str
    starts: list = field(default_factory=list)
    labels: list = field(default_factory=list)

    def add(self, offset: int, label: str) -> None:
        """A document starts at this character offset."""
        self.starts.append(offset)
        self.labels.append(label)


def _snippet(text: str) -> str:
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    return line if len(line) <= 60 else line[:57] + "..."


def _separator(cfg: DataConfig, knob: str):
    if not cfg.doc_separator:
        return None
    try:
        return re.compile(cfg.doc_separator)
    except re.error as exc:
        raise QuantlabError(f"{knob}.doc_separator={cfg.doc_separator!r} is not a regular expression ({exc})",
                            fix="give a Python regular expression matching the line that starts a document, "
                                "e.g. '^ = [^=].* = $' for WikiText's article headings") from None


def _line_stream(chunks) -> Iterator[str]:
    pending = ""
    for chunk in chunks:
        parts = (pending + chunk).split("\n")
        pending = parts.pop()
        for line in parts:
            yield line + "\n"
    if pending:
        yield pending


def _plain_parts(chunks, rx) -> Iterator[tuple[str, str | None]]:
    r"""Plain text as (part, label if the part starts a document): a document starts at a line fully matching rx,
    or without rx at the first non-blank line after a blank one, once the current document has text (leading blank
    lines belong to the first document). Labels are a document's first non-blank line. Lines keep their "\n"."""
    lines, size, label, has_text, blank_before, started = [], 0, None, False, True, False
    for line in _line_stream(chunks):
        body = line.rstrip("\r\n")
        blank = not body.strip()
        boundary = (rx.fullmatch(body) is not None) if rx else (blank_before and not blank)
        if (boundary and has_text) or size >= CHUNK_CHARS:
            yield "".join(lines), (None if started else label or "(blank)")
            started = not (boundary and has_text)
            if not started:
                label, has_text = None, False
            lines, size = [], 0
        if not blank and label is None:
            label = _snippet(line)
        has_text = has_text or not blank
        blank_before = blank
        lines.append(line)
        size += len(line)
    if lines:
        yield "".join(lines), (None if started else label or "(blank)")


def _parts(src: Source, rx) -> Iterator[tuple[str, str | None]]:
    r"""The source's text as (part, label if the part starts a document); the parts joined are the text (records
    joined with "\n\n")."""
    if src.plain:
        yield from _plain_parts((c for c, _ in src.docs()), rx)
        return
    first = True
    for text, label in src.docs():
        starts = first or rx is None or rx.fullmatch(text.rstrip("\r\n")) is not None
        part = text if first else "\n\n" + text
        yield part, (f"{label}: {_snippet(text)}" if starts else None)
        first = False


def _text_pieces(src: Source, docs: Documents | None = None, rx=None, cut_at_docs: bool = False) -> Iterator[str]:
    r"""The source as one text (documents joined with "\n\n"), in pieces of about CHUNK_CHARS cut at whitespace.
    With docs, the documents' start offsets and labels are recorded in it as the text is read; cut_at_docs also ends
    a piece where a document starts (for tokenizers without character offsets)."""
    buffer, emitted = "", 0
    for part, label in _parts(src, rx):
        if label is not None and docs is not None:
            if cut_at_docs and buffer:
                yield buffer
                emitted += len(buffer)
                buffer = ""
            docs.add(emitted + len(buffer), label)
        buffer += part
        while len(buffer) >= CHUNK_CHARS:
            cut = max(buffer.rfind("\n", 0, CHUNK_CHARS), buffer.rfind(" ", 0, CHUNK_CHARS))
            cut = cut if cut > CHUNK_CHARS // 2 else CHUNK_CHARS
            yield buffer[:cut]
            emitted += cut
            buffer = buffer[cut:]
    if buffer:
        yield buffer


def read_text(cfg: DataConfig, role: Role) -> tuple[str, str]:
    """The role's whole text and its description (small texts, tests; runs stream instead)."""
    src = source(cfg, role)
    return "".join(_text_pieces(src)), src.description


# ------------------------------------------------------------------------------------------ windows
@dataclass
class DataKey:
    """What a token set is identified by, computed without tokenizing."""

    key: str
    source: Source
    description: str
    recipe: dict


def key(cfg: DataConfig, role: Role, model_fp: str, store: ArtifactStore) -> DataKey:
    """The token set's identity without tokenizing: the source's (a plain text's hash; a record file's hash,
    format and field; a dataset's name, config and split), the role, the recipe and the model fingerprint. The
    source is checked first: a missing, empty, binary or unknown-format file or an unavailable dataset is
    exit 2."""
    src = source(cfg, role)
    if not role.sampled:
        _separator(cfg, role.name)  # a bad regular expression is exit 2 before anything is read
    recipe = _recipe(cfg, role)
    identity = src.identity.get("text") or src.identity
    return DataKey(store.key("data", role=role.name, text=identity, model=model_fp, recipe=recipe), src,
                   src.description, recipe)


ORDER = "quota-1"  # the evaluation's look order (module docstring); part of the eval data key


def _recipe(cfg: DataConfig, role: Role) -> dict:
    recipe = {"seq_len": cfg.seq_len, "seed": cfg.seed, "count": role.count(cfg), "split": cfg.split}
    if role.sampled:
        recipe["pool"] = cfg.pool_windows  # calibration draws from the first pool_windows windows (was: all)
    else:  # evaluation: documents and the stratified look order (was: the first max_windows windows in text order)
        recipe.update(order=ORDER, pool=cfg.pool_windows, doc_separator=cfg.doc_separator)
    if cfg.prefix_token and cfg.prefix_token != "none":
        recipe["prefix_token"] = cfg.prefix_token
    return recipe


def with_prefix(cfg: DataConfig, tokenizer, config: dict | None, knob: str):
    """(the recipe with prefix_token resolved for this model: bos | eos | None, the conventions.Prefix)."""
    import dataclasses

    from quantlab import conventions

    prefix = conventions.resolve(cfg.prefix_token, tokenizer, config, knob)
    return dataclasses.replace(cfg, prefix_token=prefix.token), prefix


def _prefix_id(cfg: DataConfig, tokenizer, knob: str) -> int | None:
    """The id of the token before every window (None: plain text windows); auto from a caller outside the run graph
    resolves from the tokenizer alone. One resolution for every caller: quantlab.conventions."""
    from quantlab import conventions

    return conventions.resolve(cfg.prefix_token, tokenizer, None, knob).token_id


def tokenize_windows(src: Source, tokenizer, width: int, needed: int | None, leading: list[int],
                     docs: Documents | None = None, rx=None):
    """(ids of full windows, their count, characters read, whether the text ended, document of each kept token or
    None): tokenizes piece by piece and stops once `needed` windows of `width` tokens exist (None: the whole text).
    With docs, every token gets the document holding its first character (the tokenizer's offsets; a tokenizer
    without offsets gets pieces cut at document starts instead)."""
    ids = list(leading)
    fast = docs is not None and bool(getattr(tokenizer, "is_fast", False))
    token_docs = [np.zeros(len(leading), dtype=np.int64)] if docs is not None else None
    chars, ended = 0, True
    for piece in _text_pieces(src, docs, rx, cut_at_docs=docs is not None and not fast):
        offset = chars
        chars += len(piece)
        enc = tokenizer(piece, add_special_tokens=False, verbose=False, return_offsets_mapping=fast)
        ids.extend(enc["input_ids"])
        if docs is not None:
            starts = np.asarray(docs.starts, dtype=np.int64)
            at = offset + (np.asarray([o[0] for o in enc["offset_mapping"]], dtype=np.int64) if fast
                           else np.zeros(len(enc["input_ids"]), dtype=np.int64))
            token_docs.append(np.maximum(np.searchsorted(starts, at, side="right") - 1, 0))
        if needed is not None and len(ids) >= (needed + 1) * width:
            ended = False
            break
    n_full = len(ids) // width
    if needed is not None:
        n_full = min(n_full, needed)
    doc_of = np.concatenate(token_docs)[: n_full * width] if docs is not None else None
    return ids[: n_full * width], n_full, chars, ended, doc_of


def window_documents(token_docs: np.ndarray, n_windows: int, width: int) -> np.ndarray:
    """The document of each window: the one holding most of its text tokens (ties: the earlier document)."""
    out = np.empty(n_windows, dtype=np.int64)
    for w in range(n_windows):
        values, counts = np.unique(token_docs[w * width:(w + 1) * width], return_counts=True)
        out[w] = values[np.argmax(counts)]  # unique is sorted: argmax takes the first (earlier) of equal counts
    return out


def look_order(window_docs, seed: int) -> np.ndarray:
    """Indices of the windows in the evaluation's look order, proportional to every document's size in every prefix:
    window k goes to the document furthest below its quota k * n_d / N (ties: a seeded document order), each
    document's windows taken in a seeded random order. Every prefix then holds each document's share of the windows
    within one window (the quota property). Deterministic in (document layout, seed)."""
    d = np.asarray(window_docs, dtype=np.int64)
    rng = np.random.default_rng(seed)
    names, inverse, sizes = np.unique(d, return_inverse=True, return_counts=True)
    rank = rng.permutation(names.size).astype(np.float64)
    queues = [np.flatnonzero(inverse == g) for g in range(names.size)]
    queues = [q[rng.permutation(q.size)] for q in queues]
    taken = np.zeros(names.size, dtype=np.int64)
    share = sizes / d.size
    out = np.empty(d.size, dtype=np.int64)
    for k in range(d.size):
        deficit = np.where(taken < sizes, (k + 1) * share - taken, -np.inf)
        best = np.flatnonzero(deficit >= deficit.max() - 1e-12)
        g = best[np.argmin(rank[best])]
        out[k] = queues[g][taken[g]]
        taken[g] += 1
    return out


def build(cfg: DataConfig, role: Role, ident: DataKey, tokenizer, out: Path, vocab: int | None = None) -> dict:
    """Tokenize as far as needed, cut into windows, keep the requested ones (tokens.safetensors in out)."""
    import torch
    from safetensors.torch import save_file

    knob = role.name
    prefix = _prefix_id(cfg, tokenizer, knob)
    width = cfg.seq_len - (prefix is not None)  # text tokens per window
    leading = [] if prefix is not None else tokenizer("", add_special_tokens=True)["input_ids"]
    docs = None if role.sampled else Documents(ident.source.rule if not cfg.doc_separator else
                                               f"lines matching {cfg.doc_separator!r}")
    ids, n_full, chars, ended, token_docs = tokenize_windows(ident.source, tokenizer, width, role.needed(cfg),
                                                             leading, docs, _separator(cfg, knob))
    if chars == 0:
        raise QuantlabError(f"the {knob} text from {ident.description} is empty",
                            fix=f"give {knob} data with text in it")
    count = role.count(cfg)
    if role.sampled:
        if n_full < count:
            raise QuantlabError(
                f"calibration text has {len(ids) if ended else 'too few'} tokens = {n_full} windows of {cfg.seq_len}; "
                f"calib.num_samples x calib.seq_len = {count} x {cfg.seq_len} needs {count * cfg.seq_len}",
                fix=f"lower calib.num_samples (<= {n_full}) or calib.seq_len, or give more text")
        gen = torch.Generator().manual_seed(cfg.seed)
        pick = torch.randperm(n_full, generator=gen)[:count]
    else:
        if n_full < 1:
            raise QuantlabError(f"evaluation text has {len(ids)} tokens, shorter than one window of "
                                f"eval.seq_len={cfg.seq_len}", fix="give more text or lower eval.seq_len")
        window_docs = window_documents(token_docs, n_full, width)
        pick = torch.from_numpy(look_order(window_docs, cfg.seed)[: min(n_full, count or n_full)])
    flat = torch.tensor(ids, dtype=torch.long).view(n_full, width)
    if prefix is not None:
        flat = torch.cat([torch.full((n_full, 1), prefix, dtype=torch.long), flat], dim=1)
    tokens = flat[pick].contiguous()
    if vocab is not None and tokens.numel() and int(tokens.max()) >= vocab:
        raise QuantlabError(f"the tokenizer produced token id {int(tokens.max())}, but the model's embedding has only "
                            f"{vocab} rows: the tokenizer does not belong to this model",
                            fix="save the model's own tokenizer beside it (tokenizer.save_pretrained)")
    tensors = {"tokens": tokens}
    info = {"source": ident.description, "identity": ident.source.identity, "text_chars": chars,
            "chars_read": chars, "text_ended": ended, "full_windows": n_full, "windows": int(pick.numel()),
            "seq_len": cfg.seq_len}
    if not role.sampled:
        kept = window_docs[pick.numpy()]
        tensors.update(docs=torch.from_numpy(kept), positions=pick.clone())
        info["documents"] = {"rule": docs.rule, "assignment": "the document holding most of a window's text tokens",
                             "order": ORDER, "in_pool": int(np.unique(window_docs).size),
                             "in_set": int(np.unique(kept).size),
                             "labels": {str(int(g)): docs.labels[int(g)] for g in np.unique(kept)}}
    save_file(tensors, str(out / "tokens.safetensors"))
    return info


def load(art, role: Role) -> TokenSet:
    """The TokenSet stored in a data artifact (tokens.safetensors and its build info)."""
    from safetensors.torch import load_file

    tensors = load_file(str(art.path / "tokens.safetensors"))
    tokens = tensors["tokens"]
    info = dict(art.info)
    docs = tensors["docs"].numpy() if "docs" in tensors else None
    positions = tensors["positions"].numpy() if "positions" in tensors else None
    log.info("%s data: %s, %d windows x %d tokens%s", role.name, info["source"], tokens.shape[0], tokens.shape[1],
             f" from {info['documents']['in_set']} documents ({info['documents']['rule']})" if docs is not None
             else "")
    return TokenSet(role.name, art.fingerprint, tokens, info, docs, positions)


OVERLAP_NGRAM = 32  # tokens: a shared run this long is copied text, not a common phrase
COPIED_DOCUMENT = 0.5  # share of a document's evaluated tokens in copied runs that makes it a copied document


def overlap(calib: TokenSet, evalset: TokenSet, n: int = OVERLAP_NGRAM) -> dict:
    """How much of the evaluation text the calibration windows contain: the share of evaluation positions covered
    by a run of n tokens that also occurs in a calibration window, and the windows with any such run. Exact (token
    runs, not documents or paths), so the same file under two names and overlapping records are found alike."""
    import numpy as np

    def grams(tokens) -> list:
        rows = np.ascontiguousarray(tokens.numpy()) if hasattr(tokens, "numpy") else np.asarray(tokens)
        if rows.shape[1] < n:
            return []
        views = np.lib.stride_tricks.sliding_window_view(rows, n, axis=1)
        return [[r.tobytes() for r in row] for row in views]

    seen = {g for row in grams(calib.tokens) for g in row}
    covered = np.zeros(tuple(evalset.tokens.shape), dtype=bool)
    windows = []
    for w, row in enumerate(grams(evalset.tokens)):
        hits = [i for i, g in enumerate(row) if g in seen]
        for i in hits:
            covered[w, i: i + n] = True
        if hits:
            windows.append(w)
    share = float(covered.mean()) if covered.size else 0.0
    copied = []  # documents whose evaluated windows lie mostly in copied runs: a document calibration also read
    if evalset.docs is not None and covered.size:
        docs = np.asarray(evalset.docs)
        for doc in np.unique(docs):
            part = float(covered[docs == doc].mean())
            if part >= COPIED_DOCUMENT:
                copied.append({"document": evalset.doc_label(int(doc)), "share": round(part, 4)})
    return {"ngram": n, "share": share, "windows": windows, "eval_windows": int(evalset.num_windows),
            "copied_documents": copied, "same_source": calib.info.get("identity") == evalset.info.get("identity")}


def run(cfg: DataConfig, role: Role, model_fp: str, tokenizer, store: ArtifactStore,
        vocab: int | None = None, model_config: dict | None = None) -> TokenSet:
    """key, build (once) and load in one call: for callers outside the run graph (bench, tests). prefix_token=auto
    resolves from the tokenizer alone (no config: the family rule needs model_config)."""
    cfg, _ = with_prefix(cfg, tokenizer, model_config, role.name)
    ident = key(cfg, role, model_fp, store)
    art, _ = store.get_or_build("data", ident.key, lambda out: build(cfg, role, ident, tokenizer, out, vocab),
                                {"role": role.name, "recipe": ident.recipe, "model": model_fp},
                                describe=f"tokenizing {role.name} data",
                                cost=_cost(role, ident.source.length))
    return load(art, role)


def _cost(role: Role, chars: int) -> dict:
    """A tokenization's cost record: characters of the source (quantlab.prior prices them as bytes)."""
    return costs.work("cpu", role.name, size=chars, units={"bytes": chars})


# ------------------------------------------------------------------------------------------- the step
def step(ctx: RunContext, role: Role) -> Step:
    """Token windows for one role, keyed by the text itself (not its path), the recipe (prefix_token resolved for
    the model: quantlab.conventions) and the model."""
    name = f"data:{role.name}"

    def tokenizer(r):
        if "tokenizer" not in ctx.memo:
            from quantlab.models import load_tokenizer

            ctx.memo["tokenizer"] = load_tokenizer(r.value("prepare"))
        return ctx.memo["tokenizer"]

    def recipe(r) -> DataConfig:
        memo = ctx.memo.setdefault("data_recipes", {})
        if role.name not in memo:
            memo[role.name] = with_prefix(getattr(ctx.cfg, role.name), tokenizer(r), r.value("prepare").config,
                                          role.name)
        return memo[role.name][0]

    def length(r) -> int:
        """The source's characters (what tokenizing costs): its key's, or before the model is prepared (a first
        run's plan) the source itself."""
        from quantlab.step import Pending

        try:
            return ident(r).source.length
        except Pending:
            return source(getattr(ctx.cfg, role.name), role).length

    def ident(r) -> DataKey:
        memo = ctx.memo.setdefault("data_keys", {})
        if role.name not in memo:
            memo[role.name] = key(recipe(r), role, r.fingerprint("prepare"), ctx.store)
        return memo[role.name]

    def build_step(out, r) -> dict:
        ref = r.value("prepare")
        return build(recipe(r), role, ident(r), tokenizer(r), out, ref.vocab_size)

    def load_step(art, r, _built) -> TokenSet:
        tokens = load(art, role)
        recipe(r)
        tokens.prefix = ctx.memo["data_recipes"][role.name][1]
        return tokens

    return Step(name, "data", lambda r: ident(r).key, load_step, build_step,
                needs=("prepare",), work=lambda r: _cost(role, length(r)),
                manifest=lambda r: {"role": role.name, "recipe": ident(r).recipe, "model": r.fingerprint("prepare")},
                describe=f"tokenizing {role.name} data", cheap=True)
