"""Rows run beside their targets within a deadline, spread over the workers.

Each row is one Hypothesis run in a worker beside the target
(:func:`properties.jobs.fuzz_job`), given the time left divided among the
rows left, so rows that end early leave their time to the rest. A failure is
shrunk by Hypothesis for about a row's share at most (then by
properties/minimize.py); a row that has not reached every witness its configs
can produce by the end of its share goes on for up to eight times its share more,
never past the deadline. A row not started by then is *not covered*.

A row's status:

=============  =====  ==================================================
status         exit   meaning
=============  =====  ==================================================
holds          0      every property held and every witness was reached
not covered    4      it did not reach its witnesses in its share (or ran
                      out of budget): says which it lacked
not run        4      not started: --fail-fast stopped the gate
introduced     1 / 3  its counterexample (a crash: 3) fails on the target
                      only (:mod:`gate.attribution`)
on base        0      its counterexample fails on the base the same way;
                      named when it is a known finding
changed        0      (property 6) the target frees later than the settled
                      rule where the base does not: safe, listed
known          0      (no base: the nightly) a known finding
new            1 / 3  (no base) a counterexample no finding explains
unsupported    2      the target refuses the row's configs
unavailable    3      the target cannot be loaded
harness error  3      kvcheck itself failed on the row
=============  =====  ==================================================
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from gate.attribution import OnBase, replay_on_base
from gate.base import Base
from gate.known import Finding, by_name, exposed, known_findings, name_of
from gate.matrix import spec_of

VACUOUS_GRACE = 8.0  # a vacuous row's extra time, in shares (properties.jobs.fuzz_job)
MIN_ROW_S = 1.5  # a row is not started with less than this left to it


def blank(row: dict) -> dict:
    return {**row, "ok": False, "status": "", "verdict": "", "detail": "", "known": None,
            "known_label": None, "known_how": None, "prop": None, "length": None, "examples": 0,
            "examples_per_s": 0.0, "events": {}, "witnesses": {}, "expected": [],
            "vacuous": [], "seconds": 0.0, "examples_to_fail": None,
            "replayed_from_database": 0, "trace": None, "png": None, "reproducer": None,
            "base_note": "", "timeline": None, "exit": 0, "borrowed_from_base": 0,
            "fixed_from_base": 0}


def _save(out: dict, reports: Path) -> None:
    d = reports / "rows"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{out['id']}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")


def not_run(row: dict, reports: Path, why: str, status: str = "not covered") -> dict:
    out = blank(row)
    out.update(status=status, verdict=f"{status} (not started: {why})",
               detail=why, vacuous=["any example"], exit=4)
    _save(out, reports)
    return out


def run_row(row: dict, seconds: float, db_path: str | None, reports: Path, slot: int = 0,
            findings: list[Finding] | None = None, seed: int | None = None,
            base: Base | None = None, hard_end: float | None = None) -> dict:
    """Fuzz one row beside its target for about ``seconds`` (never past
    ``hard_end``, time.monotonic); writes ``<reports>/rows/<id>.json`` (and a
    counterexample's trace, and for an introduced one its picture and
    reproducer, under ``<reports>/counterexamples/``); returns the result."""
    from impl.target import TargetError, Unsupported

    t0 = time.perf_counter()
    out = blank(row)
    if seed is None:  # Hypothesis's own randomness, but said: the row can be run again
        import random

        seed = random.SystemRandom().randrange(1, 2**31)
    out["seed"] = seed
    try:
        if row.get("unavailable"):
            out.update(status="unavailable", verdict="UNAVAILABLE", detail=row["unavailable"],
                       exit=3)
        else:
            _run(row, seconds, db_path, reports, slot,
                 known_findings() if findings is None else findings, seed, base,
                 hard_end if hard_end is not None else time.monotonic() + 4 * seconds + 30,
                 out)
    except Unsupported as e:
        out.update(status="unsupported", verdict="UNSUPPORTED", detail=str(e).strip()[:2000],
                   exit=2)
    except TargetError as e:
        out.update(status="unavailable", verdict="UNAVAILABLE", detail=str(e).strip()[:2000],
                   exit=3)
    except Exception as e:  # noqa: BLE001 - a harness failure is a failed row, with its reason
        out.update(status="harness error", verdict="HARNESS ERROR", exit=3,
                   detail=f"{type(e).__name__}: {str(e).strip()[:2000]}\n"
                          + traceback.format_exc()[-3000:])
    finally:
        out["ok"] = out["exit"] == 0
        out["seconds"] = round(time.perf_counter() - t0, 2)
        _save(out, reports)
    return out


NAME_S = 30.0  # the most a row spends naming what its base shows (gate.known.name_of)


def _fuzz(row: dict, seconds: float, db_path: str | None, slot: int, seed: int | None,
          hard_end: float, base: Base | None = None) -> Any:
    from impl.target import fit_spec, make_target
    from properties.jobs import WorkerGone, _call
    from properties.machine import FuzzResult, RunStats

    spec = spec_of(row)
    target = make_target(row["target"])
    fit_spec(row["target"], target.capabilities, spec)
    left = max(0.5, hard_end - time.monotonic())
    seconds = max(0.5, min(seconds, left))
    grace = min(VACUOUS_GRACE, max(0.0, (left - seconds) / seconds - 0.25))
    try:
        # a failure is shrunk for about a row's share at most (then by
        # properties/minimize.py): the rows after it keep their time
        return _call(row["target"], slot, "properties.jobs:fuzz_job",
                     (spec, 10**7, seed, db_path, seconds, 0, True, None,
                      max(1.0, min(seconds, 0.5 * (left - seconds))), grace,
                      # the failures the database holds for this row on the base
                      None if base is None or base.same else base.target,
                      # failures the base shows alike are passed over
                      None if base is None or base.same else base.target))
    except WorkerGone as e:  # it died or hung: the trace from its flight recorder
        from model.events import Trace

        res = FuzzResult(spec, RunStats(), crash=str(e))
        if e.example is not None:
            res.trace = Trace(e.example[0], list(e.example[1]),
                              meta={"target": row["target"], "violation": "target crash"})
        return res


def _run(row: dict, seconds: float, db_path: str | None, reports: Path, slot: int,
         findings: list[Finding], seed: int | None, base: Base | None, hard_end: float,
         out: dict) -> None:
    res = _fuzz(row, seconds, db_path, slot, seed, hard_end, base)
    st = res.stats
    out["borrowed_from_base"] = res.borrowed_from_base
    out.update(examples=st.examples, events=dict(st.events), witnesses=dict(st.witness),
               expected=sorted(st.expected),
               examples_per_s=round(st.examples / max(res.seconds, 1e-3), 1),
               examples_to_fail=res.examples_to_fail,
               replayed_from_database=res.replayed_from_database)
    verdict = res.verdict  # the one verdict of a fuzz run (FuzzResult.verdict)
    on = None
    own = res.base_result() if verdict in ("holds", "vacuous", "missed") else None
    if own is not None:  # every failure it met fails on the base alike
        out["passed_over"] = st.on_base
        res, verdict = own, own.verdict
        on = OnBase(True, f"{st.on_base} failing examples, each failing alike on the base")
    if verdict in ("holds", "vacuous", "missed"):
        if verdict == "holds":
            out.update(status="holds", verdict="holds",
                       detail=f"{st.examples} examples, {sum(st.events.values())} events")
        else:
            lack = res.vacuous or ["attention confirmation"]
            out.update(status="not covered", vacuous=lack, exit=4,
                       verdict=f"not covered (lacks {', '.join(lack)})",
                       detail=f"{st.examples} examples in {res.seconds:.0f}s never reached: "
                              f"{', '.join(lack)}")
        if res.borrowed_from_base:  # the base's saved failures: none fails here
            out["fixed_from_base"] = res.borrowed_from_base
        return
    crash = verdict == "crashed"
    v = res.violation
    what = f"p{v.prop} ({v.name})" if v is not None else "crash"
    line = (str(v) if v is not None
            else (res.crash.strip().splitlines() or ["the target crashed"])[-1])
    out.update(prop=v.prop if v is not None else None,
               length=len(res.trace.events) if res.trace is not None else 0, detail=line)
    cdir = reports / "counterexamples"
    # the base's replays run in its worker 0, which the gate started first
    if on is None and base is not None:
        on = replay_on_base(res, base, 0, min(10.0, seconds))
    release = base.release if base is not None else _release(row["target"])
    if on is None or on.fails:  # pre-existing (or, with no base, maybe known): name it
        # naming is worth a share, not the rows after it: at most NAME_S or
        # two shares (a fix's worker, once started, replays in a moment)
        known, how = name_of(res, findings, release, slot,
                             min(hard_end, time.monotonic() + max(NAME_S, 2 * seconds)))
        f = by_name(known, findings)
        if known is not None:
            out.update(known=known, known_label=f.label if f else known,
                       known_how="by its fix" if how else "by its shape")
        if on is not None:
            out.update(status="on base", verdict=f"also on base: {what}"
                       + (f", known: {out['known_label']}" if known else ""))
        elif known is not None:
            out.update(status="known", verdict=f"known: {out['known_label']}")
        else:
            out.update(status="new", verdict=("TARGET FAILED" if crash
                                              else f"VIOLATION {what}"), exit=3 if crash else 1)
        if res.trace is not None:
            stem = f"{row['id']}-{out['status'].replace(' ', '-')}"
            out["trace"] = str(res.trace.save(cdir / f"{stem}.json"))
        if out["status"] != "new":
            return
    elif v is not None and (v.facts or {}).get("fact") == "frees_later":
        # a behaviour change that frees later than the settled rule: safe (a
        # block held longer), listed, never failing the gate
        out.update(status="changed", exit=0, base_note=on.note,
                   verdict=f"changed: frees later than the settled rule ({what}), safe")
        if res.trace is not None:
            out["trace"] = str(res.trace.save(cdir / f"{row['id']}-changed.json"))
        return
    else:
        # a known finding the change only exposes: it holds with the finding's
        # fix applied to the target itself (gate.known.exposed)
        known = exposed(res, findings, row["target"], base.release, slot,
                        min(hard_end, time.monotonic() + max(NAME_S, 2 * seconds)))
        f = by_name(known, findings)
        if known is not None:
            out.update(status="known", known=known, known_label=f.label if f else known,
                       known_how="exposed", base_note=on.note,
                       verdict=f"known: {f.label if f else known}, exposed by this change "
                               f"({what} on the target only; it holds with that finding's fix "
                               f"applied to the target)")
            if res.trace is not None:
                out["trace"] = str(res.trace.save(cdir / f"{row['id']}-exposed.json"))
            return
        out.update(status="introduced", verdict=f"introduced: {what}", exit=3 if crash else 1,
                   base_note=on.note)
    if crash:
        out["detail"] = res.crash.strip()[:3000]
        if res.trace is not None and not out["trace"]:
            out["trace"] = str(res.trace.save(cdir / f"{row['id']}-crash.json"))
        return
    _report(res, row, cdir, slot, out)


def _release(target: str) -> str | None:
    from gate.base import release_of

    try:
        return release_of(target)
    except Exception:  # noqa: BLE001 - no release: no fix can name it
        return None


def _report(res: Any, row: dict, cdir: Path, slot: int, out: dict) -> None:
    """The counterexample's trace, timeline, picture and reproducer."""
    from properties.jobs import replay_beside
    from properties.replay import format_timeline
    from report.report import write_report

    path = Path(out["trace"]) if out["trace"] else res.trace.save(cdir / f"{row['id']}.json")
    out["trace"] = str(path)
    rr = replay_beside(res.trace, row["target"], slot=slot)
    rep = write_report(rr, cdir, path.stem, row["target"])
    out.update(png=str(rep.png) if rep.png else None,
               reproducer=str(rep.reproducer) if rep.reproducer else None,
               timeline=format_timeline(rr))


# ---------------------------------------------------------------- the rows


def warm(targets: list[str], workers: int) -> dict[str, str]:
    """Start every worker the rows will use, side by side; {target: why not}."""
    from impl.target import worker_for

    why: dict[str, str] = {}
    lock = threading.Lock()

    def one(t: str, slot: int) -> None:
        try:
            worker_for(t, slot)
        except Exception as e:  # noqa: BLE001 - the rows of that target say why
            with lock:
                why[t] = f"target {t} unavailable: {type(e).__name__}: " + (
                    str(e).strip().splitlines() or [""])[0]

    threads = [threading.Thread(target=one, args=(t, s), daemon=True)
               for t in targets for s in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return why


def run_rows(rows: list[dict], seconds: float, workers: int, db_path: str | None,
             reports: Path, log: Any = None, seed: int | None = None,
             base: Base | None = None, fail_fast: bool = False,
             on_progress: Any = None, deadline: float | None = None,
             findings: list[Finding] | None = None, origin: float | None = None
             ) -> list[dict]:
    """Every row, ``workers`` at once, within about ``seconds`` (the workers'
    start-up included), ending by ``deadline`` (time.monotonic) when given; a
    row gets the time left divided among the rows left, less a reserve for
    shrinking, attribution and reports. ``fail_fast``: no row starts after an
    introduced (or, without a base, new) counterexample. ``log(line)`` per
    finished row; ``on_progress(results so far)``. Each result's ``ended_s``:
    when the row ended, in seconds from ``origin`` (time.monotonic; default:
    this call)."""
    t0 = time.monotonic()
    origin = t0 if origin is None else origin
    findings = known_findings() if findings is None else findings
    targets = sorted({r["target"] for r in rows if not r.get("unavailable")})
    why = warm(targets, workers)
    rows = [{**r, "unavailable": r.get("unavailable") or why.get(r["target"])} for r in rows]
    deadline = deadline if deadline is not None else t0 + seconds
    reserve = min(60.0, max(3.0, 0.08 * seconds))
    # weights[i]: the weight of rows i, i+1, ... together
    weights = [0.0] * len(rows)
    acc = 0.0
    for i in range(len(rows) - 1, -1, -1):
        acc += rows[i].get("weight", 1.0)
        weights[i] = acc
    results: dict[int, dict] = {}
    nxt = [0]
    stop = [False]
    lock = threading.Lock()

    def slot_loop(slot: int) -> None:
        while True:
            with lock:
                i = nxt[0]
                if i >= len(rows):
                    return
                nxt[0] += 1
                left = weights[i]
            now = time.monotonic()
            # the time left over the rows left, by their weights (a row that
            # executes changed lines has more: gate.coverage)
            share = (deadline - reserve - now) * workers * rows[i].get("weight", 1.0) / left
            if stop[0]:
                r = not_run(rows[i], reports, "--fail-fast stopped the gate", "not run")
            elif share < MIN_ROW_S and deadline - reserve - now < MIN_ROW_S:
                r = not_run(rows[i], reports, "the budget ran out")
            else:
                r = run_row(rows[i], max(MIN_ROW_S, share), db_path, reports, slot,
                            findings, seed, base, hard_end=deadline - reserve / 2)
            r["ended_s"] = round(time.monotonic() - origin, 1)
            with lock:
                results[i] = r
                if fail_fast and r["status"] in ("introduced", "new"):
                    stop[0] = True
                done = [results[k] for k in sorted(results)]
            if log is not None:
                log(f"{len(done)}/{len(rows)} {r['id']}: {r['verdict']} "
                    f"({r['examples']} examples, {r['seconds']:.0f}s)")
            if on_progress is not None:
                on_progress(done, len(rows))

    threads = [threading.Thread(target=slot_loop, args=(s,), daemon=True)
               for s in range(workers)]
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.2)
    except KeyboardInterrupt:
        from impl.worker import kill_all

        kill_all()
        raise
    return [results[i] for i in sorted(results)]


def exit_status(results: list[dict]) -> int:
    """3 an introduced (or new) crash or a target that cannot run, 1 an
    introduced (or new) violation, 2 rows the target refuses, 4 rows not
    covered, 0 every row holds or fails on the base too."""
    codes = {r["exit"] for r in results}
    for c in (3, 1, 2, 4):
        if c in codes:
            return c
    return 0
