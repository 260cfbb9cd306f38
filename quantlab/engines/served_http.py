"""engine=served's wire: JSON over http(s) (Client: a timeout, retries with backoff, the API key from the
environment), a server's error answers as exit 2 naming the fix (its context too small, no prompt log-probs, a
refused key, another dialect), and map_batch (a batch of requests on threads, stopped at its first failure)."""
from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager

from quantlab.errors import QuantlabError

RESUME = "finished windows are kept: the same command resumes where it stopped"


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
