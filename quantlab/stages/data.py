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
from quantlab.config import DataConfig
from quantlab.errors import QuantlabError
from quantlab.step import RunContext, Step

log = logging.getLogger("quantlab")

PYDOC_CALIB_SHARE = 0.8


@dataclass(frozen=True)
class Role:
    """What a token set is for: calibration windows are drawn at random (seeded) from the text, evaluation windows
    are the first ones in order. `name` is also the config section (calib / eval) and the pydoc part."""

    name: str
    default_split: str
    sampled: bool

    def count(self, cfg: DataConfig) -> int | None:
        """Windows requested: calib.num_samples, or eval.max_windows (None: all)."""
        return cfg.num_samples if self.sampled else cfg.max_windows


CALIB = Role("calib", "train", sampled=True)
EVAL = Role("eval", "test", sampled=False)


@dataclass
class TokenSet:
    role: str  # calib | eval
    fingerprint: str
    tokens: object  # torch.LongTensor [n_windows, seq_len]
    info: dict

    @property
    def num_windows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])


# ------------------------------------------------------------------------------------------ text
def _pydoc_text(role: Role) -> tuple[str, str]:
    from pydoc_data.topics import topics

    def in_calib(name: str) -> bool:
        return hashlib.sha1(name.encode()).digest()[0] < int(256 * PYDOC_CALIB_SHARE)

    names = [n for n in sorted(topics) if in_calib(n) == role.sampled]
    return "\n\n".join(topics[n].strip() for n in names), f"pydoc_data.topics ({role.name} part, {len(names)} topics)"


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


def _dataset_text(cfg: DataConfig, role: Role, knob: str) -> tuple[str, str]:
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
            fix=f"download it once where the hub is reachable, or use a local file: {knob}.path=/path/to/file") from None
    if cfg.text_field not in ds.column_names:
        raise QuantlabError(f"dataset {cfg.dataset} has no column {cfg.text_field!r} (columns: {ds.column_names})",
                            fix=f"set {knob}.text_field")
    return "\n\n".join(ds[cfg.text_field]), f"datasets:{cfg.dataset}/{cfg.dataset_config}:{split}"


def read_text(cfg: DataConfig, role: Role) -> tuple[str, str]:
    knob = role.name
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


def key(cfg: DataConfig, role: Role, model_fp: str, store: ArtifactStore) -> DataKey:
    text, desc = read_text(cfg, role)
    text_sha = hashlib.sha256(text.encode()).hexdigest()
    recipe = _recipe(cfg, role)
    return DataKey(store.key("data", role=role.name, text=text_sha, model=model_fp, recipe=recipe), text, desc,
                   text_sha, recipe)


def _recipe(cfg: DataConfig, role: Role) -> dict:
    recipe = {"seq_len": cfg.seq_len, "seed": cfg.seed, "count": role.count(cfg), "split": cfg.split}
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


def build(cfg: DataConfig, role: Role, ident: DataKey, tokenizer, out: Path) -> dict:
    """Tokenize the text once, cut it into windows, keep the requested ones (tokens.safetensors in out)."""
    import torch
    from safetensors.torch import save_file

    text, desc, text_sha, knob = ident.text, ident.description, ident.text_sha256, role.name
    prefix = _prefix_id(cfg, tokenizer, knob)
    ids = tokenizer(text, add_special_tokens=prefix is None, verbose=False)["input_ids"]
    width = cfg.seq_len - (prefix is not None)  # text tokens per window
    n_full = len(ids) // width
    count = role.count(cfg)
    if role.sampled:
        if n_full < count:
            raise QuantlabError(
                f"calibration text has {len(ids)} tokens = {n_full} windows of {cfg.seq_len}; "
                f"calib.num_samples x calib.seq_len = {count} x {cfg.seq_len} needs {count * cfg.seq_len}",
                fix=f"lower calib.num_samples (<= {n_full}) or calib.seq_len, or give more text")
        gen = torch.Generator().manual_seed(cfg.seed)
        pick = torch.randperm(n_full, generator=gen)[:count]
    else:
        if n_full < 1:
            raise QuantlabError(f"evaluation text has {len(ids)} tokens, shorter than one window of "
                                f"eval.seq_len={cfg.seq_len}", fix="give more text or lower eval.seq_len")
        pick = torch.arange(min(n_full, count or n_full))
    flat = torch.tensor(ids[: n_full * width], dtype=torch.long).view(n_full, width)
    if prefix is not None:
        flat = torch.cat([torch.full((n_full, 1), prefix, dtype=torch.long), flat], dim=1)
    save_file({"tokens": flat[pick].contiguous()}, str(out / "tokens.safetensors"))
    return {"source": desc, "text_sha256": text_sha, "text_chars": len(text), "total_tokens": len(ids),
            "full_windows": n_full, "windows": int(pick.numel()), "seq_len": cfg.seq_len}


def load(art, role: Role) -> TokenSet:
    from safetensors.torch import load_file

    tokens = load_file(str(art.path / "tokens.safetensors"))["tokens"]
    info = dict(art.info)
    log.info("%s data: %s, %d windows x %d tokens", role.name, info["source"], tokens.shape[0], tokens.shape[1])
    return TokenSet(role.name, art.fingerprint, tokens, info)


def run(cfg: DataConfig, role: Role, model_fp: str, tokenizer, store: ArtifactStore) -> TokenSet:
    """key, build (once) and load in one call: for callers outside the run graph (bench, tests)."""
    ident = key(cfg, role, model_fp, store)
    art, _ = store.get_or_build("data", ident.key, lambda out: build(cfg, role, ident, tokenizer, out),
                                {"role": role.name, "recipe": ident.recipe, "model": model_fp},
                                describe=f"tokenizing {role.name} data", cost=costs.work("cpu", role.name, size=len(ident.text)))
    return load(art, role)


# ------------------------------------------------------------------------------------------- the step
def step(ctx: RunContext, role: Role) -> Step:
    """Token windows for one role, keyed by the text itself (not its path), the recipe and the model."""
    cfg = getattr(ctx.cfg, role.name)
    name = f"data:{role.name}"

    def ident(r) -> DataKey:
        memo = ctx.memo.setdefault("data_keys", {})
        if role.name not in memo:
            memo[role.name] = key(cfg, role, r.fingerprint("prepare"), ctx.store)
        return memo[role.name]

    def tokenizer(r):
        if "tokenizer" not in ctx.memo:
            from quantlab.models import load_tokenizer

            ctx.memo["tokenizer"] = load_tokenizer(r.value("prepare"))
        return ctx.memo["tokenizer"]

    return Step(name, "data", lambda r: ident(r).key, lambda art, r, built: load(art, role),
                lambda out, r: build(cfg, role, ident(r), tokenizer(r), out), needs=("prepare",),
                work=lambda r: costs.work("cpu", role.name, size=len(ident(r).text)),
                manifest=lambda r: {"role": role.name, "recipe": ident(r).recipe, "model": r.fingerprint("prepare")},
                describe=f"tokenizing {role.name} data", cheap=True)
