"""engine=served: the server engine.command starts (its template checked before anything starts, the API key
redacted wherever the command is shown, ServerProcess: started, health-checked, logged and stopped as a group)."""
from __future__ import annotations

import http.client
import logging
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
from pathlib import Path

from quantlab.engines.served_http import auth_headers
from quantlab.errors import QuantlabError

log = logging.getLogger("quantlab")


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
