"""Replay a trace on a target, check it, and tell the story as a timeline.

The timeline is written for a reviewer at 2 a.m.: one block of lines per
event: what happened, each request's processed / in-flight / optimistic
counts, its block table (``.`` NULL, ``*`` returned during this event) with
the logical blocks each unprocessed step may read drawn under it; the
violation marked with ``>>`` (see :mod:`report.report`).
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

from impl.target import Target, TargetCrash, make_target
from model.events import AddRequest, Config, Drain, Event, Trace
from model.observations import LiveCounters, Observed
from properties.drain import drain
from properties.invariants import Checker, Violation
from properties.twin import Twin


@dataclass(slots=True)
class Row:
    index: int
    event: Event
    obs: Observed
    violations: list[Violation] | tuple[()]  # () where none (shared by such rows)


_NONE: tuple[()] = ()


@dataclass
class ReplayResult:
    trace: Trace
    rows: list[Row]
    violations: list[Violation]
    witness: dict[str, int]
    crash: str | None = None
    props: frozenset[int] | None = None  # the properties checked (None: all)

    def held(self) -> str:
        """What a run without a violation may claim."""
        if self.props is None or self.props >= frozenset(range(1, 8)):
            return "all properties hold"
        return (f"properties {', '.join(map(str, sorted(self.props)))} hold "
                f"(the others were not checked)")

    @property
    def first(self) -> Violation | None:
        return self.violations[0] if self.violations else None


def replay(trace: Trace, target: Target | str = "reference", stop_at_first: bool = True,
           props: frozenset[int] | None = None) -> ReplayResult:
    """Run ``trace`` on ``target`` under the checker. ``props`` limits the
    properties that count (default: all; a trace's ``meta.props`` says what
    the run that found it checked, and never narrows a replay)."""
    tgt = make_target(target) if isinstance(target, str) else target
    checker = Checker(trace.config)
    checker.feed(None, tgt.reset(trace.config))
    twin = Twin(tgt, trace.config)

    def judged(e: Event, o: Observed) -> list[Violation]:
        vs = checker.feed(e, o)
        v6 = twin.check(e, o, checker, checker.event_index)
        if v6 is not None:
            checker.violations.append(v6)
            vs.append(v6)
        return vs

    rows: list[Row] = []
    crash = None
    reqs: dict[str, AddRequest] = {}
    counters = LiveCounters()  # every live request's counters, folded event by event
    last_counters = None

    def live() -> list[str]:
        # the live requests, in the order they were first listed
        return [r for r in counters.live() if r in reqs]

    def record(i: int, e: Event, o: Observed) -> bool:
        """Check what event ``e`` (of trace event ``i``) did; True: stop here."""
        nonlocal last_counters
        if o.counters is not None:
            last_counters = o.counters
            counters.update(o.counters)
        vs = judged(e, o)
        if props is not None:
            vs = [v for v in vs if v.prop in props]
        # a row without violations shares one empty tuple (a long trace's rows
        # are mostly such)
        rows.append(Row(i, e, o, vs or _NONE))
        return bool(vs) and stop_at_first

    for i, ev in enumerate(trace.events):
        if isinstance(ev, Drain):
            def step(e: Event, i: int = i) -> Observed:
                o = tgt.apply(e)
                if record(i, e, o):
                    raise _Stop
                return o

            try:
                v = drain(trace.config, checker, last_counters, reqs, live, step, i,
                          getattr(tgt, "can_apply", None))
            except _Stop:
                break
            except TargetCrash as e:
                crash = str(e)
                break
            if v is not None:
                checker.violations.append(v)
                if rows:
                    rows[-1].violations = [*rows[-1].violations, v]
                if stop_at_first and (props is None or 7 in props):
                    break
            continue
        if isinstance(ev, AddRequest):
            reqs[ev.id] = ev
        try:
            obs = tgt.apply(ev)
        except TargetCrash as e:
            crash = str(e)
            break
        except ValueError as e:
            # the target refused the event: the trace is not valid for it
            raise InvalidEvent(f"event {i} ({type(ev).__name__}) is not valid here: {e}") from None
        except Exception:  # noqa: BLE001
            crash = f"{tgt.name} raised on event {i} ({ev}):\n{traceback.format_exc()}"
            break
        if record(i, ev, obs):
            break
    found = [v for v in checker.violations if props is None or v.prop in props]
    return ReplayResult(trace, rows, found, dict(checker.witness), crash, props)


def crash_line(text: str | None) -> str:
    """A crash's last line with its numbers blanked: the same bug at other
    sizes reads the same (how a crash on one tree is matched on another)."""
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return re.sub(r"\d+", "N", lines[-1]) if lines else ""


def fails_alike(rr: ReplayResult, prop: int | None, crash: str | None) -> bool:
    """Whether a replay fails as a run did: the same property first, or a
    crash with the same last line (:func:`crash_line`)."""
    if crash is not None:
        return rr.crash is not None and crash_line(rr.crash) == crash_line(crash)
    return rr.first is not None and rr.first.prop == prop


class InvalidEvent(ValueError):
    """A trace event the target refuses as invalid in its state (exit 2)."""


class _Stop(Exception):
    """A violation inside a Drain: the replay stops there."""


def format_timeline(res: ReplayResult, cfg: Config | None = None, width: int = 24) -> str:
    """The replay as a terminal timeline: per event, each request's counts
    ``p``/``f``/``c``, its block table (``N*`` returned now, ``.`` NULL) and the
    logical blocks each unprocessed step may read; the violation marked ``>>``
    and its block ``>N*<``. Drawn by :func:`report.report.render_timeline`."""
    from report.report import render_timeline

    return render_timeline(res, cfg, width)
