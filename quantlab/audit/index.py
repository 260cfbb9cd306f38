"""index: what serving engines load against what is on disk. vLLM and SGLang load the shards
model.safetensors.index.json names (every *.safetensors without an index); transformers loads model.safetensors when
it exists, else the index's shards. Shards missing, a stale index (a tensor it names is not in the named shard, or a
shard's tensor it does not list), stray copies beside the shards, or model.safetensors and the shards holding
different tensors: each loader builds another model from the same directory.

The audit's tensor checks read what vLLM loads (LoaderViews.served); this check reports where loaders differ."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from quantlab.audit.report import ERROR, INFO, WARNING, _natural
from quantlab.checkpoint import SAFE_INDEX, SAFE_WEIGHTS, read_safetensors_header, safetensors_index

REPAIR = ("re-save the checkpoint from the export (save_pretrained / export_hf_checkpoint writes the shards and "
          "their index together), or copy the export directory whole")


@dataclass
class LoaderViews:
    """The safetensors files on disk and which of them each loader reads."""

    directory: Path
    headers: dict[str, dict]  # file name -> {tensor: header entry}, every *.safetensors on disk
    weight_map: dict[str, str] | None  # model.safetensors.index.json's weight_map
    transformers: list[str]  # files transformers loads (model.safetensors first, else the index's shards)
    vllm: list[str]  # files vLLM / SGLang load (the index's existing shards, else every *.safetensors)
    missing: list[str] = field(default_factory=list)  # shards the index names that are not on disk
    duplicates: dict[str, str] = field(default_factory=dict)  # tensor -> later vLLM file that holds it again

    @property
    def served(self) -> list[Path]:
        """The files the audit reads: vLLM's (each tensor from the first file that holds it: CheckpointTensors'
        first_wins), else transformers'."""
        seen: set[str] = set()
        for name in self.vllm:
            tensors = set(self.headers[name])
            for t in sorted(tensors & seen):
                self.duplicates.setdefault(t, name)
            seen |= tensors
        files = self.vllm or [n for n in self.transformers if n in self.headers]
        return [self.directory / n for n in files]


def loader_views(ckpt: Path) -> LoaderViews:
    """Read every safetensors header in the directory (headers only: milliseconds) and the index."""
    ckpt = Path(ckpt)
    on_disk = sorted(p.name for p in ckpt.glob("*.safetensors") if p.is_file())
    headers = {name: read_safetensors_header(ckpt / name) for name in on_disk}
    weight_map = safetensors_index(ckpt)
    if weight_map is not None:
        named = sorted(set(weight_map.values()))
        missing = [n for n in named if n not in headers]
        vllm = [n for n in named if n in headers]
        transformers = [SAFE_WEIGHTS] if SAFE_WEIGHTS in headers else named
    else:
        missing, vllm = [], on_disk
        transformers = [SAFE_WEIGHTS] if SAFE_WEIGHTS in headers else []
    views = LoaderViews(ckpt, headers, weight_map, transformers, vllm, missing)
    views.served  # noqa: B018 - records the duplicates
    return views


def _modules(names) -> list[str]:
    return sorted({n.rpartition(".")[0] or n for n in names}, key=_natural)


def _tensors(views: LoaderViews, files: list[str]) -> dict[str, str]:
    """tensor -> the first of these files (that exist) holding it."""
    out: dict[str, str] = {}
    for name in files:
        for tensor in views.headers.get(name, {}):
            out.setdefault(tensor, name)
    return out


def _same_bytes(directory: Path, tensor: str, file_a: str, file_b: str) -> bool:
    """Whether two files hold the same bytes (dtype, shape, values) for a tensor."""
    from safetensors import safe_open

    with safe_open(str(directory / file_a), "pt") as fa, safe_open(str(directory / file_b), "pt") as fb:
        x, y = fa.get_tensor(tensor), fb.get_tensor(tensor)
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    import torch

    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def _differ(views: LoaderViews, a: dict[str, str], b: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(only in a, only in b, in both with other bytes) between two loaders' tensor -> file maps."""
    only_a = sorted(set(a) - set(b), key=_natural)
    only_b = sorted(set(b) - set(a), key=_natural)
    changed = [t for t in sorted(set(a) & set(b), key=_natural)
               if a[t] != b[t] and (views.headers[a[t]][t]["dtype"] != views.headers[b[t]][t]["dtype"]
                                    or views.headers[a[t]][t]["shape"] != views.headers[b[t]][t]["shape"]
                                    or not _same_bytes(views.directory, t, a[t], b[t]))]
    return only_a, only_b, changed


def check_index(a) -> None:
    """Shards missing or stale, stray copies, and loaders that would build different models from the directory."""
    views: LoaderViews = a.views
    if views.missing:
        lost = [t for t, f in (views.weight_map or {}).items() if f in views.missing]
        a.add(ERROR, "index", _modules(lost), f"{SAFE_INDEX} names {len(views.missing)} shard(s) that are not in "
              f"the directory: {', '.join(views.missing[:3])} ({len(lost)} tensor(s))",
              "the checkpoint was copied or uploaded partly (an interrupted transfer, a glob that missed a shard)",
              consequence="transformers refuses to load it (a shard the index names is missing); vLLM and SGLang "
              "load the shards that exist and stop on the weights they lack, or run scales they lack at defaults",
              fix="copy every shard the index names; " + REPAIR)
    if views.weight_map is not None:
        _check_stale(a, views)
    hf, vllm = _tensors(views, views.transformers), _tensors(views, views.vllm)
    if views.transformers != views.vllm and views.transformers:
        _compare_loaders(a, views, hf, vllm)
    elif not views.transformers and views.vllm:
        a.add(ERROR, "index", [], f"{len(views.vllm)} safetensors file(s) ({', '.join(views.vllm[:3])}) but "
              f"neither {SAFE_WEIGHTS} nor {SAFE_INDEX}",
              "the index of a sharded checkpoint was not copied, or the weights were saved under another name",
              consequence="transformers finds no weights (it loads only model.safetensors or the index's shards) "
              "and fails; vLLM loads every *.safetensors file it finds",
              fix=f"copy {SAFE_INDEX} with the shards, or rename a single file to {SAFE_WEIGHTS}")
    if views.transformers == views.vllm or not views.transformers:  # else _compare_loaders named the repeats
        _check_duplicates(a, views)
    _check_strays(a, views, set(views.transformers) | set(views.vllm))


def _check_stale(a, views: LoaderViews) -> None:
    """The index against the shards it names: each tensor in the shard it is listed in, and listed at all."""
    misplaced, nowhere = [], []
    served = _tensors(views, views.vllm)
    for tensor, file in views.weight_map.items():
        if file in views.missing or tensor in views.headers.get(file, {}):
            continue
        (misplaced if tensor in served else nowhere).append(tensor)
    unlisted = [t for t in served if t not in views.weight_map]
    if misplaced or nowhere:
        shown = (misplaced + nowhere)[0]
        where = served.get(shown, "no shard the index names")
        a.add(ERROR, "index", _modules(misplaced + nowhere), f"{len(misplaced) + len(nowhere)} tensor(s) are not "
              f"in the shard {SAFE_INDEX} lists them in: {len(misplaced)} in another shard it names, {len(nowhere)} "
              f"in none (e.g. {shown}: listed in {views.weight_map[shown]}, found in {where})",
              "a stale index: the shards were re-cut, re-quantized or renamed without regenerating it",
              consequence="vLLM and SGLang load only the shards the index names and stop on the weights that are "
              "in none of them; loaders that open the shard the index names for a tensor (lazy and offloaded "
              "loading, converters) fail with a missing key; transformers takes the index's key list for what the "
              "checkpoint holds and can leave tensors at their initial values without a missing-key warning",
              fix=REPAIR)
    if unlisted:
        a.add(WARNING, "index", _modules(unlisted), f"{len(unlisted)} tensor(s) in the shards are not listed in "
              f"{SAFE_INDEX} (e.g. {', '.join(sorted(unlisted, key=_natural)[:3])})",
              "tensors were added to a shard (scales written by a second pass) without updating the index",
              consequence="vLLM loads them (it reads whole shards); tools that enumerate the index (transformers' "
              "missing-key report, converters, hub viewers) do not see them", fix=REPAIR)


def _compare_loaders(a, views: LoaderViews, hf: dict[str, str], vllm: dict[str, str]) -> None:
    only_hf, only_vllm, changed = _differ(views, hf, vllm)
    what = (f"transformers loads {', '.join(views.transformers[:2])}, vLLM / SGLang load "
            f"{', '.join(views.vllm[:2])}{' ...' if len(views.vllm) > 2 else ''}")
    if not (only_hf or only_vllm or changed):
        a.add(INFO, "index", [], f"{what}: the same tensors with the same bytes (a redundant copy on disk)")
        return
    parts = [f"{len(changed)} tensor(s) with other bytes (e.g. {changed[0]})" if changed else "",
             f"{len(only_hf)} only in transformers' (e.g. {only_hf[0]})" if only_hf else "",
             f"{len(only_vllm)} only in vLLM's (e.g. {only_vllm[0]})" if only_vllm else ""]
    a.add(ERROR, "index", _modules(changed + only_hf + only_vllm), f"{what}, and they differ: "
          + "; ".join(p for p in parts if p),
          f"{SAFE_WEIGHTS} and the shards come from different exports (a stale single file left beside a re-export, "
          "or shards copied over an older directory)",
          consequence="transformers (and quantlab's evaluation before this check) runs one model, vLLM / SGLang "
          "serve another: what was evaluated is not what is served, or a loader lacks tensors and fails",
          fix=f"delete the copy that is not the export (usually a stale {SAFE_WEIGHTS}), or {REPAIR}")


def _check_duplicates(a, views: LoaderViews) -> None:
    """Tensors vLLM would read from two of the files it loads."""
    if not views.duplicates:
        return
    first = _tensors(views, views.vllm)
    differ = [t for t, later in views.duplicates.items() if not _same_bytes(views.directory, t, first[t], later)]
    files = sorted(set(views.duplicates.values()))
    if differ:
        a.add(ERROR, "index", _modules(differ), f"{len(views.duplicates)} tensor(s) are in more than one of the "
              f"files vLLM loads ({', '.join(files[:3])} repeat tensors of an earlier file), {len(differ)} with "
              f"other bytes (e.g. {differ[0]})", "two exports' files in one directory without an index (a "
              "consolidated or single-file copy beside shards)",
              consequence="vLLM / SGLang load every file and the last copy of a tensor wins (load order, not "
              "intent); transformers loads model.safetensors only", fix=f"delete the stray files, or add the "
              f"export's {SAFE_INDEX} so that engines load its shards only")
    else:
        a.add(WARNING, "index", _modules(views.duplicates), f"{len(views.duplicates)} tensor(s) are repeated, "
              f"byte for byte, in {', '.join(files[:3])}, which vLLM also loads",
              "a copy of the weights beside the export without an index",
              consequence="vLLM loads every copy (twice the load time and host memory, same model)",
              fix=f"delete the copy, or add {SAFE_INDEX} naming the shards to load")


def _check_strays(a, views: LoaderViews, loaded: set[str]) -> None:
    """safetensors files no loader of this directory reads: harmless unless a glob-based tool picks them up with
    tensors of the model in them."""
    strays = [n for n in views.headers if n not in loaded]
    if not strays:
        return
    served = _tensors(views, views.vllm)
    clashing = {n: [t for t in views.headers[n] if t in served] for n in strays}
    differ = [t for n, ts in clashing.items() for t in ts if not _same_bytes(views.directory, t, served[t], n)]
    if differ:
        a.add(ERROR, "index", _modules(differ), f"{len(strays)} safetensors file(s) the index does not name "
              f"({', '.join(strays[:3])}) hold other values for {len(differ)} tensor(s) of the model (e.g. "
              f"{differ[0]})", "a stale or differently quantized copy left beside the export's shards",
              consequence="vLLM and transformers ignore it; tools that load every *.safetensors file (vLLM's "
              "streaming loaders, MLX, converters) merge it in and may run its values",
              fix="delete the stray file(s) or move them out of the model directory")
    else:
        a.add(INFO, "index", [], f"{len(strays)} safetensors file(s) that no loader of this directory reads: "
              f"{', '.join(strays[:3])}" + (" (copies of the model's tensors, byte for byte)"
                                             if any(clashing.values()) else ""))
