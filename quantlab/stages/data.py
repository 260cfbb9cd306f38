"""data: materialize calibration and evaluation token sets from a recipe.

Text sources, first match wins: `path` (a local .txt or .jsonl file), `dataset` (HF datasets, where
available), else the documentation text Python ships (pydoc_data.topics), split by topic name into a
calibration part and an evaluation part. Documents are joined with "\\n\\n", tokenized once, and cut into
non-overlapping windows of seq_len tokens (tail dropped). With prefix_token=eos|bos each window is that token
followed by seq_len - 1 text tokens.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from quantlab import costs
from quantlab.artifacts import ArtifactStore
from quantlab.config import CalibConfig, DataConfig
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")

PYDOC_CALIB_SHARE = 0.8


@dataclass
class TokenSet:
    role: str  # calib | eval
    fingerprint: str
    tokens: "object"  # torch.LongTensor [n_windows, seq_len]
    info: dict

    @property
    def num_windows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])


# ------------------------------------------------------------------------------------------ text
def _pydoc_text(role: str) -> tuple[str, str]:
    from pydoc_data.topics import topics

    def in_calib(name: str) -> bool:
        return hashlib.sha1(name.encode()).digest()[0] < int(256 * PYDOC_CALIB_SHARE)

    names = [n for n in sorted(topics) if in_calib(n) == (role == "calib")]
    return "\n\n".join(topics[n].strip() for n in names), f"pydoc_data.topics ({role} part, {len(names)} topics)"


def _file_text(cfg: DataConfig, knob: str) -> tuple[str, str]:
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise QuantlabError(f"{knob}.path {path} does not exist or is not a file", fix=f"point {knob}.path at a .txt or .jsonl file")
    raw = path.read_bytes()
    if not raw.strip():
        raise QuantlabError(f"{knob}.path {path} is empty", fix="give a file with text in it")
    if b"\x00" in raw[:65536]:
        raise QuantlabError(f"{knob}.path {path} looks binary (NUL bytes), not text", fix="give a UTF-8 .txt or .jsonl file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QuantlabError(f"{knob}.path {path} is not UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 4]!r})",
                            fix=f"convert it, e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}") from None
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuantlabError(f"{path} line {i} is not JSON ({exc.msg})", fix="one JSON object per line") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(cfg.text_field), str):
                raise QuantlabError(f"{path} line {i} has no string field {cfg.text_field!r}",
                                    fix=f"set {knob}.text_field to the field that holds the text")
            docs.append(obj[cfg.text_field])
        text = "\n\n".join(docs)
        return text, f"{path} ({len(docs)} jsonl records)"
    return text, str(path)


def _dataset_text(cfg: DataConfig, role: str, knob: str) -> tuple[str, str]:
    try:
        import datasets
    except ImportError:
        raise QuantlabError(f"{knob}.dataset={cfg.dataset} needs the `datasets` package, which is not installed",
                            fix=f"pip install datasets, or use a local file: {knob}.path=/path/to/file.txt") from None
    split = cfg.split or ("train" if role == "calib" else "test")
    try:
        ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=split)
    except Exception as exc:  # noqa: BLE001 - offline / missing datasets raise many types
        raise QuantlabError(
            f"dataset {cfg.dataset}/{cfg.dataset_config or ''} split {split} is not available here "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
            fix=f"download it once where the hub is reachable, or use a local file: {knob}.path=/path/to/file") from None
    if cfg.text_field not in ds.column_names:
        raise QuantlabError(f"dataset {cfg.dataset} has no column {cfg.text_field!r} (columns: {ds.column_names})",
                            fix=f"set {knob}.text_field")
    return "\n\n".join(ds[cfg.text_field]), f"datasets:{cfg.dataset}/{cfg.dataset_config}:{split}"


def read_text(cfg: DataConfig, role: str) -> tuple[str, str]:
    knob = "calib" if role == "calib" else "eval"
    if cfg.path:
        text, desc = _file_text(cfg, knob)
    elif cfg.dataset:
        text, desc = _dataset_text(cfg, role, knob)
    else:
        text, desc = _pydoc_text(role)
    if not text.strip():
        raise QuantlabError(f"the {knob} text from {desc} is empty", fix=f"give {knob} data with text in it")
    return text, desc


# ------------------------------------------------------------------------------------------ windows
@dataclass
class DataKey:
    """What a token set is identified by, computed without tokenizing."""
    key: str
    text: str
    description: str
    text_sha256: str
    recipe: dict


def key(cfg: DataConfig, role: str, model_fp: str, store: ArtifactStore) -> DataKey:
    text, desc = read_text(cfg, role)
    text_sha = hashlib.sha256(text.encode()).hexdigest()
    recipe = _recipe(cfg)
    return DataKey(store.key("data", role=role, text=text_sha, model=model_fp, recipe=recipe), text, desc, text_sha,
                   recipe)


def _recipe(cfg: DataConfig) -> dict:
    count = cfg.num_samples if isinstance(cfg, CalibConfig) else cfg.max_windows
    recipe = {"seq_len": cfg.seq_len, "seed": cfg.seed, "count": count, "split": cfg.split}
    if cfg.prefix_token:
        recipe["prefix_token"] = cfg.prefix_token
    return recipe


def _prefix_id(cfg: DataConfig, tokenizer, knob: str) -> int | None:
    if not cfg.prefix_token:
        return None
    token_id = getattr(tokenizer, f"{cfg.prefix_token}_token_id", None)
    if token_id is None:
        raise QuantlabError(f"{knob}.prefix_token={cfg.prefix_token}: the tokenizer has no {cfg.prefix_token} token",
                            fix=f"use {knob}.prefix_token={'bos' if cfg.prefix_token == 'eos' else 'eos'} or null")
    return int(token_id)


def run(cfg: DataConfig, role: str, model_fp: str, tokenizer, store: ArtifactStore) -> TokenSet:
    import torch
    from safetensors.torch import load_file, save_file

    ident = key(cfg, role, model_fp, store)
    text, desc, text_sha = ident.text, ident.description, ident.text_sha256
    knob = "calib" if role == "calib" else "eval"

    def build(out: Path) -> dict:
        prefix = _prefix_id(cfg, tokenizer, knob)
        ids = tokenizer(text, add_special_tokens=prefix is None, verbose=False)["input_ids"]
        width = cfg.seq_len - (prefix is not None)  # text tokens per window
        n_full = len(ids) // width
        if role == "calib":
            if n_full < cfg.num_samples:
                raise QuantlabError(
                    f"calibration text has {len(ids)} tokens = {n_full} windows of {cfg.seq_len}; "
                    f"calib.num_samples x calib.seq_len = {cfg.num_samples} x {cfg.seq_len} needs "
                    f"{cfg.num_samples * cfg.seq_len}",
                    fix=f"lower calib.num_samples (<= {n_full}) or calib.seq_len, or give more text")
            gen = torch.Generator().manual_seed(cfg.seed)
            pick = torch.randperm(n_full, generator=gen)[: cfg.num_samples]
        else:
            if n_full < 1:
                raise QuantlabError(f"evaluation text has {len(ids)} tokens, shorter than one window of eval.seq_len={cfg.seq_len}",
                                    fix="give more text or lower eval.seq_len")
            pick = torch.arange(min(n_full, cfg.max_windows or n_full))
        flat = torch.tensor(ids[: n_full * width], dtype=torch.long).view(n_full, width)
        if prefix is not None:
            flat = torch.cat([torch.full((n_full, 1), prefix, dtype=torch.long), flat], dim=1)
        save_file({"tokens": flat[pick].contiguous()}, str(out / "tokens.safetensors"))
        return {"source": desc, "text_sha256": text_sha, "text_chars": len(text), "total_tokens": len(ids),
                "full_windows": n_full, "windows": int(pick.numel()), "seq_len": cfg.seq_len}

    art = store.get_or_build("data", ident.key, build, {"role": role, "recipe": ident.recipe, "model": model_fp},
                             describe=f"tokenizing {knob} data", cost=costs.work("cpu", role, size=len(text)))
    tokens = load_file(str(art.path / "tokens.safetensors"))["tokens"]
    info = dict(art.info)
    log.info("%s data: %s, %d windows x %d tokens", knob, info["source"], tokens.shape[0], tokens.shape[1])
    return TokenSet(role, art.fingerprint, tokens, info)

