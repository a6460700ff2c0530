"""The gate (``./kvcheck gate``) and the nightly job's engine: a matrix of fuzz
rows run beside their targets within a time budget, spread over the cores.

The matrix a reviewer needs for one vLLM (:func:`gate_matrix`): every kind
the release supports x hazard ordered / unordered x depth 1 / 2 / 3 (pipeline
parallel) x drafts off / on (2 draft tokens) x prefix caching off / on x
connector loads that never fail / may fail (unordered only: loads need a
KV-consumer connector). Rows the target cannot run are left out with the
reason (Mamba's align mode: prefix caching on; failed loads need a
single KV-cache group). ``scripts/nightly.py`` runs the same rows (and the
reference's) through :func:`run_rows` with a longer budget.

A counterexample that is one of the known findings (``findings/*.json``) is
listed as known, not as a failure: its property and the text ``meta.expect``
(or the crash text ``meta.crash``) match, the counterexample holds every event
type of the finding's trace, its groups include the finding's kinds, and its
drafter and load-failure policy are the finding's (in a crash's text a number
stands for any number). A counterexample with a finding's property and text
but another shape (another kind, other events) is known when it holds on that
finding's fix (``meta.fixed_by``, replayed beside ``TARGET+FIX.diff``, only on
the release the finding was found on): "known: NAME (gone on its fix)".
Anything else (a violation, a crash, a row that never reached a situation its
configs can produce) fails the gate.

Each row is one Hypothesis run in a worker beside the target
(:func:`properties.jobs.fuzz_job`), given the time left divided among the rows
left, so rows that end early (a known finding) leave their time to the rest; a
failure is shrunk by Hypothesis for about a row's share at most (then by
properties/minimize.py), so a row that fails does not eat the time of those
after it; a row that has not reached every witness its configs can produce
by the end of its share goes on for up to twice its share more.
Exit status: 0 every row holds or is known, 1 a new violation or a vacuous
row, 2 bad input, 3 the target failed (a crash no finding explains, or the
target cannot be loaded).
"""

from __future__ import annotations

import json
import re
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FINDINGS = ROOT / "findings"
DEPTHS = (1, 2, 3)
DRAFTS = 2  # draft tokens of a "drafts on" row
VACUOUS_GRACE = 2.0  # a vacuous row's extra time, in shares (properties.jobs.fuzz_job)
KNOBS = {"depth": int, "spec_tokens": int, "hazard": str, "prefix_caching": bool,
         "block_size": int, "external": bool, "aligned_loads": bool, "failed_loads": bool,
         "steps": int}


# ------------------------------------------------------------------ matrix


def row_id(target: str, kind: str, policy: str, knobs: dict) -> str:
    parts = [target.replace("@", "-").replace("/", "_").replace(":", "_"), kind, policy]
    parts += [f"{k}{_knob_text(v)}" for k, v in sorted(knobs.items())]
    return "-".join(parts)


def _knob_text(v: Any) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def make_row(target: str, kind: str, policy: str, knobs: dict, source: str = "gate",
             unavailable: str | None = None) -> dict:
    return {"id": row_id(target, kind, policy, knobs), "target": target, "kind": kind,
            "policy": policy, "knobs": knobs, "unavailable": unavailable, "source": source}


def gate_matrix(target: str, caps: Any, kinds: tuple[str, ...] | None = None,
                hybrid_failed_loads: bool = False) -> tuple[list[dict], list[str]]:
    """The rows of :data:`__doc__`'s matrix the target can run, and notes on
    what is left out. Hybrids get failed-load rows only on a tree that survives
    a block-level load failure on several KV-cache groups
    (``VllmTarget.hybrid_failed_loads``; unmodified releases crash there,
    findings/failed-load-hybrid-crashes-*)."""
    policy = caps.fixed_policy or "settled"
    order = ("full", "sliding", "chunked_local", "rswa", "mamba", "sink", "hybrid")
    kinds = tuple(k for k in (kinds or order) if k in caps.kinds)
    notes = [f"{target} does not support {k}: not in the matrix"
             for k in order if k not in caps.kinds]
    rows = []
    for kind in kinds:
        pinned = {name: value for name, value, _ in caps.pinned.get(kind, ())}
        for hazard in ("ordered", "unordered"):
            for depth in DEPTHS:
                for drafts in (0, DRAFTS):
                    if "spec_tokens" in pinned and pinned["spec_tokens"] != drafts:
                        continue
                    for prefix in (False, True):
                        if "prefix_caching" in pinned and pinned["prefix_caching"] != prefix:
                            continue
                        loads = (False,) if hazard == "ordered" else (False, True)
                        for fail in loads:
                            if fail and kind == "hybrid" and not hybrid_failed_loads:
                                continue
                            knobs = {"hazard": hazard, "depth": depth, "spec_tokens": drafts,
                                     "prefix_caching": prefix, "external": hazard == "unordered",
                                     "failed_loads": fail}
                            rows.append(make_row(target, kind, policy, knobs))
    if "mamba" in kinds:
        notes.append("mamba: prefix caching on only (vLLM's align mode here)")
    if "hybrid" in kinds and not hybrid_failed_loads:
        notes.append("hybrid: no failed-load rows (this tree crashes on a failed load over "
                     "several KV-cache groups, findings/failed-load-hybrid-crashes-*)")
    return rows, notes


def spec_of(row: dict):
    from properties.machine import FuzzSpec

    k = row.get("knobs") or {}
    return FuzzSpec(target=row["target"], kind=row["kind"], policy=row["policy"],
                    depth=k.get("depth"), spec_tokens=k.get("spec_tokens"),
                    hazard=k.get("hazard"), prefix_caching=k.get("prefix_caching"),
                    block_size=k.get("block_size"), external=k.get("external", True),
                    aligned_loads=k.get("aligned_loads", True),
                    fail_loads=k.get("failed_loads", True), max_steps=k.get("steps"))


# ---------------------------------------------------------- known findings


@dataclass(frozen=True)
class Finding:
    name: str
    prop: int | None  # None: a crash
    text: str
    events: frozenset[str]
    kinds: frozenset[str]
    drafter: str
    load_failure: str = "recompute"  # Config.kv_load_failure_policy of its trace
    target: str = ""  # the release it was found on (meta.target)
    fixed_by: str | None = None  # its fix, a diff for that release (meta.fixed_by)

    def says(self, message: str) -> bool:
        """Whether ``message`` carries this finding's text; in a crash's text
        each number stands for any number ("Cannot get 1 free blocks from the
        pool" says "Cannot get 3 free blocks from the pool"). A violation's
        text is matched as it is: its numbers name steps and requests."""
        if self.prop is not None:
            return self.text in message
        rx = re.sub(r"\d+", r"\\d+", re.escape(self.text))
        return re.search(rx, message) is not None


def known_findings(folder: Path = FINDINGS) -> list[Finding]:
    from model.events import Trace

    out = []
    for path in sorted(folder.glob("*.json")):
        t = Trace.load(path)
        m = t.meta
        if "+" in str(m.get("target", "")):
            continue  # a counterexample to a candidate fix, not a finding on a release
        crash = "crash" in m
        out.append(Finding(path.stem, None if crash else int(m.get("prop", 2)),
                           m["crash"] if crash else m["expect"],
                           frozenset(type(e).__name__ for e in t.events),
                           frozenset(g.kind for g in t.config.groups), t.config.drafter,
                           t.config.kv_load_failure_policy, str(m.get("target", "")),
                           m.get("fixed_by")))
    return out


def _signature_matches(res: Any, findings: list[Finding]) -> list[Finding]:
    """The findings whose property (or crash) and text the result shows."""
    out = []
    for f in findings:
        if res.crash is not None:
            if f.prop is None and f.says(res.crash):
                out.append(f)
        elif res.violation is not None and f.prop == res.violation.prop \
                and f.says(res.violation.message):
            out.append(f)
    return out


def classify(res: Any, findings: list[Finding]) -> str | None:
    """The known finding a fuzz result's counterexample is, or None."""
    trace = res.trace
    if trace is None and res.crash is None:
        return None
    # a crash while the scheduler is built has no events (and no trace)
    events = {type(e).__name__ for e in trace.events} if trace else set()
    kinds = {g.kind for g in trace.config.groups} if trace else {res.spec.kind}
    drafter = trace.config.drafter if trace else res.spec.drafter
    load_failure = trace.config.kv_load_failure_policy if trace else res.spec.load_failure
    matches = [f for f in _signature_matches(res, findings)
               if f.events <= events and f.kinds <= kinds and f.drafter == drafter
               and f.load_failure == load_failure]
    # the most specific finding: the one whose trace needs the most event types
    return max(matches, key=lambda f: (len(f.events), len(f.kinds))).name if matches else None


def classify_by_fix(res: Any, findings: list[Finding], target: str, slot: int = 0,
                    replay: Any = None) -> str | None:
    """A counterexample with a known finding's property and text but not its
    shape (another kind, other events), on the release that finding was found
    on: it is that finding when it no longer fails on the finding's fix
    (``TARGET+FIX.diff``, replayed beside it). None when no fix clears it."""
    if res.trace is None:
        return None
    if replay is None:
        from properties.jobs import replay_beside

        def replay(trace: Any, fixed: str) -> Any:
            return replay_beside(trace, fixed, slot=slot)
    tried: set[str] = set()
    for f in sorted(_signature_matches(res, findings), key=lambda f: f.name):
        if f.target != target or not f.fixed_by or f.fixed_by in tried:
            continue
        tried.add(f.fixed_by)
        rr = replay(res.trace, f"{target}+{f.fixed_by}")
        if rr.crash is None and not rr.violations:
            return f.name
    return None


# ----------------------------------------------------------------- one row


def _blank(row: dict) -> dict:
    return {**row, "ok": False, "verdict": "", "detail": "", "known": None, "examples": 0,
            "examples_per_s": 0.0, "events": {}, "witnesses": {}, "expected": [],
            "vacuous": [], "seconds": 0.0, "examples_to_fail": None,
            "replayed_from_database": 0, "trace": None, "png": None, "reproducer": None,
            "exit": 0}


def run_row(row: dict, seconds: float, db_path: str | None, reports: Path, slot: int = 0,
            findings: list[Finding] | None = None, seed: int | None = None) -> dict:
    """Fuzz one row beside its target for about ``seconds``; writes
    ``<reports>/rows/<id>.json`` (and a failure's trace, picture and
    reproducer under ``<reports>/counterexamples/``); returns the result."""
    from impl.target import TargetError, Unsupported

    t0 = time.perf_counter()
    out = _blank(row)
    try:
        if row.get("unavailable"):
            out.update(verdict="UNAVAILABLE", detail=row["unavailable"], exit=3)
        else:
            _run(row, seconds, db_path, reports, slot, findings or [], seed, out)
    except Unsupported as e:
        out.update(verdict="UNSUPPORTED", detail=str(e).strip()[:2000], exit=2)
    except TargetError as e:
        out.update(verdict="UNAVAILABLE", detail=str(e).strip()[:2000], exit=3)
    except Exception as e:  # noqa: BLE001 - a harness failure is a failed row, with its reason
        out.update(verdict="HARNESS ERROR", exit=3,
                   detail=f"{type(e).__name__}: {str(e).strip()[:2000]}\n"
                          + traceback.format_exc()[-3000:])
    finally:
        out["seconds"] = round(time.perf_counter() - t0, 2)
        d = reports / "rows"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{row['id']}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


def _run(row: dict, seconds: float, db_path: str | None, reports: Path, slot: int,
         findings: list[Finding], seed: int | None, out: dict) -> None:
    from impl.target import fit_spec, make_target
    from properties.jobs import WorkerGone, _call, replay_beside
    from properties.machine import FuzzResult, RunStats
    from properties.replay import format_timeline
    from report.report import write_report

    spec = spec_of(row)
    target = make_target(row["target"])
    fit_spec(row["target"], target.capabilities, spec)
    try:
        res = _call(row["target"], slot, "properties.jobs:fuzz_job",
                    # a failure is shrunk for about a row's share at most (then
                    # properties/minimize.py): the rows after it keep their time;
                    # a row still vacuous at its share's end goes on for up to
                    # twice its share more
                    (spec, 10**7, seed, db_path, max(0.5, seconds), 0, True, None,
                     max(2.0, seconds), VACUOUS_GRACE))
    except WorkerGone as e:  # it died or hung: the trace from its flight recorder
        from model.events import Trace

        res = FuzzResult(spec, RunStats(), crash=str(e))
        if e.example is not None:
            res.trace = Trace(e.example[0], list(e.example[1]),
                              meta={"target": row["target"], "violation": "target crash"})
    st = res.stats
    out.update(examples=st.examples, events=dict(st.events), witnesses=dict(st.witness),
               expected=sorted(st.expected),
               examples_per_s=round(st.examples / max(res.seconds, 1e-3), 1),
               examples_to_fail=res.examples_to_fail,
               replayed_from_database=res.replayed_from_database)
    cdir = reports / "counterexamples"
    known, how = classify(res, findings), ""
    if known is None and res.trace is not None:
        known, how = classify_by_fix(res, findings, row["target"], slot), " (gone on its fix)"
    if known is not None:
        out.update(ok=True, known=known, verdict=f"known: {known}{how}",
                   detail=str(res.violation or res.crash.strip().splitlines()[-1]))
        if res.trace is not None:
            out["trace"] = str(res.trace.save(cdir / f"{row['id']}-known.json"))
        return
    verdict = res.verdict  # the one verdict of a fuzz run (FuzzResult.verdict)
    if verdict == "crashed":
        out.update(verdict="TARGET FAILED", detail=res.crash.strip()[:3000], exit=3)
        if res.trace is not None:
            out["trace"] = str(res.trace.save(cdir / f"{row['id']}-crash.json"))
        return
    if verdict == "violation":
        v = res.violation
        path = res.trace.save(cdir / f"{row['id']}.json")
        out["trace"] = str(path)
        rr = replay_beside(res.trace, row["target"], slot=slot)
        rep = write_report(rr, cdir, path.stem, row["target"])
        out.update(png=str(rep.png) if rep.png else None,
                   reproducer=str(rep.reproducer) if rep.reproducer else None,
                   verdict=f"VIOLATION p{v.prop} ({v.name})", exit=1,
                   detail=f"{v}\nafter shrinking to {len(res.trace.events)} events; "
                          f"trace {path}\n\n{format_timeline(rr)}")
        return
    if verdict == "vacuous":
        out.update(verdict="VACUOUS", vacuous=res.vacuous, exit=1,
                   detail=f"{st.examples} examples never reached: {', '.join(res.vacuous)}")
        return
    out.update(ok=True, verdict="holds",
               detail=f"{st.examples} examples, {sum(st.events.values())} events")


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
             reports: Path, log: Any = None, seed: int | None = None) -> list[dict]:
    """Every row, ``workers`` at once, within about ``seconds`` (the workers'
    start-up included); a row gets the time left divided among the rows left
    (less a reserve for shrinking and reports)."""
    t0 = time.monotonic()
    findings = known_findings()
    targets = sorted({r["target"] for r in rows if not r.get("unavailable")})
    why = warm(targets, workers)
    rows = [{**r, "unavailable": r.get("unavailable") or why.get(r["target"])} for r in rows]
    deadline = t0 + seconds
    reserve = min(60.0, max(3.0, 0.1 * seconds))
    results: dict[int, dict] = {}
    nxt = [0]
    lock = threading.Lock()

    def slot_loop(slot: int) -> None:
        while True:
            with lock:
                i = nxt[0]
                if i >= len(rows):
                    return
                nxt[0] += 1
                left = len(rows) - i
            share = (deadline - reserve - time.monotonic()) * workers / left
            r = run_row(rows[i], max(1.0, share), db_path, reports, slot, findings, seed)
            with lock:
                results[i] = r
            if log is not None:
                log(f"{len(results)}/{len(rows)} {r['id']}: {r['verdict']} "
                    f"({r['examples']} examples, {r['seconds']:.0f}s)")

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
    codes = {r["exit"] for r in results}
    return 3 if 3 in codes else 1 if 1 in codes else 2 if 2 in codes else 0


# ------------------------------------------------------------------ reports


def write_junit(results: list[dict], path: Path, suite: str) -> None:
    """One test case ``test_row[ID]`` per row; a failing row has a failure
    with its verdict; a known finding passes and says which."""
    el = ET.Element("testsuite", name=suite, tests=str(len(results)),
                    failures=str(sum(1 for r in results if not r["ok"])))
    for r in results:
        tc = ET.SubElement(el, "testcase", classname=suite, name=f"test_row[{r['id']}]",
                           time=f"{r.get('seconds', 0):.2f}")
        if not r["ok"]:
            f = ET.SubElement(tc, "failure", message=f"{r['verdict']}: {r['detail']}"[:500])
            f.text = r.get("detail") or ""
        elif r.get("known"):
            ET.SubElement(tc, "system-out").text = f"known finding: {r['known']}"
    path.parent.mkdir(parents=True, exist_ok=True)
    root = ET.Element("testsuites", name=suite)
    root.append(el)
    ET.ElementTree(root).write(path, encoding="unicode", xml_declaration=True)


def _wit(r: dict) -> str:
    exp = r.get("expected") or []
    wit = r.get("witnesses") or {}
    return f"{sum(1 for w in exp if wit.get(w))}/{len(exp)}" if exp else "-"


def table(results: list[dict]) -> str:
    lines = ["| row | verdict | examples | ex/s | witnesses | s |", "|---|---|---:|---:|---|---:|"]
    for r in results:
        lines.append(f"| `{r['id']}` | {r['verdict']} | {r.get('examples', 0)} | "
                     f"{r.get('examples_per_s', 0):.1f} | {_wit(r)} | "
                     f"{r.get('seconds', 0):.0f} |")
    return "\n".join(lines)


def known_table(results: list[dict], findings: list[Finding]) -> str:
    hits: dict[str, list[str]] = {}
    for r in results:
        if r.get("known"):
            hits.setdefault(r["known"], []).append(r["id"])
    lines = ["| known finding | rows that stopped at it |", "|---|---|"]
    for f in findings:
        ids = hits.get(f.name, [])
        lines.append(f"| `{f.name}` | {len(ids)}" + (f" (first: `{ids[0]}`)" if ids else
                                                      " (not reached in this run)") + " |")
    return "\n".join(lines)


# --------------------------------------------------------------- the command


def run_gate(a: Any) -> int:
    from impl.target import make_target
    from properties.jobs import default_workers

    target = make_target(a.target)  # an unknown or missing vLLM: exit 2 / 3 here
    workers = a.workers or default_workers()
    probe = getattr(target, "hybrid_failed_loads", None)
    hybrid_loads = "hybrid" in target.capabilities.kinds and probe is not None and probe()
    rows, notes = gate_matrix(a.target, target.capabilities, hybrid_failed_loads=hybrid_loads)
    reports = Path(a.reports)
    reports.mkdir(parents=True, exist_ok=True)
    db = str(Path(a.db).resolve()) if a.db else None
    print(f"gate {a.target}: {len(rows)} rows on {workers} worker(s), budget {a.minutes:g} min",
          flush=True)
    t0 = time.monotonic()
    log = None if a.quiet else (lambda line: print(line, flush=True))
    results = run_rows(rows, a.minutes * 60, workers, db, reports, log, a.seed)
    code = exit_status(results)
    verdict = {0: "PASS", 1: "FAIL", 2: "UNSUPPORTED ROWS", 3: "TARGET FAILED"}[code]
    findings = known_findings()
    md = [f"# kvcheck gate {a.target}: {verdict}", "",
          f"{len(results)} rows, {sum(r['examples'] for r in results):,} examples in "
          f"{time.monotonic() - t0:.0f}s on {workers} worker(s) (budget {a.minutes:g} min)",
          "", table(results), "", "## Known findings", "", known_table(results, findings)]
    bad = [r for r in results if not r["ok"]]
    if bad:
        md += ["", "## Failures"]
        for r in bad:
            md += ["", f"### `{r['id']}`: {r['verdict']}", "", "```", r.get("detail") or "",
                   "```"]
            if r.get("trace"):
                md.append(f"replay: `./kvcheck replay {r['trace']} --target {r['target']}`")
    if notes:
        md += ["", "## Not in the matrix", ""] + [f"- {n}" for n in notes]
    text = "\n".join(md) + "\n"
    (reports / "gate.md").write_text(text)
    (reports / "gate.json").write_text(json.dumps({"target": a.target, "exit": code,
                                                   "rows": results}, indent=1, default=str))
    junit = Path(a.junit) if a.junit else reports / "junit.xml"
    write_junit(results, junit, "kvcheck-gate")
    print(text)
    print(f"verdict: {verdict} (exit {code}); {reports / 'gate.md'}, JUnit {junit}")
    return code

