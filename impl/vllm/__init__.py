"""The ``vllm@VERSION`` / ``vllm@PATH`` target: vLLM's real scheduler and
KV-cache manager behind kvcheck's Target protocol.

SEMANTICS-PLACEHOLDER
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from impl.target import Capabilities, TargetCrash, TargetError, Unsupported
from model.events import (
    Abort,
    AddRequest,
    Config,
    Event,
    FailLoad,
    Finish,
    Preempt,
    Process,
    Schedule,
)
from model.observations import Observed, ProcessObs, StepObs

from . import compat
from .worker import recv, send

__all__ = ["VllmTarget", "resolve"]

READY_TIMEOUT_S = float(os.environ.get("KVCHECK_VLLM_START_TIMEOUT", "300"))


# ------------------------------------------------------------ which vLLM


class _Install:
    """Where one vLLM comes from: ``path`` (sys.path entries, first wins), the
    release line, and a label for messages."""

    def __init__(self, label: str, version: str, path: list[Path], pkg: Path):
        self.label = label
        self.version = version
        self.path = path
        self.pkg = pkg  # the vllm/ package directory that will be imported

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(str(p) for p in self.path)


def resolve(spec: str) -> _Install:
    """``0.33.0`` -> the release installed in .vllm/0.33.0; a path -> that vLLM
    source checkout (its ``vllm/`` tree first on sys.path, over the installed
    release of the same line, else the newest installed one, for metadata)."""
    spec = spec.strip()
    if compat.parse_release(spec) is not None:
        problem = compat.release_problem(spec)
        if problem:
            raise TargetError(problem)
        d = compat.install_dir(spec)
        if not (d / "vllm" / "__init__.py").is_file():
            raise TargetError(
                f"vllm {spec} is not installed; run: {compat.install_command(spec)}")
        return _Install(spec, spec, [d], d / "vllm")
    tree = Path(spec).expanduser()
    if tree.name == "vllm" and (tree / "__init__.py").is_file():
        tree = tree.parent
    if not (tree / "vllm" / "__init__.py").is_file():
        raise TargetError(
            f"{spec!r} is neither a vLLM release number (like 0.33.0) nor a vLLM "
            f"source checkout (a folder holding vllm/__init__.py)")
    tree = tree.resolve()
    line = compat.checkout_version(tree)
    installed = compat.installed_releases()
    base = None
    if line is not None:
        same = [v for v in installed if v.split(".")[:2] == line.split(".")[:2]]
        base = same[-1] if same else None
    if base is None and installed:
        base = installed[-1]
    if base is None:
        raise TargetError(
            f"a vLLM checkout runs over an installed release (for its metadata); none is "
            f"installed: run {compat.install_command('.'.join(map(str, compat.TESTED[-1:])))}")
    version = line or base
    return _Install(f"{tree} ({version})", version, [tree, compat.install_dir(base)],
                    tree / "vllm")


# --------------------------------------------------------------- the worker


def _python() -> str:
    venv = compat.REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


class _Worker:
    """One worker process for one vLLM; shared by every target of that vLLM."""

    _all: dict[tuple[str, ...], _Worker] = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, inst: _Install) -> _Worker:
        with cls._lock:
            w = cls._all.get(inst.key)
            if w is None or not w.alive():
                w = cls._all[inst.key] = cls(inst)
            return w

    def __init__(self, inst: _Install):
        self.inst = inst
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvcheck-vllm-{inst.version}-",
                                             suffix=".log")
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([*(str(p) for p in inst.path), str(compat.REPO)]),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": env.get("KVCHECK_VLLM_LOG_LEVEL", "ERROR"),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        })
        self.proc = subprocess.Popen(
            [_python(), "-m", "impl.vllm.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd,
            cwd=str(compat.REPO), env=env,
        )
        os.close(fd)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.inp: BinaryIO = self.proc.stdout
        self.out: BinaryIO = self.proc.stdin
        self.info: dict[str, Any] | None = None
        self.sessions = itertools.count()

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

    def ready(self) -> dict[str, Any]:
        if self.info is None:
            timer = threading.Timer(READY_TIMEOUT_S, self.proc.kill)
            timer.start()
            try:
                msg = recv(self.inp)
            except (EOFError, OSError):
                raise TargetError(
                    f"vllm {self.inst.label}: the worker died while importing vLLM:\n"
                    f"{self.log_tail()}") from None
            finally:
                timer.cancel()
            if msg[0] != "ready":
                self.close()
                raise TargetError(f"vllm {self.inst.label} cannot be imported:\n{msg[1]}")
            self.info = msg[1]
        return self.info

    def call(self, op: str, session: Any, payload: Any) -> Any:
        self.ready()
        try:
            send(self.out, (op, session, payload))
            return recv(self.inp)
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.poll()
            raise TargetCrash(
                f"vllm {self.inst.label}: the worker process died (exit status {code}):\n"
                f"{self.log_tail()}") from None

    def close(self) -> None:
        if self.alive():
            try:
                send(self.out, ("quit", None, None))
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


def _shutdown_all() -> None:
    for w in list(_Worker._all.values()):
        w.close()
    _Worker._all.clear()


import atexit  # noqa: E402

atexit.register(_shutdown_all)


# ---------------------------------------------------------------- the target


class VllmTarget:
    """vLLM's real scheduler, one release or checkout (``spec``), in a worker."""

    def __init__(self, spec: str):
        self.inst = resolve(spec)
        self.spec = spec
        self.name = f"vllm@{spec}"
        self._worker: _Worker | None = None
        self._session: Any = None
        self._config: Config | None = None
        in_flight = compat.tracks_in_flight(self.inst.pkg)
        self.capabilities = Capabilities(
            policies=frozenset({"settled" if in_flight else "optimistic"}),
            reports_in_flight=in_flight,
            fixed_policy="settled" if in_flight else "optimistic",
            notes=(
                "config.policy is ignored: vLLM implements fixed_policy",
                "external tokens need hazard=unordered (a KV-consumer connector)",
                "FailLoad needs a single KV-cache group",
                "depth 3-4: pipeline parallelism (see impl/vllm module docstring)",
            ),
        )
        self._reset_mirror()

    # -- process management

    def _w(self) -> _Worker:
        """The worker, started (or restarted after a crash) if needed."""
        if self._worker is None or not self._worker.alive():
            self._worker = _Worker.get(self.inst)
            self._session = next(self._worker.sessions)
            weakref.finalize(self, _drop_session, self._worker, self._session)
        return self._worker

    def _live_worker(self) -> _Worker:
        """The worker this target's state lives in; a dead one is a crash (the
        next ``reset`` starts a fresh one)."""
        w = self._worker
        if w is None or self._config is None:
            raise TargetCrash(f"{self.name}: reset() first")
        if not w.alive():
            self._config = None
            raise TargetCrash(
                f"{self.name}: the worker process died (exit status {w.proc.poll()}):\n"
                f"{w.log_tail()}")
        return w

    def worker_info(self) -> dict[str, Any]:
        """What the worker reports: vLLM's version, file, in-flight tracking.
        Starts the worker (importing vLLM: ~8 s)."""
        return self._w().ready()

    def close(self) -> None:
        if self._worker is not None and self._worker.alive():
            _drop_session(self._worker, self._session)
        self._worker = None

    # -- the protocol

    def reset(self, config: Config) -> Observed:
        if config.depth > self.capabilities.max_depth:
            raise Unsupported(f"{self.name}: depth {config.depth} > {self.capabilities.max_depth}")
        w = self._w()
        reply = w.call("reset", self._session, config)
        self._reset_mirror()
        if reply[0] == "unsupported":
            raise Unsupported(f"{self.name}: {reply[1]}")
        if reply[0] == "crash":
            raise TargetCrash(f"{self.name}: reset raised:\n{reply[1]}")
        self._config = config
        self._observe(reply[1])
        return reply[1]

    def apply(self, event: Event) -> Observed:
        return self.apply_many([event])[0]

    def apply_many(self, events: list[Event]) -> list[Observed]:
        """Apply several events in one round trip; the same as one ``apply``
        each. On failure the exception carries ``.observed``: the results of
        the events before the one that failed."""
        try:
            reply = self._live_worker().call("apply", self._session, list(events))
        except TargetCrash:
            self._config = None
            raise
        kind = reply[0]
        done = reply[1] if kind == "ok" else reply[2]
        for obs in done:
            self._observe(obs)
        if kind == "ok":
            return done
        failed = events[len(done)]
        if kind == "unsupported":
            exc: Exception = Unsupported(f"{self.name}: {failed}: {reply[1]}")
        elif kind == "rejected":
            exc = Unsupported(f"{self.name}: {failed} is not valid here now: {reply[1]}")
        else:
            self._config = None
            exc = TargetCrash(f"{self.name}: vLLM raised while applying {failed}:\n{reply[1]}")
        exc.observed = done  # type: ignore[attr-defined]
        raise exc

    # -- preconditions, from a mirror of the observations

    def _reset_mirror(self) -> None:
        self._pending: deque[StepObs] = deque()
        self._status: dict[str, str] = {}

    def _observe(self, obs: Observed) -> None:
        for it in obs.items:
            if type(it) is StepObs:
                self._pending.append(it)
            elif type(it) is ProcessObs:
                self._pending.popleft()
        if obs.counters is not None:
            for rid, rc in obs.counters.reqs.items():
                self._status[rid] = rc.status

    def can_apply(self, event: Event) -> bool:
        cfg = self._config
        if cfg is None:
            return False
        t = type(event)
        if t is Schedule:
            return len(self._pending) < cfg.depth
        if t is Process:
            if not self._pending:
                return False
            spec = {r.rid: r.spec for r in self._pending[0].reqs}
            return all(n <= spec.get(rid, n) for rid, n in event.accepted.items())
        if t is AddRequest:
            return (
                event.id not in self._status
                and event.prompt_len >= 1 and event.max_new_tokens >= 1
                and event.prompt_len + event.max_new_tokens <= cfg.max_model_len
                and 0 <= event.external_tokens < event.prompt_len
                and (not event.external_tokens or cfg.hazard == "unordered")
            )
        if t is Preempt:
            return self._status.get(event.id) == "running"
        if t is FailLoad:
            if len(cfg.groups) > 1:
                return False
            lo = event.first_bad_block * cfg.block_size
            return any(r.rid == event.id and r.loaded and r.start - r.loaded <= lo < r.start
                       for s in self._pending for r in s.reqs)
        if t is Finish or t is Abort:
            return self._status.get(event.id, "finished") != "finished"
        return False


def _drop_session(worker: _Worker, session: Any) -> None:
    try:
        if worker.alive() and worker.info is not None:
            worker.call("drop", session, None)
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
