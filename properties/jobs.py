"""Fuzz runs and replays beside their target, one or several at once.

A job runs in a worker process (:mod:`impl.worker`) that holds its target in
the same process: for ``vllm@X`` one that imported that vLLM, for the
reference a plain one. The state machine, the checker and vLLM's scheduler
then share one process, so an event costs no round trip; the parent keeps
orchestration. The same functions run every target: one code path.

* :func:`fuzz_job` / :func:`replay_job` are what a worker runs;
* :func:`run_fuzz` runs ``workers`` fuzz jobs with different seeds over one
  shared example database and merges them: examples, events, witnesses and
  refusals summed, the first crash, else the shortest counterexample; once one
  job has a verdict the others are asked to stop at their next example;
* :func:`replay_beside` replays a trace beside its target.

A worker that dies (a segmentation fault, ``os._exit``) or applies no event
for ``KVCHECK_HANG_TIMEOUT`` seconds is a crash (exit 3) with the trace it was
running, read from its flight recorder; the next job starts a fresh worker.
Ctrl-C in the parent stops every worker.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from impl.target import TargetCrash
from model.events import Trace
from properties.machine import FuzzResult, FuzzSpec, RunStats, StopRun

# --------------------------------------------------------- inside a worker


class _Sampler:
    """Every Nth finished example, replay its events through real attention;
    keep those where attention reads NaN or garbage while the checker saw
    nothing (as ``(trace, first bad read as text)``)."""

    def __init__(self, every: int, target: str):
        self.every, self.target = every, target
        self.seen = self.checked = 0
        self.missed: list[tuple[Trace, str]] = []

    def __call__(self, machine: Any) -> None:
        from confirm.attention import replay_attention

        self.seen += 1
        if self.seen % self.every or machine.cfg is None or not machine.events:
            return
        trace = Trace(machine.cfg, list(machine.events))
        rep = replay_attention(trace, target_spec=self.target)
        self.checked += 1
        if not rep.ok and not rep.violations:
            self.missed.append((trace, str(rep.first_bad)))


def fuzz_job(spec: FuzzSpec, examples: int, seed: int | None = None,
             db_path: str | None = None, seconds: float | None = None,
             attention_every: int = 0, minimize: bool = True,
             stop_file: str | None = None, shrink_seconds: float | None = None,
             vacuous_grace: float = 0.0, borrow: str | None = None,
             base: str | None = None) -> FuzzResult:
    """One Hypothesis run beside the target (in a worker); ``seconds``: stop
    starting examples after that long, or once ``stop_file`` exists (a
    verdict found by then is shrunk, for at most ``shrink_seconds`` when
    given: :func:`properties.machine.fuzz`). ``vacuous_grace``: a run that
    has not yet reached every witness its configs can produce goes on past
    ``seconds`` for up to that many times ``seconds`` more. ``borrow``: the
    gate's base; the failures the database holds for the same setting on it
    are replayed first (``FuzzResult.borrowed_from_base``). ``base``: a
    failing example is replayed on it (in a worker of its own, started from
    this one), and one that fails there the same way is passed over
    (:func:`base_fails`), so the run reports a failure of the target's own."""
    from impl.target import fit_spec, make_target
    from impl.worker import progress
    from properties.machine import fuzz

    target = make_target(spec.target)
    fit_spec(target.name, target.capabilities, spec)
    db = None
    if db_path is not None:
        from properties.database import open_database, recording

        keys = {}
        if borrow is not None and borrow != spec.target:
            from dataclasses import replace

            from properties.machine import database_key

            keys[database_key(spec, target)] = database_key(replace(spec, target=borrow), target)
        db = recording(open_database(db_path), keys)
    sampler = _Sampler(attention_every, spec.target) if attention_every else None
    end = None if seconds is None else time.monotonic() + seconds
    grace_end = None if seconds is None else time.monotonic() + seconds * (1 + vacuous_grace)
    found = [False]
    seen = [0, None]  # examples set up, the first failing one

    def on_example(phase: str, machine: Any) -> None:
        st = type(machine).stats
        if phase == "setup":
            seen[0] += 1
            now = time.monotonic()
            due = end is not None and now > end and (
                now > grace_end or all(st.witness.get(w) for w in st.expected))
            if not found[0] and (due or (stop_file is not None and os.path.exists(stop_file))):
                raise StopRun
            progress((st.examples, dict(st.events)))
            return
        if machine.violation is not None or machine.crashed:
            found[0] = True
            if seen[1] is None:
                seen[1] = seen[0]
        elif sampler is not None:
            sampler(machine)

    try:
        res = fuzz(spec, examples=examples, seed=seed, database=db, target=target,
                   on_example=on_example, minimize_trace=minimize,
                   shrink_seconds=shrink_seconds,
                   base_fails=None if base is None else base_fails(base))
    finally:
        close = getattr(target, "close", None)
        if close is not None:
            close()
    if sampler is not None:
        res.attention = (sampler.checked, sampler.missed)
    if res.violation is not None or res.crash is not None:
        res.examples_to_fail = seen[1] or seen[0]
    if db is not None:
        res.replayed_from_database = db.replayed
        res.borrowed_from_base = db.borrowed
    return res


def base_fails(base: str) -> Any:
    """``fuzz``'s ``base_fails`` for the target ``base``: the example replayed
    beside it (:func:`replay_beside`) fails the same way
    (:func:`properties.replay.fails_alike`). Shrinking runs the same example
    more than once: each is replayed on the base once."""
    from impl.target import TargetError, Unsupported
    from properties.replay import InvalidEvent, fails_alike

    seen: dict[str, bool] = {}

    def check(cfg: Any, events: list, v: Any, crash: str | None) -> bool:
        t = Trace(cfg, list(events))
        key = f"{'crash' if v is None else v.prop}:{t.dumps()}"
        if key not in seen:
            try:
                rr = replay_beside(t, base)
            except (InvalidEvent, Unsupported, TargetError):
                seen[key] = False  # the base cannot run it: it is not the base's
            else:
                seen[key] = fails_alike(rr, None if v is None else v.prop, crash)
        return seen[key]

    return check


def replay_job(trace: Trace, target: str, props: frozenset[int] | None = None):
    from properties.replay import replay

    return replay(trace, target, props=props)


# -------------------------------------------------------------- the parent


def _hang_s(target: str) -> float | None:
    from impl.worker import hang_timeout

    return hang_timeout() if target.startswith("vllm@") else None


def _call(target: str, slot: int, name: str, args: tuple, on_progress: Any = None) -> Any:
    """Run ``name(*args)`` in worker ``slot`` of ``target``; its result, or its
    exception raised here. A dead or hung worker raises :class:`WorkerGone`."""
    from impl.target import worker_for
    from impl.worker import WorkerDied

    w = worker_for(target, slot)
    try:
        reply = w.call("job", None, (name, args, {}), on_progress=on_progress,
                       hang_s=_hang_s(target))
    except WorkerDied as e:
        raise WorkerGone(str(e), w.flight_trace(), e.hung) from None
    if reply[0] == "ok":
        return reply[1]
    if reply[0] == "raise":
        raise reply[1]
    raise RuntimeError(f"{target}: the job {name} failed in its worker:\n{reply[1]}")


class WorkerGone(TargetCrash):
    """A worker died or hung during a job; ``example``: (config, events) from
    its flight recorder, the last event the one it was applying."""

    def __init__(self, message: str, example: tuple | None, hung: bool = False):
        super().__init__(message)
        self.example = example
        self.hung = hung


def replay_beside(trace: Trace, target: str, props: frozenset[int] | None = None,
                  job: str = "properties.jobs:replay_job", slot: int = 0):
    """:func:`properties.replay.replay` in a worker beside ``target`` (or
    another ``job`` taking the same arguments and returning a ReplayResult,
    or a tuple that starts with one) in worker ``slot``; a worker that dies is
    a crash of the replay (its ``ReplayResult.crash``)."""
    from properties.replay import ReplayResult

    try:
        return _call(target, slot, job, (trace, target, props))
    except WorkerGone as e:
        return ReplayResult(trace, [], [], {}, crash=str(e), props=props)


def split(examples: int, workers: int) -> list[int]:
    base, extra = divmod(examples, workers)
    return [base + (1 if i < extra else 0) for i in range(workers) if base or i < extra]


def seeds(seed: int | None, n: int) -> list[int | None]:
    """Different seeds per run: ``seed``, ``seed + 1``, ... (None: each its own)."""
    return [None if seed is None else seed + i for i in range(n)]


def merge(spec: FuzzSpec, results: list[FuzzResult]) -> FuzzResult:
    """One verdict of several runs: counts summed, the first crash, else the
    counterexample with the fewest events."""
    stats = RunStats()
    for r in results:
        stats.examples += r.stats.examples
        stats.events.update(r.stats.events)
        stats.witness.update(r.stats.witness)
        stats.expected |= r.stats.expected
        stats.unrequired.update(r.stats.unrequired)
        stats.refused.update(r.stats.refused)
        stats.layouts.update(r.stats.layouts)
        stats.on_base += r.stats.on_base
        ex = r.stats.base_example
        if ex is not None and (stats.base_example is None
                               or len(ex[1]) < len(stats.base_example[1])):
            stats.base_example = ex
    out = FuzzResult(spec, stats, seconds=max((r.seconds for r in results), default=0.0))
    crashed = [r for r in results if r.crash is not None]
    failed = [r for r in results if r.violation is not None]
    if crashed:
        pick = crashed[0]
        out.crash, out.trace = pick.crash, pick.trace
        out.shrunk_events = pick.shrunk_events
    elif failed:
        pick = min(failed, key=lambda r: len(r.trace.events) if r.trace else 1 << 30)
        out.violation, out.trace = pick.violation, pick.trace
        out.shrunk_events = pick.shrunk_events
    att = [r.attention for r in results if r.attention is not None]
    if att:
        out.attention = (sum(c for c, _ in att), [m for _, ms in att for m in ms])
    return out


def run_fuzz(spec: FuzzSpec, examples: int, workers: int = 1, seed: int | None = None,
             db_path: str | None = None, seconds: float | None = None,
             attention_every: int = 0, on_progress: Any = None,
             minimize: bool = True, slots: list[int] | None = None) -> FuzzResult:
    """``workers`` fuzz jobs of ``spec`` at once (``examples`` shared out,
    seeds ``seed + i``), merged. ``on_progress(examples, events)``: the sums
    so far. ``slots``: which workers of the target to use (default 0..n-1)."""
    counts = split(examples, max(1, workers)) if seconds is None else [examples] * workers
    n = len(counts)
    slots = slots or list(range(n))
    seeds_ = seeds(seed, n)
    t0 = time.perf_counter()
    latest: dict[int, tuple[int, dict]] = {}
    lock = threading.Lock()
    done: dict[int, FuzzResult] = {}
    errors: dict[int, BaseException] = {}

    def report(i: int, msg: Any) -> None:
        if on_progress is None:
            return
        with lock:
            latest[i] = msg
            ex = sum(m[0] for m in latest.values())
            ev: Counter = Counter()
            for m in latest.values():
                ev.update(m[1])
            on_progress(ex, dict(ev))

    fd, stop_file = tempfile.mkstemp(prefix="kvcheck-stop-")
    os.close(fd)
    os.unlink(stop_file)  # its existence is the request to stop

    closed = [False]  # the run is over: no thread may make the file again
    closing = threading.Lock()  # a thread's check-and-make against the run's end

    def stop_others(i: int) -> None:
        with closing:
            if closed[0]:
                return
            with contextlib.suppress(OSError):
                open(stop_file, "x").close()

    def one(i: int) -> None:
        try:
            if os.path.exists(stop_file):
                return
            r = _call(spec.target, slots[i], "properties.jobs:fuzz_job",
                      (spec, counts[i], seeds_[i], db_path, seconds, attention_every, minimize,
                       stop_file),
                      on_progress=lambda m: report(i, m))
        except WorkerGone as e:
            r = FuzzResult(spec, RunStats(), crash=str(e))
            if e.example is not None:
                cfg, events = e.example
                r.trace = Trace(cfg, list(events), meta={
                    "target": spec.target,
                    "violation": "target hung" if e.hung else "target crash"})
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            errors[i] = e
            stop_others(i)
            return
        done[i] = r
        if r.violation is not None or r.crash is not None:
            stop_others(i)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except KeyboardInterrupt:
        from impl.worker import kill_all

        with closing:
            closed[0] = True  # the threads its workers' deaths wake make no file
        kill_all()
        raise
    finally:
        with closing:
            closed[0] = True
            with contextlib.suppress(OSError):
                os.unlink(stop_file)
    if errors:
        raise errors[min(errors)]
    res = merge(spec, [done[i] for i in sorted(done)])
    res.seconds = time.perf_counter() - t0
    res.workers = n
    return res


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


__all__ = ["fuzz_job", "replay_job", "run_fuzz", "replay_beside", "merge", "split",
           "default_workers", "WorkerGone"]
