"""engine=served: token texts as llama.cpp's server writes them (text -> id), and which checkpoint the server runs
(the GGUF file it lists, and window 1 against llama.cpp's own log-probs on engine.serve_checkpoint; docs/served.md)."""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")


# ------------------------------------------------------------------------------------------- token texts
def _byte_decoder() -> dict:
    """GPT-2 byte-level BPE: the printable character each byte is written as, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def token_texts(tokenizer) -> tuple[list[str], list[bool]]:
    """Each id's text as llama.cpp's server writes it (the token's bytes decoded as UTF-8 with undecodable bytes
    dropped; control tokens (BOS, EOS, chat markers) as the empty text), and whether that text is all of the token
    (its bytes are complete UTF-8: not a piece of a multi-byte character)."""
    table = _byte_decoder()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    texts, whole = [], []
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or piece is None:
            texts.append("")
            whole.append(False)
        elif all(c in table for c in piece):
            raw = bytes(table[c] for c in piece)
            texts.append(raw.decode("utf-8", "ignore"))
            try:
                raw.decode("utf-8")
                whole.append(True)
            except UnicodeDecodeError:
                whole.append(False)
        else:
            texts.append(tokenizer.decode([i]))
            whole.append(True)
    return texts, whole


def text_index(texts: list[str], whole: list[bool] | None = None) -> tuple[dict, set]:
    """text -> id, and the set of texts several ids share. A shared text maps to the one id among them whose text
    is all of the token (' ' is the space token, not the space before the first byte of a curly quote), else to
    None (ambiguous: skipped)."""
    owners: dict[str, list[int]] = {}
    for i, t in enumerate(texts):
        owners.setdefault(t, []).append(i)
    index, shared = {}, set()
    for t, ids in owners.items():
        if len(ids) == 1:
            index[t] = ids[0]
            continue
        shared.add(t)
        full = [i for i in ids if whole is not None and whole[i]]
        index[t] = full[0] if len(full) == 1 else None
    return index, shared


# ------------------------------------------------------------------------------- which checkpoint is served
IDENTITY_POSITIONS = 64  # window 1's first positions, computed again by llama.cpp in quantlab's process
IDENTITY_TOP = 20  # position 0: llama.cpp's most likely tokens after BOS compared
IDENTITY_TOL = 0.01  # nats, mean |difference of log-probs|: the same file gives 0 here, another one 0.07 or more


def _is_gguf(path) -> bool:
    return bool(path) and str(path).lower().endswith(".gguf")


def check_served_file(model_id: str, serve_checkpoint) -> None:
    """A llama.cpp server started without an alias lists the GGUF file it loaded as its model: one that is not
    engine.serve_checkpoint (by path, else by size and first MiB) is exit 2 naming both."""
    if not (_is_gguf(model_id) and _is_gguf(serve_checkpoint)):
        return
    served, declared = Path(model_id), Path(str(serve_checkpoint))
    if served.name == declared.name and not (served.is_file() and declared.is_file()):
        return
    if served.is_file() and declared.is_file():
        if served.resolve() == declared.resolve() or os.path.samefile(served, declared):
            return
        if served.stat().st_size == declared.stat().st_size:
            with open(served, "rb") as a, open(declared, "rb") as b:
                if a.read(1 << 20) == b.read(1 << 20):
                    return
    raise QuantlabError(f"the server serves {model_id} (its /v1/models), not engine.serve_checkpoint="
                        f"{serve_checkpoint}: the run would be recorded, cached and paired in a sweep summary as a "
                        "file the server does not run",
                        fix="start the server on engine.serve_checkpoint (--model {checkpoint}), or set "
                            "engine.serve_checkpoint to the file it serves")


def identity_file(cfg) -> Path | None:
    """The GGUF file whose llama.cpp log-probs window 1 is checked against (engine.serve_checkpoint), or None where
    no check runs (see identity_skipped)."""
    import importlib.util

    path = getattr(cfg, "serve_checkpoint", None)
    if not getattr(cfg, "identity_check", True) or cfg.dialect != "llama_cpp" or not _is_gguf(path) \
            or not Path(path).is_file() or importlib.util.find_spec("llama_cpp") is None:
        return None
    return Path(path)


def identity_skipped(cfg) -> str:
    """Why which checkpoint the server runs is not checked (identity_file is None)."""
    path = getattr(cfg, "serve_checkpoint", None)
    if not getattr(cfg, "identity_check", True):
        return "engine.identity_check=false: which checkpoint the server runs is not checked"
    if not path:
        return ("engine.serve_checkpoint is not set: which checkpoint the server runs is not checked (set it to the "
                "GGUF file the server loads)")
    if cfg.dialect != "llama_cpp" or not _is_gguf(path):
        return (f"which checkpoint the server runs is not checked against {path} (the check computes a GGUF's "
                "log-probs with llama_cpp, dialect llama_cpp only)")
    if not Path(path).is_file():
        return f"engine.serve_checkpoint={path} is not a file here: which checkpoint the server runs is not checked"
    return ("llama_cpp is not importable here: which checkpoint the server runs is not checked (pip install -e "
            "'.[served]')")


def own_logprobs(path: Path, ids: list[int]):
    """llama.cpp's log-probs [len(ids), V] of ids on the GGUF file, computed in this process (llama_cpp)."""
    import llama_cpp
    import numpy as np

    _close_devnull_at_exit()
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=len(ids) + 8, n_batch=len(ids) + 8,
                          n_threads=max(1, min(2, os.cpu_count() or 1)), verbose=False)
    try:
        llm.eval(ids)
        scores = np.array(llm.scores[: len(ids)], dtype=np.float64)
        rope = {k: v for k, v in llm.metadata.items() if ".rope." in k}
    finally:
        llm.close()
    return llama_cpp.Llama.logits_to_logprobs(scores), rope


def _close_devnull_at_exit() -> None:
    """llama_cpp opens os.devnull twice at import (to silence llama.cpp) and never closes it: closed at exit, so a
    run that computed the check ends without a ResourceWarning."""
    import atexit

    from llama_cpp import _utils

    def close() -> None:
        for name in ("outnull_file", "errnull_file"):
            f = getattr(_utils, name, None)
            if f is not None and not f.closed:
                f.close()

    if not getattr(_utils, "_quantlab_closes", False):
        _utils._quantlab_closes = True
        atexit.register(close)


def check_identity(path: Path, ids: list[int], served_target: list[float], first: dict) -> dict:
    """Window 1 as served against llama.cpp's own log-probs of the same tokens on engine.serve_checkpoint.

    Position 0 (the distribution after BOS alone, where RoPE and the context size play no part) tells the weights
    apart: another checkpoint differs there. Positions 1.. tell position-dependent settings apart (a RoPE frequency
    base or scale, the context handling): the same weights agree at position 0 and not after. Either is exit 2 naming
    it; engine.identity_check=false judges such a server as it is."""
    import numpy as np

    n = min(len(ids), IDENTITY_POSITIONS + 1)
    t0 = time.time()
    own, rope = own_logprobs(path, ids[:n])
    top = np.argsort(-own[0])[:IDENTITY_TOP]
    d0 = [abs(first["lp"][int(i)] - own[0, i]) for i in top if int(i) in first["lp"]]
    dw = [abs(served_target[p] - own[p, ids[p + 1]]) for p in range(1, n - 1) if math.isfinite(served_target[p])]
    out = {"file": str(path), "positions": n - 1, "position0": float(np.mean(d0)) if d0 else math.inf,
           "window": float(np.mean(dw)) if dw else math.inf, "tolerance": IDENTITY_TOL, "seconds": 0.0}
    out["seconds"] = round(time.time() - t0, 2)
    off = "set engine.identity_check=false: the gate then judges the server as it is (a sweep summary attributes " \
          "a failure to the serving stack)"
    if out["position0"] > IDENTITY_TOL:
        raise QuantlabError(
            f"the server does not run engine.serve_checkpoint={path}: after BOS (position 0, where RoPE and the "
            f"context play no part) its log-probs of llama.cpp's {IDENTITY_TOP} likeliest tokens are "
            f"{out['position0']:.3g} nats from llama.cpp's own on that file, on average (the same file: 0 here; "
            f"tolerance {IDENTITY_TOL}): it serves another checkpoint (another file, quantization or adapter), or "
            "this one with other kernels",
            fix="start the server on that file (--model {checkpoint}), or set engine.serve_checkpoint to the file it "
                "serves; to judge a server that runs it with other kernels on purpose (a GPU, another llama.cpp "
                "build), " + off)
    if out["window"] > IDENTITY_TOL:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(rope.items())) or "none"
        raise QuantlabError(
            f"the server runs the weights of {path} (position 0 agrees: {out['position0']:.2g} nats) with other "
            f"position-dependent settings: over positions 1-{n - 2} of window 1 its log-probs of the actual tokens "
            f"are {out['window']:.3g} nats from llama.cpp's own on that file, on average (tolerance {IDENTITY_TOL}): "
            f"a RoPE setting (frequency base or scale, rope scaling) or the context handling differs from the file's "
            f"(its metadata: {shown})",
            fix="start the server with the file's own RoPE settings (drop --rope_freq_base, --rope_freq_scale, "
                f"--rope_scaling_type and the like); to judge this deployment as it is, {off}")
    log.info("served: the server runs %s as llama.cpp does here (window 1, %d positions: %.2g nats on average, "
             "position 0: %.2g; %.1f s)", path, n - 1, out["window"], out["position0"], out["seconds"])
    return out
