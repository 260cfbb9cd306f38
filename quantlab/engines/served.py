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

This module holds the configuration check, ServedEngine, build and the cache identity; the wire (Client, error
answers, map_batch) is served_http, token texts and which checkpoint is served served_identity, the id dialects'
requests and parsers served_dialects, and the server engine.command starts served_server.
"""
from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from quantlab.engines.base import Engine, Limits, Outputs
from quantlab.engines.served_dialects import PARSERS, REQUESTS, generated_ids
from quantlab.engines.served_http import (
    Client,
    ContextTooSmall,
    malformed,
    map_batch,
    parsing,
)
from quantlab.engines.served_http import http_error as http_error  # re-exported: imported from here
from quantlab.engines.served_identity import (
    check_identity,
    check_served_file,
    identity_file,
    identity_skipped,
    text_index,
    token_texts,
)
from quantlab.engines.served_server import ServerProcess, check_command, redact_command, run_dir
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")
DIALECTS = ("llama_cpp", "vllm", "sglang", "trtllm")  # llama_cpp run here; the others written to their documented
# APIs and not run here (docs/served.md)
ID_DIALECTS = ("vllm", "sglang", "trtllm")  # they take windows as token ids
SEPARATORS = ("", "x", " x", "\n", " ", ".", "0")  # tried after a window whose text does not tokenize back


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

