"""engine=served: a running OpenAI-compatible server judged through its API on the same tokens (docs/served.md).

Each evaluation window goes to the server's completions endpoint with echo and log-probabilities; what comes back
per predicted position is the log-prob of the actual next token (so NLL and perplexity are exact) and the server's
top k alternatives (top-1 agreement exact; KL(ref || served) a lower bound, quantlab.gate.metrics.compare_sparse).
The server must see exactly the tokens quantlab scores: its tokenization of every prompt is compared with the
window, and the first differing position ends the run (exit 2) with the likely cause.

Dialect llama_cpp (llama-cpp-python's server, the one run here): it takes text prompts only, so a window is sent as
its text and the server's own tokenization (/extras/tokenize) must equal the window's ids (a window cut inside a
merge is sent with a short separator after it that makes its text tokenize back to its ids; the extra tokens are
not scored). Its echo log-probs are aligned with the prompt only when the prompt starts with BOS (without it each
token's log-prob is read from the distribution after that same token), so windows must start with BOS
(eval.prefix_token=bos); it reports no log-prob for the first prompt entry, so position 0 (the first text token after
BOS, whose context is BOS alone, the same in every window) comes from one request for the whole distribution after
BOS. Its alternatives are keyed by token text: quantlab maps each text back to the one token id with that text (a
text several ids share is ambiguous and counted).
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import os
import re
import shlex
import signal
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from quantlab.engines.base import Engine, Limits, Outputs
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")
DIALECTS = ("llama_cpp", "vllm", "sglang", "trtllm")  # llama_cpp run here; the others written to their documented
# APIs and not run here (docs/served.md)
ID_DIALECTS = ("vllm", "sglang", "trtllm")  # they take windows as token ids
SEPARATORS = ("", "x", " x", "\n", " ", ".", "0")  # tried after a window whose text does not tokenize back
RESUME = "finished windows are kept: the same command resumes where it stopped"


@dataclass
class SparseLogprobs:
    """What a server returns for [B, T] windows, per predicted position p (0..T-2, predicting token p+1):
    target [B, T-1] float64 log p(token p+1); ids [B, T-1, K] int64 top-k ids in descending order (-1: none);
    logprobs [B, T-1, K] float64 (-inf: none). `ambiguous` counts alternatives whose text named several ids."""

    target: object
    ids: object
    logprobs: object
    ambiguous: int = 0


def check_config(cfg, eval_cfg=None) -> None:
    """engine.* before any compute: an http(s) URL, a model name, k >= 1, a known dialect, the API key's variable
    set, llama_cpp windows starting with BOS (exit 2 naming the fix)."""
    if getattr(cfg, "command", None):
        check_command(cfg)
    url = cfg.base_url or ("http://127.0.0.1:1" if getattr(cfg, "command", None) else None)
    if not url:
        raise QuantlabError("engine=served needs the server's address, or the command that starts one",
                            fix="set engine.base_url=http://HOST:PORT, or engine.command='... --port {port}'")
    parsed = urlparse(url)
    if "@" in parsed.netloc:
        host = parsed.netloc.rsplit("@", 1)[1]
        raise QuantlabError(f"engine.base_url holds credentials ({parsed.scheme}://***@{host}): they would be logged "
                            "and written with the config",
                            fix="drop them from the URL; put the key in an environment variable and set "
                                "engine.api_key_env=ITS_NAME (sent as a bearer token, never written)")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise QuantlabError(f"engine.base_url={url!r} is not an http(s) URL",
                            fix="set engine.base_url=http://HOST:PORT (or https://...)")
    if not cfg.model:
        raise QuantlabError("engine=served needs the served model's name",
                            fix="set engine.model=NAME (the id the server lists under /v1/models)")
    if cfg.dialect not in DIALECTS:
        raise QuantlabError(f"engine.dialect={cfg.dialect!r} is not one quantlab runs",
                            fix=f"use one of {', '.join(DIALECTS)} (docs/served.md)")
    for knob in ("top_logprobs", "concurrency"):
        if getattr(cfg, knob) < 1:
            raise QuantlabError(f"engine.{knob}={getattr(cfg, knob)} must be 1 or more", fix=f"set engine.{knob}=1")
    if cfg.retries < 0 or cfg.timeout_s <= 0:
        raise QuantlabError("engine.retries must be >= 0 and engine.timeout_s > 0", fix="engine.retries=3 "
                            "engine.timeout_s=120")
    if cfg.api_key_env and not os.environ.get(cfg.api_key_env):
        raise QuantlabError(f"engine.api_key_env={cfg.api_key_env}: that environment variable is not set",
                            fix=f"export {cfg.api_key_env}=... (the key is read from it, never logged), or drop "
                                "engine.api_key_env")
    if eval_cfg is not None and cfg.dialect == "llama_cpp" and str(eval_cfg.prefix_token).lower() != "bos":
        raise QuantlabError("llama-cpp-python's server aligns echoed log-probs with the prompt only when it starts "
                            "with BOS (without it each token's log-prob is read after that same token)",
                            fix="add eval.prefix_token=bos (every window: BOS, then seq_len - 1 text tokens)")


class Client:
    """JSON over http(s) with a timeout, retries with backoff (connection errors, timeouts, 429 and 5xx), and the
    API key from the environment (sent as a bearer token, never logged). Every failure is a QuantlabError."""

    def __init__(self, cfg, base_url: str | None = None):
        self.base = (base_url or cfg.base_url).rstrip("/")
        self.timeout, self.retries = float(cfg.timeout_s), int(cfg.retries)
        self.down = None  # for a started server: what to say when it has exited (ServerProcess.down)
        self._key_env = cfg.api_key_env
        self.batch = threading.local()  # .abort: the Event of the batch (map_batch) this thread's request is in

    def _headers(self) -> dict:
        return auth_headers(self._key_env)

    def call(self, path: str, body: dict | None = None) -> dict:
        """GET (body None) or POST path; the parsed JSON object."""
        url = self.base + path
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
            abort = getattr(self.batch, "abort", None)
            if abort is not None and abort.is_set():
                raise QuantlabError(f"{path}: not sent, another request of the batch failed", fix=RESUME)
            try:
                req = urllib.request.Request(url, data=data, headers=self._headers(),
                                             method="GET" if body is None else "POST")
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310 - http(s) checked
                    raw = resp.read()
                break
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:400].decode("utf-8", "replace")
                if exc.code in (429, 500, 502, 503, 504) and attempt < self.retries and "logits_all" not in detail \
                        and BUFFER_ERROR not in detail:
                    last = f"HTTP {exc.code}"
                    continue
                raise http_error(url, exc.code, detail) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException) as exc:
                last = str(getattr(exc, "reason", exc)) or type(exc).__name__  # IncompleteRead, BadStatusLine, ...
        else:
            down = self.down() if self.down else None
            if down:
                raise QuantlabError(down, fix=f"see the server's log; {RESUME}")
            raise QuantlabError(f"the server at {self.base} did not answer {path} after {self.retries + 1} tries "
                                f"({last})", fix=f"start the server (or check engine.base_url), raise "
                                                 f"engine.timeout_s for a slow one; {RESUME}")
        try:
            out = json.loads(raw)
        except ValueError:
            raise malformed(url, "not JSON") from None
        if not isinstance(out, dict):
            raise malformed(url, "not a JSON object")
        return out


def auth_headers(key_env: str | None) -> dict:
    """The request headers: JSON, and the API key from the environment variable key_env as a bearer token."""
    headers = {"Content-Type": "application/json"}
    if key_env:
        headers["Authorization"] = "Bearer " + os.environ.get(key_env, "")
    return headers


CONTEXT_ERRORS = (  # (pattern, group of the server's context, group of the tokens asked for, + what they leave out)
    # llama-cpp-python's server and vLLM (OpenAI's wording): "maximum context length is N tokens, however you
    # requested R tokens (P in your prompt; 1 for the completion)"
    (re.compile(r"maximum context length is (\d+) tokens[.,]? however,? you requested (\d+) tokens", re.I), 1, 2, 0),
    # llama_cpp's own ValueError, where a server passes it through
    (re.compile(r"Requested tokens \((\d+)\) exceed context window of (\d+)"), 2, 1, 1),  # the prompt alone
    # SGLang (written to its wording, not run here): "The input (R tokens) is longer than the model's context length
    # (N tokens)"
    (re.compile(r"input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)"), 2, 1, 1),
)


BUFFER_ERROR = "could not broadcast input array from shape"  # llama-cpp-python: a prompt over its --n_ctx


class ContextTooSmall(QuantlabError):
    """A request the server's context cannot hold (exit 2): its context size (n_ctx) where the server said it."""

    def __init__(self, message: str, *, fix: str, n_ctx: int | None = None):
        super().__init__(message, fix=fix)
        self.n_ctx = n_ctx


def context_error(url: str, detail: str) -> QuantlabError | None:
    """A server's "the prompt does not fit my context" answer as exit 2 naming its context size and the fix; None
    for any other answer. llama-cpp-python allocates --n_ctx positions while llama.cpp rounds its context up (to
    256 here), so a prompt between the two fails in its buffers (a numpy broadcast error, HTTP 500): that is named
    as a context too small as well (the engine adds the prompt's length, ServedEngine.completion)."""
    if BUFFER_ERROR in detail:
        return ContextTooSmall(f"the server at {url} failed on a prompt longer than its context (llama-cpp-python's "
                               f"buffers hold --n_ctx positions: {detail.strip()[:160]})",
                               fix="restart the server with a larger --n_ctx (a window's eval.seq_len tokens plus "
                                   "2), or lower eval.seq_len")
    for pattern, n_group, need_group, plus in CONTEXT_ERRORS:
        m = pattern.search(detail)
        if m:
            n_ctx, need = int(m.group(n_group)), int(m.group(need_group)) + plus  # + the one generated token
            return ContextTooSmall(
                f"the server's context is {n_ctx} tokens and the request needs {need} (a window: its eval.seq_len "
                f"tokens, the prefix token included, and one generated): the server at {url} refused it before "
                "computing anything",
                fix=f"restart the server with a context of at least {need} tokens (llama-cpp-python: --n_ctx {need}; "
                    f"llama.cpp's llama-server: --ctx-size {need}; vLLM: --max-model-len {need}), or lower "
                    f"eval.seq_len by {need - n_ctx}", n_ctx=n_ctx)
    return None


def http_error(url: str, code: int, detail: str) -> QuantlabError:
    """The QuantlabError of an HTTP error answer, with the fix its status (or its text) points to."""
    ctx = context_error(url, detail) if code in (400, 413, 422, 500) else None
    if ctx is not None:
        return ctx
    if "logits_all" in detail:
        return QuantlabError(f"the server at {url} returns no prompt log-probabilities ({detail.strip()[:200]})",
                             fix="start llama-cpp-python's server with --logits_all true")
    if code in (401, 403):
        return QuantlabError(f"the server refused the request to {url} (HTTP {code}): a missing or wrong API key",
                             fix="put the key in an environment variable and set engine.api_key_env=ITS_NAME")
    if code == 404:
        return QuantlabError(f"{url} does not exist (HTTP 404): not an OpenAI-compatible server, or another dialect",
                             fix="check engine.base_url (no /v1 suffix) and engine.dialect")
    return QuantlabError(f"the server answered {url} with HTTP {code}: {detail.strip()[:300]}",
                         fix=f"check the server's log; {RESUME}")


def malformed(url: str, what: str) -> QuantlabError:
    """A response that does not have the expected shape."""
    return QuantlabError(f"malformed response from {url}: {what}",
                         fix="check that engine.dialect matches the server (docs/served.md)")


@contextmanager
def parsing(where: str):
    """Any ValueError, TypeError, IndexError, KeyError, AttributeError or OverflowError while reading a response
    (a field of another type or shape than the dialect documents) is the malformed-response error naming where."""
    try:
        yield
    except QuantlabError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError) as exc:
        raise malformed(where, f"{type(exc).__name__}: {str(exc)[:200]}") from None


def map_batch(fn, items: list, workers: int, client: Client | None = None) -> list:
    """[fn(x) for x in items] on `workers` threads; the first failure cancels what has not started, tells the
    requests in flight to stop retrying (the batch's abort event) and is raised at once (not after the batch)."""
    abort = threading.Event()

    def one(x):
        if client is not None:
            client.batch.abort = abort  # this pool's threads serve this batch only
        return fn(x)

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = [pool.submit(one, x) for x in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
        if failed is not None:
            abort.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise failed.exception()
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


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


# --------------------------------------------------------------------------------------------- the engine
class ServedEngine(Engine):
    """The llama_cpp dialect over a running llama-cpp-python server (see the module doc)."""

    name = "served"

    def __init__(self, cfg, tokenizer, limits: Limits, server: ServerProcess | None = None):
        super().__init__(limits, "cpu")
        self.server = server
        self.cfg, self.client, self.tok = cfg, Client(cfg, server.url if server else None), tokenizer
        if server is not None:
            self.client.down = server.down
        self.bos = tokenizer.bos_token_id
        self.texts, whole = token_texts(tokenizer)
        self.index, self.shared = text_index(self.texts, whole)
        self._first: dict | None = None
        self._lock = threading.Lock()
        self.repeat: dict | None = None
        self.identity: dict | None = None  # check_identity's measurement, once window 1 was served
        self.check_server()
        if identity_file(cfg) is None:
            log.info("served: %s", identity_skipped(cfg))

    def check_server(self) -> None:
        """The server answers /v1/models and serves engine.model (llama-cpp-python answers any name with its
        default model, so a wrong name is caught here)."""
        url = self.client.base + "/v1/models"
        data = self.client.call("/v1/models").get("data")
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise malformed(url, "no list of models under 'data'")
        ids = [m["id"] for m in data]
        if self.cfg.model not in ids:
            raise QuantlabError(f"the server at {self.client.base} does not serve engine.model={self.cfg.model!r} "
                                f"(it serves: {', '.join(map(repr, ids)) or 'nothing'})",
                                fix="set engine.model to one of those, or start the server with that model")
        check_served_file(self.cfg.model, getattr(self.cfg, "serve_checkpoint", None))

    # -------------------------------------------------------------------------------------------- wire
    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def server_tokens(self, text: str) -> list[int]:
        """The server's own tokenization of a text."""
        out = self.client.call("/extras/tokenize", {"input": text, "model": self.cfg.model}).get("tokens")
        if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
            raise malformed(self.client.base + "/extras/tokenize", "no list of token ids under 'tokens'")
        return out

    def prompt_text(self, ids: list[int]) -> str:
        """A text the server tokenizes into ids (then possibly a few extra tokens); exit 2 at the first differing
        position otherwise."""
        text = self._text(ids)
        got: list[int] = []
        for sep in SEPARATORS:
            got = self.server_tokens(text + sep)
            if got[: len(ids)] == ids:
                return text + sep
        d = next((i for i, (a, b) in enumerate(zip(ids, got, strict=False)) if a != b), min(len(ids), len(got)))
        ours = self.texts[ids[d]] if d < len(ids) else "(end)"
        theirs = self.texts[got[d]] if d < len(got) and 0 <= got[d] < len(self.texts) else "(end)"
        if d == 0 and got[:1] == [self.bos] and ids[:1] != [self.bos]:
            cause = "the server adds BOS itself (its model's add_bos_token): a second BOS"
        elif self._text(got[d:]).startswith(self._text(ids[d: d + 4])[:1] or "\0"):
            cause = ("the server splits the same text into other tokens: its tokenizer is not the model's on this "
                     "text (llama.cpp's own tokenizer splits some runs of whitespace unlike transformers'; start "
                     "llama-cpp-python's server with --hf_pretrained_model_name_or_path MODEL_DIR, the model's "
                     "tokenizer, so that it tokenizes as the model does)")
        else:
            cause = ("the server's tokenizer is not the model's (another checkpoint or vocabulary), or a chat "
                     "template / BOS is applied to the prompt")
        raise QuantlabError(f"the server does not see the tokens sent: first difference at position {d} (sent id "
                            f"{ids[d] if d < len(ids) else None} {ours!r}, the server has id "
                            f"{got[d] if d < len(got) else None} {theirs!r}); likely cause: {cause}",
                            fix="serve the same checkpoint and tokenizer quantlab evaluates (the model's GGUF), "
                                "without a chat template; or check eval.prefix_token")

    def completion(self, prompt: str, need: int | None = None, **extra) -> dict:
        """One /v1/completions request (temperature 0); the first choice, validated. need: the tokens the request
        needs in the server's context (named where the server fails on its context without saying its size)."""
        url = self.client.base + "/v1/completions"
        body = {"model": self.cfg.model, "prompt": prompt, "temperature": 0.0, **extra}
        try:
            out = self.client.call("/v1/completions", body)
        except ContextTooSmall as exc:
            if exc.n_ctx is not None or need is None:
                raise
            raise ContextTooSmall(f"the server's context is shorter than the request's {need} tokens (a window: its "
                                  "eval.seq_len tokens, the prefix token included, and one generated): llama-cpp-"
                                  "python failed on it in its buffers, which hold --n_ctx positions",
                                  fix=f"restart the server with a context of at least {need} tokens (llama-cpp-python: "
                                      f"--n_ctx {need}), or lower eval.seq_len") from None
        choices = out.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise malformed(url, "no 'choices'")
        return choices[0]

    def _logprobs(self, choice: dict, url: str) -> dict:
        lp = choice.get("logprobs")
        if not isinstance(lp, dict):
            raise QuantlabError(f"the server at {url} returned no log-probabilities",
                                fix="start llama-cpp-python's server with --logits_all true")
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            if not isinstance(lp.get(key), list):
                raise malformed(url, f"logprobs has no list '{key}'")
        if not (len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])):
            raise malformed(url, "logprobs lists of different lengths")
        return lp

    def _top(self, entry, k: int) -> tuple[list, list, int]:
        """A top_logprobs dict -> (ids, log-probs) of its first k texts mapped to ids, and the ambiguous count.

        llama-cpp-python builds the dict from the ids in descending order, keyed by text: a text several ids share
        keeps the place of the most probable of them but the value of the last one written (a less probable id, or
        the actual token's); so entries are taken in the server's order, a shared text is the id of its whole-token
        owner (text_index), its value is raised to the next entry's where it fell below, and it is counted as
        ambiguous. A text no single id owns is skipped (counted)."""
        if not isinstance(entry, dict) or not all(isinstance(v, (int, float)) for v in entry.values()):
            raise malformed(self.client.base + "/v1/completions", "a top_logprobs entry is not {text: number}")
        items = list(entry.items())[:k]
        ids, lps, amb = [], [], 0
        for n, (text, value) in enumerate(items):  # JSON object keys: always strings
            i = self.index.get(text)
            if text in self.shared:
                amb += 1
            if i is None:
                continue
            value = float(value)
            if text in self.shared and n + 1 < len(items):
                value = max(value, float(items[n + 1][1]))
            ids.append(i)
            lps.append(value)
        return ids, lps, amb

    def first_position(self) -> dict:
        """The distribution after BOS alone (position 0 of every window): one request for all of it."""
        with self._lock:
            if self._first is None:
                url = self.client.base + "/v1/completions"
                choice = self.completion(self._text([self.bos]), max_tokens=1, echo=False, logprobs=len(self.texts))
                top = self._logprobs(choice, url)["top_logprobs"]
                if not top or not isinstance(top[0], dict):
                    raise malformed(url, "no top_logprobs for the token after BOS")
                ids, lps, amb = self._top(top[0], len(self.texts))
                self._first = {"lp": dict(zip(ids, lps, strict=True)), "ids": ids, "lps": lps, "ambiguous": amb}
        return self._first

    def window(self, ids: list[int]) -> tuple[list, list, list, int]:
        """One window -> per position (target log-prob, top ids, top log-probs) and the ambiguous count."""
        k, url = int(self.cfg.top_logprobs), self.client.base + "/v1/completions"
        if self.cfg.dialect in ID_DIALECTS:
            path, body = REQUESTS[self.cfg.dialect](self.cfg.model, ids, k)
            out = self.client.call(path, body)
            with parsing(self.client.base + path):
                return (*PARSERS[self.cfg.dialect](out, ids, k, self.client.base + path), 0)
        if ids[0] != self.bos:
            raise QuantlabError("a window does not start with BOS, which llama-cpp-python's server needs",
                                fix="add eval.prefix_token=bos")
        prompt = self.prompt_text(ids)
        lp = self._logprobs(self.completion(prompt, len(ids) + 1, max_tokens=1, echo=True, logprobs=k), url)
        n = len(ids) - 1  # predicted positions; the server drops the leading BOS from its echo
        if len(lp["tokens"]) < n + 1:
            raise malformed(url, f"{len(lp['tokens'])} echoed tokens for a prompt of {len(ids)} (BOS dropped) plus one "
                                 "generated")
        with parsing(url):
            return self._window_logprobs(ids, lp, k, url)

    def _window_logprobs(self, ids: list[int], lp: dict, k: int, url: str) -> tuple[list, list, list, int]:
        import math as _m

        n = len(ids) - 1
        for p in range(1, n):  # the echoed texts are the texts of the ids sent
            if lp["tokens"][p] != self.texts[ids[p + 1]]:
                raise QuantlabError(f"the server echoed {lp['tokens'][p]!r} at position {p + 1} where "
                                    f"{self.texts[ids[p + 1]]!r} was sent",
                                    fix="serve the model's own tokenizer, without a chat template")
        first = self.first_position()
        target = [first["lp"].get(ids[1], -_m.inf)]
        tops = [(first["ids"][:k], first["lps"][:k])]
        amb = int(ids[1] not in first["lp"])
        for p in range(1, n):
            value = lp["token_logprobs"][p]
            if not isinstance(value, (int, float)):
                raise malformed(url, f"token_logprobs[{p}] is not a number")
            target.append(float(value))
            t_ids, t_lps, a = self._top(lp["top_logprobs"][p], k)
            tops.append((t_ids, t_lps))
            amb += a
        return target, [t[0] for t in tops], [t[1] for t in tops], amb

    # ---------------------------------------------------------------------------------------- engine API
    def _forward(self, tokens) -> Outputs:
        import torch

        rows = [row.tolist() for row in tokens.cpu()]
        first = []
        if self.identity is None and identity_file(self.cfg) is not None:  # window 1 alone, checked, then the rest
            first = [self.window(rows[0])]
            self.identity = check_identity(identity_file(self.cfg), rows[0], first[0][0], self.first_position())
        results = first + map_batch(self.window, rows[len(first):], int(self.cfg.concurrency), self.client)
        k = int(self.cfg.top_logprobs)
        b, n = len(rows), len(rows[0]) - 1
        ids = torch.full((b, n, k), -1, dtype=torch.int64)
        lps = torch.full((b, n, k), -math.inf, dtype=torch.float64)
        target = torch.empty((b, n), dtype=torch.float64)
        amb = 0
        for i, (t, top_ids, top_lps, a) in enumerate(results):
            target[i] = torch.tensor(t, dtype=torch.float64)
            amb += a
            for p, (pi, pl) in enumerate(zip(top_ids, top_lps, strict=True)):
                ids[i, p, : len(pi)] = torch.tensor(pi, dtype=torch.int64)
                lps[i, p, : len(pl)] = torch.tensor(pl, dtype=torch.float64)
        return Outputs(sparse=SparseLogprobs(target, ids, lps, amb))

    def repeat_check(self, tokens) -> float:
        """The server's own noise: one window sent twice; the largest |difference| of its target log-probs."""
        a = self.window(tokens[0].tolist())[0]
        b = self.window(tokens[0].tolist())[0]
        return max((abs(x - y) for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y)),
                   default=0.0)

    def greedy(self, prompts, new_tokens: int):
        """Greedy continuations through the completions API (temperature 0), ids read back from the returned token
        texts (a text several ids share, or an early stop at EOS, is -1: a divergence from there)."""
        import torch

        self.limits.check(prompts.shape[0], prompts.shape[1], new_tokens)
        url = self.client.base + "/v1/completions"

        def one(row):
            if self.cfg.dialect in ID_DIALECTS:
                return generated_ids(self, row, new_tokens)
            choice = self.completion(self.prompt_text(row), len(row) + new_tokens, max_tokens=new_tokens, echo=False,
                                     logprobs=1)
            texts = self._logprobs(choice, url)["tokens"]
            if not all(isinstance(t, str) for t in texts):
                raise malformed(url, "a generated token's text is not a string")
            if len(texts) < new_tokens and choice.get("finish_reason") == "length":  # llama_cpp cuts max_tokens to
                # what its context has left, silently: the continuation would read as a divergence
                raise QuantlabError(f"the server stopped a greedy continuation at {len(texts)} of {new_tokens} "
                                    f"tokens after a prompt of {len(row)}: its context is too small",
                                    fix=f"restart the server with a context of at least {len(row) + new_tokens + 1} "
                                        "tokens (llama-cpp-python: --n_ctx), or lower eval.gen_prompt_len / "
                                        "eval.gen_tokens")
            got = [self.index.get(t) for t in texts][:new_tokens]
            return [-1 if g is None else g for g in got] + [-1] * (new_tokens - len(got))

        out = map_batch(one, [row.tolist() for row in prompts.cpu()], int(self.cfg.concurrency), self.client)
        self.forward_batches += 1
        return torch.tensor(out, dtype=torch.int64)

    def close(self) -> None:
        """Stop the server quantlab started (a server at engine.base_url is left running)."""
        if self.server is not None:
            self.server.stop()


# ------------------------------------------------------------------------------ dialects that take token ids
# Written to the servers' documented APIs and NOT run here (no GPU serving stack on the project's machines):
#   vllm   POST /v1/completions, prompt as token ids, the `prompt_logprobs` extra parameter (k capped by the server's
#          --max-logprobs, default 20); choices[0].prompt_logprobs: one entry per prompt token, None first, else
#          {"<id>": {"logprob", "rank", "decoded_token"}} holding the top k and the prompt's own token.
#   sglang POST /generate (native API) with input_ids, return_logprob, logprob_start_len 0, top_logprobs_num k;
#          meta_info.input_token_logprobs [[logprob | None, id, text | None], ...] and input_top_logprobs.
#   trtllm POST /v1/completions (trtllm-serve), prompt as token ids, return_context_logits (the full [T, V] logits
#          of the prompt; its TensorRT backend needs an engine built with context logits gathered).
def _vllm_request(model, ids, k):
    return "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                               "prompt_logprobs": k, "add_special_tokens": False}


def _sglang_request(_model, ids, k):
    return "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                         "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k}


def _trtllm_request(model, ids, _k):
    return "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                               "return_context_logits": True, "add_special_tokens": False}


def echo_mismatch(ids: list[int], got: list[int], where: str) -> QuantlabError:
    """The server's prompt is not the window: exit 2 naming the first differing position and the likely cause."""
    d = next((i for i, (a, b) in enumerate(zip(ids, got, strict=False)) if a != b), min(len(ids), len(got)))
    cause = ("the server added a token (BOS) to the prompt" if len(got) > len(ids) and got[1:] == ids[: len(got) - 1]
             else "the server's tokenizer or checkpoint is not the one quantlab evaluates")
    return QuantlabError(f"the server at {where} does not see the tokens sent: {len(got)} prompt tokens for "
                         f"{len(ids)} sent, first difference at position {d}; likely cause: {cause}",
                         fix="serve the checkpoint and tokenizer quantlab evaluates, with no template or BOS added "
                             "(add_special_tokens is sent false)")


def _choice(out: dict, where: str) -> dict:
    choices = out.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed(where, "no 'choices'")
    return choices[0]


def _number(value, where: str, what: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise malformed(where, f"{what} is not a number")
    return float(value)


def parse_vllm(out: dict, ids: list[int], k: int, where: str) -> tuple[list, list, list]:
    """vLLM's prompt_logprobs -> per predicted position (target log-prob, top ids, top log-probs)."""
    plp = _choice(out, where).get("prompt_logprobs")
    if not isinstance(plp, list):
        raise QuantlabError(f"the server at {where} returned no prompt_logprobs",
                            fix="use a vLLM with prompt_logprobs on /v1/completions, started with --max-logprobs "
                                f">= engine.top_logprobs ({k})")
    if len(plp) != len(ids):
        raise echo_mismatch(ids, [-1] * len(plp), where)
    target, tops_i, tops_l = [], [], []
    for p in range(1, len(ids)):
        entry = plp[p]
        if not isinstance(entry, dict) or not all(isinstance(v, dict) for v in entry.values()):
            raise malformed(where, f"prompt_logprobs[{p}] is not {{id: {{logprob, rank}}}}")
        if str(ids[p]) not in entry:  # vLLM always lists the prompt's own token: another one means another prompt
            raise echo_mismatch(ids, [*ids[:p], -1], where)
        target.append(_number(entry[str(ids[p])].get("logprob"), where, f"prompt_logprobs[{p}] logprob"))
        ranked = sorted(((_number(v.get("logprob"), where, "a logprob"), int(key)) for key, v in entry.items()
                         if isinstance(v.get("rank"), int) and v["rank"] <= k), reverse=True)[:k]
        tops_i.append([i for _, i in ranked])
        tops_l.append([lp for lp, _ in ranked])
    return target, tops_i, tops_l


def parse_sglang(out: dict, ids: list[int], k: int, where: str) -> tuple[list, list, list]:
    """SGLang's input_token_logprobs / input_top_logprobs -> per predicted position (target, top ids, top lps)."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict) or not isinstance(meta.get("input_token_logprobs"), list):
        raise QuantlabError(f"the server at {where} returned no input_token_logprobs",
                            fix="use SGLang's native /generate with return_logprob (engine.dialect=sglang)")
    toks, tops = meta["input_token_logprobs"], meta.get("input_top_logprobs")
    if not all(isinstance(t, list) and len(t) >= 2 for t in toks) or not isinstance(tops, list) \
            or len(tops) != len(toks):
        raise malformed(where, "input_token_logprobs / input_top_logprobs are not lists of [logprob, id, text]")
    got = [t[1] for t in toks]
    if got != ids:
        raise echo_mismatch(ids, got, where)
    target, tops_i, tops_l = [], [], []
    for p in range(1, len(ids)):
        target.append(_number(toks[p][0], where, f"input_token_logprobs[{p}]"))
        row = tops[p] if isinstance(tops[p], list) else []
        ranked = sorted(((_number(t[0], where, "a top logprob"), int(t[1])) for t in row), reverse=True)[:k]
        tops_i.append([i for _, i in ranked])
        tops_l.append([lp for lp, _ in ranked])
    return target, tops_i, tops_l


def parse_trtllm(out: dict, ids: list[int], k: int, where: str) -> tuple[list, list, list]:
    """trtllm-serve's context_logits [T, V] -> per predicted position (target, top ids, top log-probs)."""
    import numpy as np

    choice = _choice(out, where)
    logits = choice.get("context_logits")
    if not isinstance(logits, list) or len(logits) != len(ids):
        raise QuantlabError(f"the server at {where} returned no context logits for the {len(ids)} prompt tokens",
                            fix="start trtllm-serve with context logits gathered (the TensorRT backend: an engine "
                                "built with --gather_context_logits)")
    sent = out.get("prompt_token_ids")
    if isinstance(sent, list) and sent and sent != ids:
        raise echo_mismatch(ids, sent, where)
    usage = out.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int) and usage["prompt_tokens"] != len(ids):
        raise echo_mismatch(ids, [-1] * usage["prompt_tokens"], where)
    x = np.asarray(logits[:-1], dtype=np.float64)
    lp = x - x.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    top = np.argsort(-lp, -1)[:, :k]
    rows = np.arange(len(ids) - 1)
    return (lp[rows, ids[1:]].tolist(), top.tolist(), np.take_along_axis(lp, top, -1).tolist())


REQUESTS = {"vllm": _vllm_request, "sglang": _sglang_request, "trtllm": _trtllm_request}
PARSERS = {"vllm": parse_vllm, "sglang": parse_sglang, "trtllm": parse_trtllm}


def generated_ids(engine: ServedEngine, row: list[int], n: int) -> list[int]:
    """Greedy continuation ids from an id dialect (vLLM: return_tokens_as_token_ids; SGLang: the output tokens'
    ids; trtllm-serve: the choice's token_ids); -1 past an early stop."""
    path = "/generate" if engine.cfg.dialect == "sglang" else "/v1/completions"
    with parsing(engine.client.base + path):
        return _generated_ids(engine, row, n)


def _generated_ids(engine: ServedEngine, row: list[int], n: int) -> list[int]:
    client, model = engine.client, engine.cfg.model
    if engine.cfg.dialect == "sglang":
        out = client.call("/generate", {"input_ids": row, "return_logprob": True, "logprob_start_len": len(row),
                                        "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                                                            "ignore_eos": True}})
        toks = (out.get("meta_info") or {}).get("output_token_logprobs")
        got = [t[1] for t in toks] if isinstance(toks, list) else None
    else:
        body = {"model": model, "prompt": row, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                "add_special_tokens": False}
        if engine.cfg.dialect == "vllm":
            body.update(logprobs=1, return_tokens_as_token_ids=True)
        choice = _choice(client.call("/v1/completions", body), client.base + "/v1/completions")
        if engine.cfg.dialect == "vllm":
            texts = (choice.get("logprobs") or {}).get("tokens")
            got = [int(t.split(":", 1)[1]) for t in texts] if isinstance(texts, list) and all(
                isinstance(t, str) and t.startswith("token_id:") for t in texts) else None
        else:
            got = choice.get("token_ids")
    if not isinstance(got, list) or not all(isinstance(i, int) for i in got):
        raise malformed(client.base, "no generated token ids")
    return got[:n] + [-1] * (n - len(got[:n]))


def build(cfg, inputs, limits: Limits) -> ServedEngine:
    """engine=served: the server at engine.base_url, or the one engine.command starts (stopped on close, on any
    error and at exit), checked (reachable, serving engine.model) before use."""
    from quantlab.models import load_tokenizer

    check_config(cfg)
    tokenizer = load_tokenizer(inputs.ref)
    server = ServerProcess(cfg, run_dir()) if cfg.command else None
    try:
        return ServedEngine(cfg, tokenizer, limits, server)
    except BaseException:
        if server is not None:
            server.stop()
        raise


def identity(cfg) -> dict:
    """What names the served candidate in the cache: the server (its URL, or the command), the checkpoint file it
    serves (engine.serve_checkpoint, by size and mtime; for a server at a URL, the file it is declared to serve), the
    model name, k, the dialect and engine.revision."""
    out = {"model": cfg.model, "k": cfg.top_logprobs, "dialect": cfg.dialect, "revision": cfg.revision}
    if getattr(cfg, "command", None):
        out["command"] = redact_command(cfg.command)
    else:
        out["url"] = cfg.base_url
    if cfg.serve_checkpoint:
        path = Path(cfg.serve_checkpoint)
        stat = path.stat() if path.exists() else None
        out["checkpoint"] = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}" if stat else str(path)
    return out


# ------------------------------------------------------------------------------------- a started server
def check_command(cfg) -> None:
    """engine.command before anything starts: a template whose only fields are {port} (required), {checkpoint}
    (which needs engine.serve_checkpoint, an existing path) and {api_key} (which needs engine.api_key_env), and no
    engine.base_url beside it."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(cfg.command) if f is not None}
    except ValueError as exc:
        raise QuantlabError(f"engine.command is not a template: {exc}",
                            fix="write literal braces as {{ }}; name only {port}, {checkpoint} and {api_key}") from None
    if fields - set(FIELDS):
        raise QuantlabError(f"engine.command names {', '.join(sorted(fields - set(FIELDS)))}: only {{port}}, "
                            "{checkpoint} and {api_key} are filled in",
                            fix="name only {port}, {checkpoint} and {api_key}")
    if "api_key" in fields and not cfg.api_key_env:
        raise QuantlabError("engine.command names {api_key} but engine.api_key_env is not set",
                            fix="export KEY_VAR=... and set engine.api_key_env=KEY_VAR (the key is filled in only "
                                "where the server is started, never logged or written)")
    if LITERAL_KEY.search(cfg.command) and "{api_key}" not in LITERAL_KEY.search(cfg.command).group(0):
        log.warning("served: engine.command holds a literal API key: it is redacted where quantlab logs the command, "
                    "but the config (run.json) keeps it; use --api-key {api_key} with engine.api_key_env instead")
    if "port" not in fields:
        raise QuantlabError("engine.command has no {port}: quantlab picks a free port and must tell the server",
                            fix="add --port {port} (or the server's own flag) to engine.command")
    if cfg.base_url:
        raise QuantlabError("engine.base_url and engine.command are both set",
                            fix="drop engine.base_url (the started server's address is http://127.0.0.1:{port})")
    if cfg.serve_checkpoint and "checkpoint" not in fields and str(cfg.serve_checkpoint) not in cfg.command \
            and Path(cfg.serve_checkpoint).name not in cfg.command:
        raise QuantlabError(f"engine.command does not name {{checkpoint}} nor engine.serve_checkpoint="
                            f"{cfg.serve_checkpoint}: the server would load what its command names, and the run "
                            "(its cache entry, the sweep summary's pairing) would be recorded as that file",
                            fix="write {checkpoint} where the command names the model file (--model {checkpoint})")
    if "checkpoint" in fields:
        if not cfg.serve_checkpoint:
            raise QuantlabError("engine.command names {checkpoint} but engine.serve_checkpoint is not set",
                                fix="set engine.serve_checkpoint=PATH (the file or directory the server loads)")
        if not Path(cfg.serve_checkpoint).exists():
            raise QuantlabError(f"engine.serve_checkpoint={cfg.serve_checkpoint} does not exist",
                                fix="point engine.serve_checkpoint at the checkpoint the server loads")
    if not shlex.split(cfg.command):
        raise QuantlabError("engine.command is empty", fix="give the server's command line")


FIELDS = ("port", "checkpoint", "api_key")
LITERAL_KEY = re.compile(r"(--api[-_]key)(=|\s+)('[^']*'|\"[^\"]*\"|\S+)")
REDACTED = "***"


def redact_command(command: str) -> str:
    """A command line with the value after --api-key (or --api-key=) replaced by ***."""
    return LITERAL_KEY.sub(lambda m: m.group(1) + m.group(2) + REDACTED, command)


def run_dir() -> Path:
    """The run directory of the run being executed (its server log goes there); a temporary one outside a run."""
    from quantlab import progress

    dirs = getattr(progress, "_in_run", None)
    if dirs:
        return Path(dirs[-1])
    import tempfile

    return Path(tempfile.mkdtemp(prefix="quantlab-served-"))


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LIVE: list = []  # started servers not yet stopped
_SIGTERM = {"installed": False, "previous": None}
_LIVE_LOCK = threading.Lock()


def _sigterm(signum, _frame):
    raise SystemExit(128 + signum)


def _track(server, alive: bool) -> None:
    """While a started server lives, SIGTERM (scancel, docker stop, timeout) raises SystemExit in quantlab, so that
    the handlers that stop it run (close, the error paths, atexit); the previous handler is put back when the last
    one stops. Only the main thread can set a handler: elsewhere nothing changes."""
    with _LIVE_LOCK:
        if alive:
            _LIVE.append(server)
        elif server in _LIVE:
            _LIVE.remove(server)
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if _LIVE and not _SIGTERM["installed"]:
                _SIGTERM["previous"] = signal.getsignal(signal.SIGTERM)
                signal.signal(signal.SIGTERM, _sigterm)
                _SIGTERM["installed"] = True
            elif not _LIVE and _SIGTERM["installed"]:
                if signal.getsignal(signal.SIGTERM) is _sigterm:
                    previous = _SIGTERM["previous"]
                    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
                _SIGTERM["installed"] = False
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            pass


def _death_signal():
    """On Linux, a preexec_fn that has the started server get SIGTERM when quantlab dies (PR_SET_PDEATHSIG: also on
    SIGKILL, where no handler of quantlab's runs); None where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent, term = os.getpid(), int(signal.SIGTERM)

    def set_death_signal() -> None:
        prctl(1, term)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # quantlab died before the call
            os.kill(os.getpid(), term)

    return set_death_signal


def _group_alive(pgid: int, proc=None) -> bool:
    """Whether a process of group pgid still runs (zombies do not count: an orphaned worker is not always reaped)."""
    if proc is not None:
        proc.poll()  # reap the leader
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc/self"):
        return True
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


class ServerProcess:
    """engine.command started on localhost in its own process group (the whole group is stopped: a launcher and
    its workers), health-checked on /v1/models within engine.startup_timeout_s (with the API key), its output in
    RUN_DIR/server.log, stopped on close, on error, at exit and on SIGTERM; on Linux it gets SIGTERM when quantlab
    dies. {api_key} is filled in only in what is started: what is logged or raised shows *** for the key."""

    grace_s = 10.0  # SIGTERM to the group, then SIGKILL to what remains after this

    def __init__(self, cfg, log_dir: Path):
        import atexit

        self._stopped = False
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._key_env = getattr(cfg, "api_key_env", None)
        key = os.environ.get(self._key_env, "") if self._key_env else ""
        self._secrets = {v for v in [key, *(m.group(3).strip("'\"") for m in LITERAL_KEY.finditer(cfg.command))]
                         if v and v != "{api_key}"}
        ckpt = shlex.quote(str(cfg.serve_checkpoint)) if cfg.serve_checkpoint else ""
        argv = shlex.split(cfg.command.format(port=self.port, checkpoint=ckpt, api_key=shlex.quote(key)))
        shown = shlex.join(shlex.split(cfg.command.format(port=self.port, checkpoint=ckpt, api_key=REDACTED)))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "server.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        log.info("served: starting %s (log %s)", self._redact(redact_command(shown)), self.log_path)
        try:
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_death_signal())  # noqa: PLW1509
        except OSError as exc:
            self._log.close()
            raise QuantlabError(f"engine.command could not start: {self._redact(str(exc))}",
                                fix="check the command's first word (on PATH?) and its arguments") from None
        atexit.register(self.stop)
        _track(self, True)
        try:
            self._wait(float(cfg.startup_timeout_s))
        except BaseException:
            self.stop()
            raise

    def _redact(self, text: str) -> str:
        for secret in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(secret, REDACTED)
        return text

    def _tail(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self._redact(self.log_path.read_bytes()[-1500:].decode("utf-8", "replace").strip())

    def _refused(self, code: int) -> QuantlabError:
        var = self._key_env
        if var:
            return QuantlabError(f"the server engine.command started refused {self.url}/v1/models (HTTP {code}): "
                                 f"it does not accept the key in ${var} (engine.api_key_env)",
                                 fix=f"start the server with the key in ${var}: --api-key {{api_key}} in "
                                     "engine.command (filled in from it, never logged)")
        return QuantlabError(f"the server engine.command started refused {self.url}/v1/models (HTTP {code}): it "
                             "wants an API key and engine.api_key_env is not set",
                             fix="export KEY_VAR=..., set engine.api_key_env=KEY_VAR and start the server with "
                                 "--api-key {api_key} in engine.command")

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        req = urllib.request.Request(self.url + "/v1/models", headers=auth_headers(self._key_env))
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise QuantlabError(f"the server engine.command started exited with code {code} before answering; "
                                    f"the end of {self.log_path}:\n{self._tail()}",
                                    fix="fix the server's command line (its log says why it stopped)")
            try:
                with urllib.request.urlopen(req, timeout=2):  # noqa: S310 - localhost http
                    return
            except urllib.error.HTTPError as exc:
                exc.close()
                if exc.code in (401, 403):
                    raise self._refused(exc.code) from None
                return  # it answers: up (the client's retries handle a 503 while it loads)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException):
                time.sleep(0.3)
        raise QuantlabError(f"the server engine.command started did not answer {self.url}/v1/models within "
                            f"{timeout:g} s (log: {self.log_path})",
                            fix="raise engine.startup_timeout_s for a server that loads slowly, or check its log")

    def down(self) -> str | None:
        """A sentence naming the server as exited (with its exit code and log), None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"the server quantlab started exited mid-run (code {code}); the end of {self.log_path}:\n{self._tail()}"

    def stop(self) -> None:
        """SIGTERM to the process group (also when its leader has exited: its workers), SIGKILL to what is left of
        the group after grace_s; idempotent."""
        import atexit

        proc = getattr(self, "proc", None)
        if proc is not None and not self._stopped:
            self._stopped = True
            pgid = proc.pid
            try:
                os.killpg(pgid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + self.grace_s
            while _group_alive(pgid, proc) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(pgid, proc):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                deadline = time.monotonic() + 5  # SIGKILL is delivered at once, the exit is not: return when it is
                while _group_alive(pgid, proc) and time.monotonic() < deadline:
                    time.sleep(0.02)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            atexit.unregister(self.stop)
        _track(self, False)
        if not self._log.closed:
            self._log.close()
