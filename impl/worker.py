"""Worker processes: a job (a fuzz run, a replay) runs beside the target it drives.

A vLLM target runs in a process that imports that vLLM (one release or
checkout per process); the checker and the Hypothesis state machine run in the
same process, so an event costs a function call, not a round trip. The parent
keeps what needs two processes: orchestration, several runs at once, crash
isolation, and ``diff`` between two targets. The reference target's jobs run
in the same kind of process (no vLLM on its path): one code path for both.

Started as ``python -m impl.worker``. Protocol: length-prefixed pickles
(4-byte little-endian length, then ``pickle.dumps(message)``) on the original
stdin/stdout; anything else printed goes to stderr (the worker's log file).
The first message is ``("ready", info)``, or ``("crash", traceback)`` if the
setup named by ``KVCHECK_WORKER_SETUP`` (``module:function``, returning
``(info, handlers)``; :func:`impl.vllm.worker.setup` imports vLLM) fails.

Requests ``(op, session, payload)``:

* ``("job", None, ("module:function", args, kwargs))`` runs the function;
  while it runs it may send ``("progress", obj)`` (:func:`progress`); then
  ``("ok", result)``, ``("raise", exception)`` or ``("error", traceback)``;
* an op of the setup's handlers (``reset``, ``apply``, ``drop`` for vLLM):
  its handler's reply;
* ``("quit", None, None)`` exits.

SIGINT is ignored: the parent decides (Ctrl-C there stops every worker).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

_HEADER = struct.Struct("<I")
# the tree this code was imported from, symlinks kept: a tree of links with one
# file edited (scripts/mutants.py) must run its own code in its workers too
REPO = Path(os.path.abspath(__file__)).parent.parent


def send(out: BinaryIO, msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def _read(inp: BinaryIO, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = inp.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def recv(inp: BinaryIO) -> Any:
    (n,) = _HEADER.unpack(_read(inp, _HEADER.size))
    return pickle.loads(_read(inp, n))


# ------------------------------------------------------------ inside a worker

_out: BinaryIO | None = None
_last_progress = 0.0


def in_worker() -> bool:
    return _out is not None


def progress(obj: Any, every: float = 0.5) -> None:
    """Send ``obj`` to the parent (at most every ``every`` seconds); nothing
    outside a worker."""
    global _last_progress
    if _out is None:
        return
    now = time.monotonic()
    if now - _last_progress >= every:
        _last_progress = now
        send(_out, ("progress", obj))


def _resolve(name: str) -> Callable[..., Any]:
    mod, _, fn = name.partition(":")
    return getattr(importlib.import_module(mod), fn)


def _run_job(payload: Any) -> Any:
    name, args, kwargs = payload
    try:
        return ("ok", _resolve(name)(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - handed to the parent
        tb = traceback.format_exc()
        try:
            pickle.loads(pickle.dumps(e))
            return ("raise", e, tb)
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            return ("error", tb)


def _die_with_parent() -> None:
    """End the worker once the process that started it is gone, however it
    ended (a parent killed mid-job leaves no worker behind): a thread that
    looks every half second whether the worker has been handed to another
    parent. (Linux's PR_SET_PDEATHSIG fires when the parent's *thread*
    ends, and workers are started from threads.)"""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="kvcheck-parent-watch", daemon=True).start()


def main() -> None:
    global _out
    inp = os.fdopen(os.dup(0), "rb", buffering=0)
    out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # stray output goes to the log, never into the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    handlers: dict[str, Callable[[Any, Any], Any]] = {}
    info: dict[str, Any] = {}
    setup = os.environ.get("KVCHECK_WORKER_SETUP")
    if setup:
        try:
            info, handlers = _resolve(setup)()
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises
            send(out, ("crash", traceback.format_exc()))
            return
    _out = out
    import gc

    gc.collect()
    gc.freeze()  # what the setup imported (vLLM, torch) stays out of every later collection
    # a fuzz run allocates many short-lived objects (Hypothesis's choices and
    # spans, observations): collect the young generation every 20,000
    # allocations, not 700 (a vLLM fuzz run's collector CPU time 9% -> 6%)
    gc.set_threshold(20_000, 20, 20)
    send(out, ("ready", info))
    while True:
        try:
            op, session, payload = recv(inp)
        except EOFError:
            return
        if op == "quit":
            return
        if op == "job":
            send(out, _run_job(payload))
        elif op in handlers:
            send(out, handlers[op](session, payload))
        else:
            send(out, ("crash", f"unknown request {op!r}"))


# ------------------------------------------------------------- the parent side


class WorkerDied(RuntimeError):
    """The worker process ended (or hung and was stopped) during a request."""

    def __init__(self, message: str, hung: bool = False):
        super().__init__(message)
        self.hung = hung


def _python() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


HANG_ENV = "KVCHECK_HANG_TIMEOUT"


def hang_timeout() -> float:
    """Seconds a worker may go without applying an event during a job before
    it counts as hung (``KVCHECK_HANG_TIMEOUT``, default 300)."""
    v = os.environ.get("KVCHECK_HANG_TIMEOUT")
    return float(v) if v else 300.0


class WorkerProcess:
    """One worker process. ``path``: entries put first on its ``PYTHONPATH``
    (a vLLM tree); ``env``: more variables; ``setup``: its
    ``KVCHECK_WORKER_SETUP``. A flight recorder file (``flight``) is where the
    target inside writes each config and event before applying it, so a
    worker that dies or hangs still leaves the trace that did it."""

    def __init__(self, label: str, path: list[str] | None = None,
                 env: dict[str, str] | None = None, setup: str | None = None):
        self.label = label
        with _stopping_lock:  # no worker (nor its files) once kill_all has run
            if _stopping[0]:
                raise WorkerDied(f"worker {label}: kvcheck is stopping; no worker starts")
            fd, self.log_path = tempfile.mkstemp(prefix="kvcheck-worker-", suffix=".log")
            ffd, self.flight = tempfile.mkstemp(prefix="kvcheck-flight-", suffix=".bin")
            os.close(ffd)
            _pending_files.update((self.log_path, self.flight))
        e = dict(os.environ)
        e.update({
            "PYTHONPATH": os.pathsep.join([*(path or []), str(REPO)]),
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "KVCHECK_FLIGHT": self.flight,
        })
        e.pop("KVCHECK_WORKER_SETUP", None)
        if setup:
            e["KVCHECK_WORKER_SETUP"] = setup
        e.update(env or {})
        self.proc = subprocess.Popen(
            [_python(), "-m", "impl.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=fd, cwd=str(REPO), env=e, bufsize=0)
        os.close(fd)
        with _stopping_lock:
            _pending_files.difference_update((self.log_path, self.flight))
            _started.add(self)
            if _stopping[0]:  # kill_all ran while this one started
                self.kill()
                self.remove_files()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.inp: BinaryIO = self.proc.stdout
        self.out: BinaryIO = self.proc.stdin
        self.info: dict[str, Any] | None = None
        self.startup_error: str | None = None
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def ready(self, timeout: float) -> dict[str, Any]:
        """The worker's info once its setup is done; raises WorkerDied if it
        ends first, RuntimeError with the setup's traceback if that failed."""
        if self.info is None:
            timer = threading.Timer(timeout, self.proc.kill)
            timer.start()
            try:
                msg = recv(self.inp)
            except (EOFError, OSError):
                raise WorkerDied(f"{self.label}: the worker died while starting:\n"
                                 f"{self.log_tail()}") from None
            finally:
                timer.cancel()
            if msg[0] != "ready":
                self.startup_error = msg[1]
                self.close()
                raise RuntimeError(msg[1])
            self.info = msg[1]
        return self.info

    def call(self, op: str, session: Any, payload: Any,
             on_progress: Callable[[Any], None] | None = None,
             hang_s: float | None = None) -> Any:
        """One request and its reply; ``progress`` messages go to
        ``on_progress``. With ``hang_s``, a worker whose flight recorder has
        not moved for that long is killed (WorkerDied, ``hung``)."""
        with self.lock:
            try:
                send(self.out, (op, session, payload))
                while True:
                    if hang_s is not None:
                        self._wait(hang_s)
                    msg = recv(self.inp)
                    if msg[0] == "progress":
                        if on_progress is not None:
                            on_progress(msg[1])
                        continue
                    return msg
            except (EOFError, OSError, BrokenPipeError):
                code = self.proc.poll()
                if code is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        code = self.proc.wait(timeout=5)
                raise WorkerDied(f"{self.label}: the worker process died (exit status "
                                 f"{code}):\n{self.log_tail()}") from None

    def _wait(self, hang_s: float) -> None:
        """Until the worker has something to say; kill it if its flight
        recorder stays still for ``hang_s`` seconds."""
        fd = self.inp.fileno()
        last = self._moved()
        still_since = time.monotonic()
        while True:
            r, _, _ = select.select([fd], [], [], min(0.5, hang_s))
            if r:
                return
            now = time.monotonic()
            moved = self._moved()
            if moved != last:
                last, still_since = moved, now
            elif now - still_since >= hang_s:
                self.proc.kill()
                self.proc.wait()
                raise WorkerDied(f"{self.label}: no event finished for {hang_s:g}s "
                                 f"({HANG_ENV}); the worker was stopped", hung=True)

    def _moved(self) -> tuple[int, int]:
        try:
            s = os.stat(self.flight)
            return (s.st_mtime_ns, s.st_size)
        except OSError:
            return (0, 0)

    def flight_trace(self) -> tuple[Any, list[Any]] | None:
        """(config, events) of the last reset recorded and the events after
        it, the last one the event it was applying; None if nothing was."""
        return read_flight(self.flight)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)

    def close(self) -> None:
        if self.alive():
            try:
                send(self.out, ("quit", None, None))
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.remove_files()

    def remove_files(self) -> None:
        for p in (self.log_path, self.flight):
            with contextlib.suppress(OSError):
                os.unlink(p)


_started: weakref.WeakSet[WorkerProcess] = weakref.WeakSet()
_stopping = [False]  # kill_all has run: no worker starts after it
_stopping_lock = threading.Lock()
_pending_files: set[str] = set()  # of workers being started


def kill_all() -> None:
    """Stop every worker this process started and remove its temporary
    files (Ctrl-C, SIGTERM, SIGHUP); a thread still running starts none
    after this."""
    with _stopping_lock:
        _stopping[0] = True
        workers = list(_started)
        for p in list(_pending_files):
            with contextlib.suppress(OSError):
                os.unlink(p)
    for w in workers:
        w.kill()
        w.remove_files()


_plain: dict[int, WorkerProcess] = {}
_plain_lock = threading.Lock()


def plain_worker(slot: int = 0) -> WorkerProcess:
    """A worker with no target library on its path (the reference's jobs)."""
    with _plain_lock:
        w = _plain.get(slot)
        if w is None or not w.alive():
            w = _plain[slot] = WorkerProcess("reference")
    w.ready(120.0)
    return w


def shutdown_plain() -> None:
    for w in list(_plain.values()):
        w.close()
    _plain.clear()


atexit.register(shutdown_plain)


# ------------------------------------------------------------ flight recorder


class Flight:
    """The writing end, inside a worker: ``reset(session, config)`` starts the
    record afresh, ``apply(session, events)`` appends; each is written before
    the target runs it (unbuffered: it survives the process)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)

    def _write(self, rec: Any) -> None:
        data = pickle.dumps(rec, protocol=pickle.HIGHEST_PROTOCOL)
        os.write(self.fd, _HEADER.pack(len(data)) + data)

    LIMIT = 8 << 20  # bytes; past it the record starts afresh at the next reset

    def reset(self, session: Any, config: Any) -> None:
        if os.lseek(self.fd, 0, os.SEEK_CUR) > self.LIMIT:
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)
        self._write(("reset", session, config))

    def apply(self, session: Any, events: list[Any]) -> None:
        self._write(("apply", session, events))


def flight_from_env() -> Flight | None:
    path = os.environ.get("KVCHECK_FLIGHT")
    return Flight(path) if path and in_worker() else None


def read_flight(path: str) -> tuple[Any, list[Any]] | None:
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    recs, i = [], 0
    while i + _HEADER.size <= len(data):
        (n,) = _HEADER.unpack_from(data, i)
        if i + _HEADER.size + n > len(data):
            break
        try:
            recs.append(pickle.loads(data[i + _HEADER.size: i + _HEADER.size + n]))
        except Exception:  # noqa: BLE001 - a record cut short by the crash
            break
        i += _HEADER.size + n
    starts = [k for k, r in enumerate(recs) if r[0] == "reset"]
    if not starts:
        return None
    _, session, config = recs[starts[-1]]
    events = [e for r in recs[starts[-1] + 1:] if r[0] == "apply" and r[1] == session
              for e in r[2]]
    return config, events


if __name__ == "__main__":
    # run as impl.worker, not __main__: jobs import impl.worker and must see its state
    from impl.worker import main as _main

    sys.exit(_main())
