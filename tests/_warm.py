"""`python -m quantlab` as a real child process that starts warm: forked from a parent that has imported the heavy
third-party libraries (torch, transformers, ModelOpt, Hydra, matplotlib) once per test worker.

Why: a tiny run of the CLI spends 6-12 s of its 10-22 s importing those libraries (measured on the 2-core CI
machine: torch 1.9 s, transformers' auto classes 4.1 s, ModelOpt 5.7 s), and the default test tier starts about
150 of them. A forked child is still a separate process running the real entry point: its own cwd, environment,
argv, stdout / stderr pipes, exit code (or signal), atexit handlers and interpreter shutdown; quantlab itself is
imported fresh in every child (the parent never imports it), so nothing of quantlab's state is shared.

What differs from a cold `python -m quantlab`, and how it is kept honest:
- the libraries' import-time reads of the environment happened in the parent. A request whose environment differs
  from the parent's in anything but QUANTLAB_* variables (which only quantlab reads, fresh in the child) runs cold;
- the parent runs no tensor operation, so no OpenMP / tokenizers thread pool exists at fork time;
- interpreter start itself (the import of quantlab's CLI, argument parsing before any library import) is covered
  by tests that ask for `cold=True`, and the whole suite runs cold with QUANTLAB_TEST_COLD=1.

Protocol (JSON lines over the parent's stdin / stdout): a request {"module", "argv", "cwd", "env", "out", "err"} is
answered {"started": pid} when its child is forked; {"ended": pid, "status"} (os.waitpid's) comes when it ends.
Children may run concurrently (tests that start two sweeps at once).
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

WARM_IMPORTS = ("torch", "transformers", "transformers.models.auto.modeling_auto", "modelopt.torch.quantization",
                "hydra", "omegaconf", "matplotlib.pyplot", "safetensors.torch", "tokenizers", "jinja2", "scipy.stats")


def _child(request: dict) -> None:
    """In the forked child: become `python -m MODULE ARGV` in CWD with ENV, output to the given files."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["-m", *request["argv"]]
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _run_child(request: dict) -> int:
    """The child's program, and its exit code as an interpreter would set it (an uncaught exception: its
    traceback and 1; SystemExit's code, a string printed and 1)."""
    try:
        _child(request)
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # as Python does: the traceback, then death by SIGINT
        sys.excepthook(*sys.exc_info())
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 1
    except BaseException:  # noqa: BLE001 - any uncaught exception, reported the way the interpreter reports it
        sys.excepthook(*sys.exc_info())
        return 1
    else:
        return 0
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What Py_FinalizeEx does before tearing down modules: join the non-daemon threads and run their exit hooks
    (concurrent.futures' and loky's executors shut down there, before multiprocessing's atexit handler joins their
    worker processes), run the atexit handlers, flush the standard streams."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _exit(code: int) -> None:
    """End the child as an interpreter ends (atexit handlers - logging's flush, temporary directories' cleanup -
    and the standard streams flushed) but without tearing down the modules the parent imported: that teardown
    takes ~3 s with torch and transformers loaded and does nothing a run's output depends on."""
    _finish()
    os._exit(code & 0xFF)


class _Lines:
    """Lines from a descriptor, read unbuffered (select must see what is not yet read)."""

    def __init__(self, fd: int):
        self.fd, self.pending = fd, b""

    def ready(self) -> bool:
        return b"\n" in self.pending

    def read(self) -> bool:
        """One os.read into the buffer; False at end of file."""
        chunk = os.read(self.fd, 65536)
        self.pending += chunk
        return bool(chunk)

    def pop(self) -> dict:
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


def serve() -> None:
    """The warm parent: import the libraries, then fork one child per request (several may run at once), never
    running one itself; {"started": pid} when forked, {"ended": pid, "status": ...} when reaped."""
    import importlib

    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in WARM_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # the protocol on its own descriptors; the parent's fds 0 and 1 (which children start from) on /dev/null
    requests, replies = _Lines(os.dup(0)), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    gc.collect()
    gc.freeze()  # the imported libraries' objects: never scanned in a child, so never copied into it by the collector
    os.write(replies, b'{"ready": true}\n')
    children, open_ = set(), True
    while open_ or children:
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            os.write(replies, json.dumps({"ended": pid, "status": status}).encode() + b"\n")
        if not open_:
            time.sleep(0.05)
            continue
        if not requests.ready():
            ready, _, _ = select.select([requests.fd], [], [], 0.05 if children else None)
            if ready:
                open_ = requests.read()
            continue
        request = requests.pop()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the request's process from here on
            os.close(replies)
            os.close(requests.fd)
            _exit(_run_child(request))
        children.add(pid)
        os.write(replies, json.dumps({"started": pid}).encode() + b"\n")


def _sensitive(env: dict) -> dict:
    """What the warm parent's imports may have read: every variable but QUANTLAB_* (quantlab is imported fresh) and
    pytest's name of the running test."""
    return {k: v for k, v in env.items() if not k.startswith("QUANTLAB_") and k != "PYTEST_CURRENT_TEST"}


class Child:
    """A started child: its pid and where its output goes."""

    def __init__(self, pid: int, argv: list[str], out: Path, err: Path):
        self.pid, self.argv, self.out, self.err = pid, argv, out, err


class WarmStarter:
    """One warm parent per test process, started on first use with the first request's environment."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict | None = None
        self.replies: _Lines | None = None
        self.ended: dict[int, int] = {}

    def start(self, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, cwd="/")
        self.env, self.replies, self.ended = _sensitive(env), _Lines(self.proc.stdout.fileno()), {}
        if self._reply(600) != {"ready": True}:
            raise RuntimeError("the warm parent did not start")

    def usable(self, env: dict) -> bool:
        return self.env is None or self.env == _sensitive(env)

    def _reply(self, timeout: float) -> dict | None:
        """The parent's next reply, None after TIMEOUT seconds; an ended child's status is also kept in self.ended."""
        deadline = time.monotonic() + timeout
        while not self.replies.ready():
            ready, _, _ = select.select([self.replies.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            if not self.replies.read():
                raise RuntimeError("the warm parent ended")
        reply = self.replies.pop()
        if "ended" in reply:
            self.ended[reply["ended"]] = reply["status"]
        return reply

    def spawn(self, module: str, argv: list[str], cwd: Path, env: dict, tmp: Path) -> Child:
        """Start `python -m MODULE ARGV` forked warm (it runs while the caller goes on)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start(env)
        tmp.mkdir(parents=True, exist_ok=True)
        stamp = f"{os.getpid()}_{time.monotonic_ns()}"
        out, err = tmp / f"{stamp}.out", tmp / f"{stamp}.err"
        request = {"module": module, "argv": argv, "cwd": str(cwd), "env": env, "out": str(out), "err": str(err)}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        while True:
            reply = self._reply(60)
            if reply is None:
                raise RuntimeError("the warm parent did not fork")
            if "started" in reply:
                return Child(reply["started"], [sys.executable, "-m", module, *argv], out, err)

    def wait(self, child: Child, timeout: float) -> subprocess.CompletedProcess:
        """The child's exit code (negative: the signal), stdout and stderr as text; subprocess's TimeoutExpired
        (the child killed) after TIMEOUT seconds."""
        deadline = time.monotonic() + timeout
        while child.pid not in self.ended:
            if self._reply(max(0.0, deadline - time.monotonic())) is None:
                os.kill(child.pid, 9)
                while child.pid not in self.ended:
                    self._reply(60)
                raise subprocess.TimeoutExpired(child.argv, timeout)
        status = self.ended.pop(child.pid)
        stdout, stderr = (p.read_text(errors="replace") for p in (child.out, child.err))
        child.out.unlink()
        child.err.unlink()
        return subprocess.CompletedProcess(child.argv, os.waitstatus_to_exitcode(status), stdout, stderr)

    def run(self, module: str, argv: list[str], cwd: Path, env: dict, timeout: float,
            tmp: Path) -> subprocess.CompletedProcess:
        """`python -m MODULE ARGV` forked warm, waited for."""
        return self.wait(self.spawn(module, argv, cwd, env, tmp), timeout)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        if self.proc is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    serve()
