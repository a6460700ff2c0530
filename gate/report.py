"""What the gate says: a summary of about 40 lines (never more than 60) for
the terminal, the same summary in GitHub-flavoured Markdown at the top of
``gate.md`` (ready to paste as a review comment) with the rest below it,
grouped by verdict, property and kind, the shortest counterexample of each
group first; ``gate.json``; and JUnit XML, one test case per row."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gate.attribution import Fixed

VERDICTS = {0: "PASS", 1: "FAIL", 2: "UNSUPPORTED ROWS", 3: "TARGET FAILED", 4: "INCOMPLETE"}
SHOWN = 8  # introduced counterexamples listed one by one on the terminal
ORDER = ("introduced", "new", "harness error", "unavailable", "unsupported", "not covered",
         "not run", "changed", "on base", "known", "holds")


@dataclass
class GateRun:
    target: str
    base: Any  # gate.base.Base, or None (the nightly)
    changes: Any  # gate.base.Changes, or None
    workers: int
    minutes: float
    seconds: float
    results: list[dict]
    fixed: list[Fixed] = field(default_factory=list)
    fixed_tried: tuple[int, int] = (0, 0)  # finding traces replayed, there are
    notes: list[str] = field(default_factory=list)
    code: int = 0
    reports: Path | None = None
    junit: Path | None = None
    narrowed: str = ""  # how --rows / --kind narrowed the matrix
    probe: Any = None  # gate.coverage.Probe: the changed lines the rows execute

    @property
    def verdict(self) -> str:
        if self.code == 3 and any(r["status"] in ("introduced", "new") for r in self.results):
            return "FAIL"
        return VERDICTS[self.code]


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


def _counts(run: GateRun) -> str:
    c = Counter(r["status"] for r in run.results)
    fixed = len(run.fixed) + sum(1 for r in run.results if r.get("fixed_from_base"))
    parts = [f"introduced {c['introduced'] + c['new']}", f"also on base {c['on base']}",
             f"fixed {fixed}", f"hold {c['holds']}", f"not covered {c['not covered']}"]
    if c["changed"]:
        parts.insert(3, f"changed (frees later, safe) {c['changed']}")
    if c["not run"]:
        parts.append(f"not run (--fail-fast) {c['not run']}")
    if run.base is None:
        parts[1] = f"known {c['known']}"
    elif c["known"]:  # known findings the change exposes (gate.known.exposed)
        parts.insert(2, f"known, exposed {c['known']}")
    parts += [f"{k} {c[k]}" for k in ("unsupported", "unavailable", "harness error") if c[k]]
    return " · ".join(parts)


def _what(r: dict) -> str:
    return r["verdict"].split(": ", 1)[-1] if ": " in r["verdict"] else r["verdict"]


def _shortest(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r.get("length") is None, r.get("length") or 0, r["id"]))


def needed_seconds(run: GateRun) -> float:
    """About the budget that would cover every row: each covered row's time,
    three times the share of a row that ran but did not reach its witnesses,
    a covered row's mean for a row not started; over the workers, plus the
    start-up, and a fifth more."""
    from gate.rows import MIN_ROW_S

    done = [r["seconds"] for r in run.results if r["status"] != "not covered"]
    mean = max(MIN_ROW_S, sum(done) / len(done)) if done else 3 * MIN_ROW_S
    total = 0.0
    for r in run.results:
        if r["status"] != "not covered":
            total += max(MIN_ROW_S, r["seconds"])
        elif r["verdict"].startswith("not covered (not started"):
            total += mean
        else:
            total += 3 * max(MIN_ROW_S, r["seconds"])
    from gate.run import min_budget

    return 1.2 * (total / max(1, run.workers) + min_budget(run.target))


def summary(run: GateRun, md: bool = False) -> list[str]:
    """The summary, as terminal lines or (``md``) Markdown."""
    code = (lambda s: f"`{s}`") if md else (lambda s: s)
    res = run.results
    b = run.base
    head = f"gate {run.target}"
    if b is not None:
        head += f" against base {b.target} ({b.why})"
    out = []  # the terminal had the head and the changes when the run began
    if md:
        out = ["## " + head, ""]
        if run.changes is not None and b is not None and not b.same:
            out.append(f"changed: {run.changes.text()}")
    if run.probe is not None and run.changes is not None:
        if md:
            out.append(run.probe.text(run.changes))
        missed = run.probe.missed(run.changes)
        if missed:
            out.append(f"not reached by any row: {', '.join(missed[:3])}"
                       + (f" and {len(missed) - 3} more in gate.md" if len(missed) > 3 else "")
                       + " (what the gate did not see)")
    ex = sum(r.get("examples", 0) for r in res)
    out.append(f"{len(res)} rows{run.narrowed} on {run.workers} worker(s), budget "
               f"{run.minutes:g} min; {ex:,} examples in {_clock(run.seconds)}")
    out.append(("**" if md else "") + _counts(run) + ("**" if md else ""))
    bad = _shortest([r for r in res if r["status"] in ("introduced", "new")])
    if bad:
        out += ["", "introduced (fails on the target, holds on the base):" if b is not None
                else "new (no known finding explains it):"]
        for r in bad[:SHOWN]:
            n = f", {r['length']} events" if r.get("length") is not None else ""
            out.append(f"- {code(r['id'])}: {_what(r)}{n}")
            msg = (r.get("detail") or "").strip().splitlines()
            if msg:
                out.append(f"  {msg[0][:200]}")
            paths = [f"{k} {code(r[key])}" for k, key in (("trace", "trace"), ("picture", "png"),
                                                          ("test", "reproducer")) if r.get(key)]
            if paths:
                out.append("  " + "; ".join(paths))
            if r.get("base_note"):
                out.append(f"  ({r['base_note'][:160]})")
        if len(bad) > SHOWN:
            out.append(f"- and {len(bad) - SHOWN} more in gate.md")
    changed = [r for r in res if r["status"] == "changed"]
    if changed:
        s = _shortest(changed)[0]
        out += ["", f"changed, safe (frees later than the settled rule, property 6): "
                    f"{len(changed)} row(s), e.g. {s['id']}: {code(s['trace'] or '-')}"]
    on = [r for r in res if r["status"] in ("on base", "known")]
    if on:
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in on:
            label = r.get("known_label") or f"unnamed {_what(r)}"
            if r["status"] == "known" and b is not None:  # exposed by the change
                label += " (exposed: on the target only; holds with its fix there)"
            groups[label].append(r)
        title = ("known findings:" if b is None else
                 "also on base, or known findings the change exposes (not failing the gate):"
                 if any(r["status"] == "known" for r in on) else
                 "also on base (pre-existing, not failing the gate):")
        out += ["", title]
        items = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        for label, rows in items[:8]:
            s = _shortest(rows)[0]
            n = f", shortest {s['length']} events" if s.get("length") is not None else ""
            out.append(f"- {label}: {len(rows)} row(s){n}")
        if len(items) > 8:
            out.append(f"- and {len(items) - 8} more groups in gate.md")
    if b is not None and not b.same:
        done, total = run.fixed_tried
        out += ["", f"fixed by this change ({done} of {total} finding traces replayed):"
                + ("" if run.fixed else " none")]
        out += [f"- {f.label}: {code(f.trace)} ({f.base_failure} on the base)"
                for f in run.fixed[:6]]
        db = [r for r in res if r.get("fixed_from_base")]
        if db:
            n = sum(r["fixed_from_base"] for r in db)
            out.append(f"- {n} failure(s) the database holds for the base hold on the target "
                       f"(rows {', '.join(r['id'] for r in db[:3])}"
                       + (" ..." if len(db) > 3 else "") + ")")
    nc = [r for r in res if r["status"] == "not covered"]
    if nc:
        lack = Counter(w for r in nc for w in (r.get("vacuous") or []))
        started = [r for r in nc if not r["verdict"].startswith("not covered (not started")]
        more = math.ceil(needed_seconds(run) / 60)
        out += ["", f"not covered: {len(nc)} row(s) did not reach their witnesses in their "
                    f"share ({len(nc) - len(started)} not started)"]
        out.append("  lacking: " + ", ".join(f"{w} {n}" for w, n in lack.most_common(5)))
        out.append(f"  what they test was not seen: rerun with --minutes {more}, or narrow "
                   f"with --rows / --kind")
    other = [r for r in res if r["status"] in ("unsupported", "unavailable", "harness error")]
    for r in other[:3]:
        first = ((r.get("detail") or "").strip().splitlines() or [""])[0]
        out.append(f"{r['status']}: {code(r['id'])}: {first[:160]}")
    fails = _shortest([r for r in res if r.get("length") is not None])
    if fails:
        s = fails[0]
        what = f"p{s['prop']}" if s.get("prop") else "crash"
        out += ["", f"shortest counterexample: {s['length']} events ({code(s['id'])}, {what}, "
                    f"{s['status']})"]
    tail = f"verdict: {run.verdict} (exit {run.code})"
    if run.reports is not None and not md:
        tail += f"; details {run.reports / 'gate.md'}"
        if run.junit is not None:
            tail += f", JUnit {run.junit}"
    out += ["", ("**" + tail + "**") if md else tail]
    return out


def table(results: list[dict]) -> str:
    lines = ["| row | verdict | examples | ex/s | witnesses | s |", "|---|---|---:|---:|---|---:|"]
    for r in results:
        exp = r.get("expected") or []
        wit = r.get("witnesses") or {}
        w = f"{sum(1 for x in exp if wit.get(x))}/{len(exp)}" if exp else "-"
        lines.append(f"| `{r['id']}` | {r['verdict']} | {r.get('examples', 0)} | "
                     f"{r.get('examples_per_s', 0):.1f} | {w} | {r.get('seconds', 0):.0f} |")
    return "\n".join(lines)


def markdown(run: GateRun) -> str:
    """gate.md: the summary, then each verdict's rows grouped by property and
    kind (the shortest counterexample first), the timelines of introduced
    counterexamples, the whole table, and what the matrix leaves out."""
    md = summary(run, md=True)
    by_status: dict[str, list[dict]] = defaultdict(list)
    for r in run.results:
        by_status[r["status"]].append(r)
    for status in ORDER:
        rows = by_status.get(status)
        if not rows:
            continue
        md += ["", f"## {status} ({len(rows)})"]
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for r in rows:
            groups[(r.get("known_label") or _what(r) if status not in ("holds",)
                    else "", r["kind"])].append(r)
        for (what, kind), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            g = _shortest(g)
            md += ["", f"### {what + ', ' if what else ''}{kind} ({len(g)})", ""]
            for r in g:
                n = f", {r['length']} events" if r.get("length") is not None else ""
                line = f"- `{r['id']}`{n}"
                if r.get("trace"):
                    line += f": `./kvcheck replay {r['trace']} --target {r['target']}`"
                md.append(line)
    for r in _shortest([r for r in run.results if r["status"] in ("introduced", "new")]):
        md += ["", f"### `{r['id']}`: {r['verdict']}", "", "```", r.get("detail") or ""]
        if r.get("timeline"):
            md += ["", r["timeline"]]
        md.append("```")
    if run.probe is not None and run.changes is not None and run.probe.missed(run.changes):
        md += ["", "## Changed lines no row executed", ""]
        md += [f"- `{m}`" for m in run.probe.missed(run.changes)]
    md += ["", "## All rows", "", table(run.results)]
    if run.notes:
        md += ["", "## Not in the matrix", ""] + [f"- {n}" for n in run.notes]
    return "\n".join(md) + "\n"


def write_junit(results: list[dict], path: Path, suite: str) -> None:
    """One test case ``test_row[ID]`` per row: an introduced (or new)
    counterexample, a row the target cannot run, a harness error fail; a row
    not covered is skipped with what it lacked, and so is a row whose
    counterexample is a known finding or fails on the base too (it tested
    nothing past that bug), with the finding or the base named. Written to a
    temporary file and renamed over ``path``."""
    def skipped(r: dict) -> bool:
        return r["exit"] in (2, 4) or (r["exit"] == 0 and r.get("status") in ("on base", "known"))

    el = ET.Element("testsuite", name=suite, tests=str(len(results)),
                    failures=str(sum(1 for r in results if r["exit"] in (1, 3))),
                    skipped=str(sum(1 for r in results if skipped(r))))
    for r in results:
        tc = ET.SubElement(el, "testcase", classname=suite, name=f"test_row[{r['id']}]",
                           time=f"{r.get('seconds', 0):.2f}")
        if r["exit"] in (1, 3):
            f = ET.SubElement(tc, "failure", message=f"{r['verdict']}: {r['detail']}"[:500])
            f.text = r.get("detail") or ""
        elif skipped(r):
            ET.SubElement(tc, "skipped", message=r["verdict"][:500])
    from report.output import replace_file

    root = ET.Element("testsuites", name=suite)
    root.append(el)
    replace_file(path, '<?xml version="1.0" encoding="utf-8"?>\n'
                 + ET.tostring(root, encoding="unicode"))


def provenance(targets: list[str], seed: int | None) -> dict[str, Any]:
    """What a run's verdicts depend on, written into ``gate.json`` and the
    nightly's ``summary.json`` so a result read later (or merged with other
    machines') says what made it: kvcheck's commit (``-dirty`` where its
    tracked files differ from it), the seed given (None: each row's own, in
    its result's ``seed``), the release each vLLM target runs on, Python's and
    Hypothesis's versions, the machine."""
    import platform
    import subprocess

    import hypothesis

    from gate.base import release_of

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", ""
    releases: dict[str, str | None] = {}
    for t in sorted(set(targets)):
        try:
            releases[t] = release_of(t) if t.startswith("vllm@") else None
        except Exception:  # noqa: BLE001 - a target that cannot resolve has no release
            releases[t] = None
    import os

    return {"kvcheck": (head + "-dirty" if dirty else head) if head else "unknown",
            "seed": seed, "vllm_releases": releases,
            "python": platform.python_version(), "hypothesis": hypothesis.__version__,
            "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                        "system": platform.platform()}}
