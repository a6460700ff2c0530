"""Whose bug is it: a counterexample found on the target, replayed on the base.

* **introduced**: it fails on the target and not on the base (the gate fails);
* **also on base**: the base fails the same way (the same property, or a
  crash); listed, named when it is a known finding, never failing the gate;
* **fixed by this change**: a known finding's trace fails on the base and
  holds on the target.

Attribution never depends on the findings list: the list only names what the
base already shows (:mod:`gate.known`). The base is not fuzzed; only these
replays run on it, in its own workers beside the target's.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gate.base import Base
from gate.known import FINDINGS, Finding, finding_traces


@dataclass
class OnBase:
    fails: bool  # the base fails the same way
    note: str = ""  # what the base did, when that says more than yes / no


def _crash_text(text: str) -> str:
    from properties.replay import crash_line

    return crash_line(text)


def _replay(trace: Any, target: str, slot: int = 0) -> Any:
    """The replay beside ``target``; a target that raises while it is built
    (before the first event) is a crash of the replay, as any other."""
    from impl.target import TargetCrash
    from properties.jobs import replay_beside
    from properties.replay import ReplayResult

    try:
        return replay_beside(trace, target, slot=slot)
    except TargetCrash as e:
        return ReplayResult(trace, [], [], {}, crash=str(e))


def replay_on_base(res: Any, base: Base, slot: int = 0, seconds: float = 10.0) -> OnBase:
    """Whether the fuzz result's counterexample fails on ``base`` as it did on
    the target. A crash with no trace (the scheduler could not be built) is
    looked for by fuzzing the same row on the base for ``seconds``."""
    from impl.target import TargetError, Unsupported
    from properties.jobs import WorkerGone, _call
    from properties.replay import InvalidEvent

    if base.same:
        return OnBase(True)
    if res.trace is None:
        from dataclasses import replace

        spec = replace(res.spec, target=base.target)
        try:
            got = _call(base.target, slot, "properties.jobs:fuzz_job",
                        (spec, 10**7, 0, None, max(1.0, seconds), 0, False))
        except (WorkerGone, TargetError) as e:
            return OnBase(True, f"the base crashed too: {str(e).strip().splitlines()[-1]}")
        if got.crash is not None:
            same = _crash_text(got.crash) == _crash_text(res.crash)
            return OnBase(same, "" if same else f"the base crashed otherwise: "
                                                f"{_crash_text(got.crash)}")
        return OnBase(False, f"the base built and ran {got.stats.examples} examples")
    try:
        rr = _replay(res.trace, base.target, slot)
    except (InvalidEvent, Unsupported) as e:
        return OnBase(False, f"the base cannot run this trace: {e}")
    if res.crash is not None:
        if rr.crash is not None:
            return OnBase(True)
        if rr.first is not None:
            return OnBase(False, f"the base does not crash; it violates p{rr.first.prop}")
        return OnBase(False)
    prop = res.violation.prop
    if rr.first is not None and rr.first.prop == prop:
        return OnBase(True)
    if rr.crash is not None:
        return OnBase(False, f"the base crashes on it: {_crash_text(rr.crash)}")
    if rr.first is not None:
        return OnBase(False, f"the base violates p{rr.first.prop} instead")
    return OnBase(False)


@dataclass
class Fixed:
    trace: str  # the finding's trace
    label: str  # how the finding is named
    base_failure: str  # what the base shows on it


def _fix_files(diff: str | None) -> set[str]:
    """The files a fix diff (or a series of them) edits (``vllm/...``)."""
    from gate.known import fix_files

    out: set[str] = set()
    for p in fix_files(diff):
        try:
            out |= set(re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), re.M))
        except OSError:
            continue
    return out


def likely_first(paths: list[Path], target: str, changed: set[str]) -> list[Path]:
    """The finding traces in the order they are tried: first those whose fix
    the target names (``vllm@R+FIX.diff``), then those whose fix edits a file
    the change edits, then the rest (a short budget replays the likely ones)."""
    import json

    def rank(p: Path) -> int:
        try:
            fix = json.loads(p.read_text()).get("meta", {}).get("fixed_by")
        except (OSError, ValueError):
            return 2
        from impl.vllm.overlay import series

        if fix and all(part in target for part in series(fix)):
            return 0
        return 1 if _fix_files(fix) & changed else 2

    return sorted(paths, key=rank)


def fixed_by_change(base: Base, target: str, deadline: float, slot: int = 0,
                    findings: list[Finding] | None = None,
                    changed: set[str] | None = None) -> tuple[list[Fixed], int, int]:
    """Every known finding's trace replayed on the base, and where it fails
    there, on the target: those that hold on the target are fixed by the
    change. Returns (fixed, traces replayed, traces there were); stops at
    ``deadline`` (time.monotonic). ``changed``: the files the change edits
    (``vllm/...``): the traces whose fix edits them are tried first."""
    from impl.target import TargetError, Unsupported
    from model.events import Trace, TraceError
    from properties.replay import InvalidEvent

    paths = likely_first(finding_traces(), target, changed or set())
    if base.same:
        return [], 0, len(paths)
    out, done = [], 0
    for p in paths:
        if time.monotonic() > deadline:
            break
        done += 1
        try:
            t = Trace.load(p)
            rb = _replay(t, base.target, slot)
            if rb.crash is None and rb.first is None:
                continue
            rt = _replay(t, target, slot)
        except (InvalidEvent, Unsupported, TargetError, TraceError):
            continue  # a trace of another release's API, a layout this tree refuses
        if rt.crash is None and rt.first is None:
            m = t.meta
            label = (f"finding {m['finding']}, {m.get('title', p.stem)}"
                     + (f" (upstream {m['upstream']})" if m.get("upstream") else "")
                     if "finding" in m else p.stem)
            shown = (f"crash: {_crash_text(rb.crash)}" if rb.crash is not None
                     else f"p{rb.first.prop} ({rb.first.name})")
            out.append(Fixed(str(p.relative_to(FINDINGS.parent)), label, shown))
    return out, done, len(paths)
