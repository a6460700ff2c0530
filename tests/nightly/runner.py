"""One nightly row: fuzz for a time budget, record a verdict, draw a failure.

:func:`run_row` calls :func:`properties.machine.fuzz` in rounds sized to the
time left (Hypothesis has no wall-clock limit of its own), all with the same
persistent example database, so the first round replays the examples earlier
nights saved before it generates new ones. It writes
``<reports>/rows/<id>.json`` and, for a violation, the trace, its picture
and a pytest reproducer under ``<reports>/counterexamples/``.
"""

from __future__ import annotations

import json
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis.database import ExampleDatabase

from impl.target import Unsupported


class RecordingDatabase(ExampleDatabase):
    """Wraps the shared database and counts the saved examples Hypothesis
    fetched to replay (its primary corpus; not the secondary or pareto ones)."""

    def __init__(self, inner: ExampleDatabase) -> None:
        super().__init__()
        self.inner = inner
        self.replayed = 0
        self.saved = 0

    def fetch(self, key: bytes):
        values = list(self.inner.fetch(key))
        if not key.endswith((b".secondary", b".pareto")):
            self.replayed += len(values)
        yield from values

    def save(self, key: bytes, value: bytes) -> None:
        if not key.endswith((b".secondary", b".pareto")):
            self.saved += 1
        self.inner.save(key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(src, dest, value)


class _FirstFailure:
    """on_example callback: the number of examples run up to and including
    the first one that broke a property (shrinking comes after)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.seen = 0
        self.first: int | None = None

    def __call__(self, phase: str, machine: Any) -> None:
        if phase == "setup":
            self.seen += 1
        elif phase == "teardown" and self.first is None and machine.violation is not None:
            self.first = self.offset + self.seen


def fuzz_for(spec, seconds: float, database: ExampleDatabase, target=None,
             first_round: int = 20) -> dict:
    """Fuzz ``spec`` for about ``seconds``; returns the last FuzzResult and
    totals over the rounds."""
    from impl.target import make_target
    from properties.machine import fuzz

    target = target or make_target(spec.target)
    rec = RecordingDatabase(database)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    examples, events, witness, expected = 0, Counter(), Counter(), set()
    rounds, first, res = 0, None, None
    n = first_round
    while True:
        counter = _FirstFailure(examples)
        res = fuzz(spec, examples=n, database=rec, target=target, on_example=counter)
        rounds += 1
        examples += res.stats.examples
        events.update(res.stats.events)
        witness.update(res.stats.witness)
        expected |= res.stats.expected
        if res.violation is not None or res.crash is not None:
            first = counter.first
            break
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        rate = n / max(res.seconds, 1e-3)  # in max_examples units, as asked for
        n = int(min(5000, max(5, rate * left * 0.9)))
    if res.violation is not None and first is None:
        first = examples  # a violation without a recorded teardown: be conservative
    return {"result": res, "examples": examples, "events": events, "witness": witness,
            "expected": expected, "rounds": rounds, "examples_to_fail": first,
            "replayed_from_database": rec.replayed, "saved_to_database": rec.saved,
            "seconds": time.perf_counter() - t0}


def run_row(row: dict, seconds: float, db_path: str, reports: Path) -> dict:
    """Run one matrix row (see the module docstring); returns its result."""
    t0 = time.perf_counter()
    out = {**row, "ok": False, "verdict": "", "detail": "", "examples": 0,
           "examples_per_s": 0.0, "events": {}, "witnesses": {}, "expected": [],
           "vacuous": [], "seconds": 0.0, "examples_to_fail": None,
           "replayed_from_database": 0, "trace": None, "png": None, "reproducer": None}
    try:
        if row.get("unavailable"):
            out.update(verdict="UNAVAILABLE", detail=row["unavailable"])
            return out
        _run(row, seconds, db_path, reports, out)
    except Unsupported as e:  # the target refused a config or event the fuzzer drew
        out.update(verdict="UNSUPPORTED", detail=f"{str(e).strip()[:2000]}")
    except Exception as e:  # noqa: BLE001 - a harness failure is a failed row, with its reason
        out.update(verdict="HARNESS ERROR",
                   detail=f"{type(e).__name__}: {str(e).strip()[:2000]}\n"
                          + traceback.format_exc()[-3000:])
    finally:
        out["seconds"] = round(time.perf_counter() - t0, 2)
        d = reports / "rows"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{row['id']}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


def _run(row: dict, seconds: float, db_path: str, reports: Path, out: dict) -> None:
    from impl.target import fit_spec, make_target
    from properties.database import open_database
    from properties.machine import FuzzSpec
    from properties.replay import format_timeline, replay
    from properties.report import write_report

    k = row.get("knobs") or {}
    spec = FuzzSpec(target=row["target"], kind=row["kind"], policy=row["policy"],
                    depth=k.get("depth"), spec_tokens=k.get("spec_tokens"),
                    hazard=k.get("hazard"), prefix_caching=k.get("prefix_caching"),
                    block_size=k.get("block_size"), external=k.get("external", True),
                    aligned_loads=k.get("aligned_loads", True),
                    fail_loads=k.get("failed_loads", True), max_steps=k.get("steps"))
    target = make_target(row["target"])
    try:
        fit_spec(row["target"], target.capabilities, spec)
    except Unsupported as e:
        out.update(verdict="UNSUPPORTED", detail=str(e))
        return
    run = fuzz_for(spec, seconds, open_database(db_path), target)
    res = run["result"]
    out.update(examples=run["examples"], events=dict(run["events"]),
               witnesses=dict(run["witness"]), expected=sorted(run["expected"]),
               examples_per_s=round(run["examples"] / max(run["seconds"], 1e-3), 1),
               examples_to_fail=run["examples_to_fail"],
               replayed_from_database=run["replayed_from_database"], rounds=run["rounds"])
    cdir = reports / "counterexamples"
    if res.crash is not None:
        out.update(verdict="TARGET FAILED", detail=res.crash.strip()[:3000])
        if res.trace is not None:
            out["trace"] = str(res.trace.save(cdir / f"{row['id']}-crash.json"))
        return
    if res.violation is not None:
        v = res.violation
        path = res.trace.save(cdir / f"{row['id']}.json")
        out["trace"] = str(path)
        rr = replay(res.trace, target)
        rep = write_report(rr, cdir, path.stem, row["target"])
        out.update(png=str(rep.png) if rep.png else None,
                   reproducer=str(rep.reproducer) if rep.reproducer else None)
        out.update(verdict=f"VIOLATION p{v.prop} ({v.name})",
                   detail=f"{v}\nafter shrinking to {len(res.trace.events)} events; "
                          f"trace {path}\n\n{format_timeline(rr)}")
        return
    vac = sorted(w for w in run["expected"] if not run["witness"].get(w))
    if vac:
        out.update(verdict="VACUOUS", vacuous=vac,
                   detail=f"{run['examples']} examples never reached: {', '.join(vac)}")
        return
    out.update(ok=True, verdict="holds",
               detail=f"{run['examples']} examples, {sum(run['events'].values())} events")
