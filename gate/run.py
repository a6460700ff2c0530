"""One gate run: the base, the matrix, the rows, the attribution, the reports.

``run_gate(GateOptions(...), say)`` returns the exit status and says the
summary through ``say`` (a line at a time); the command line
(:mod:`cli.gate`) only parses and prints. Every run writes into a fresh
folder ``REPORTS/<time>/`` (``gate.md``, ``gate.json``, ``junit.xml``,
``rows/``, ``counterexamples/``) and points ``REPORTS/latest`` at it; nothing
of an earlier run is written over. An explicit ``--junit PATH`` is replaced
atomically, as pytest writes ``--junitxml`` (:mod:`report.output`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gate.attribution import fixed_by_change
from gate.base import Changes, changed_lines, default_base, given_base
from gate.known import known_findings
from gate.matrix import feature_rows, gate_matrix, narrow, rare_first, spec_of
from gate.report import GateRun, markdown, provenance, summary, write_junit
from gate.rows import exit_status, run_rows
from report.output import fresh_run_dir, replace_file

# the least budget that starts the workers and runs one row (a vLLM worker
# imports vLLM for about 10-15 s on 2 cores)
MIN_BUDGET_S = {"vllm": 30.0, "sglang": 30.0, "reference": 5.0}
FIXED_SHARE = 0.1  # of the budget, at most, for replaying the findings on base and target


class BudgetError(ValueError):
    """A budget too small to run anything (exit 2)."""


@dataclass
class GateOptions:
    target: str
    base: str | None = None
    minutes: float = 10.0
    workers: int | None = None
    seed: int | None = None
    db: str | None = None
    reports: str = "reports/gate"
    junit: str | None = None
    rows: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    fail_fast: bool = False
    quiet: bool = False
    probe: bool = True  # time where the change is (gate.coverage); off: even shares
    shard: tuple[int, int] | None = None  # (I, N): the I-th of N parts (gate.shards)
    list_rows: bool = False  # say the rows' ids and run nothing


def refusal(target: Any, row: dict) -> str | None:
    """Why ``target`` cannot run ``row`` (a version without the path it
    takes), or None: the row's simplest config (Hypothesis's ``find`` on the
    config strategy) set up on the target."""
    from hypothesis import HealthCheck, find, settings
    from hypothesis.errors import NoSuchExample

    from impl.target import Unsupported, fit_spec
    from properties.machine import config_strategy

    spec = spec_of(row)
    try:
        fit_spec(row["target"], target.capabilities, spec)
        cfg = find(config_strategy(spec), lambda c: True,
                   settings=settings(database=None, max_examples=50,
                                     suppress_health_check=list(HealthCheck)))
        target.reset(cfg)
    except Unsupported as e:
        return " ".join(str(e).split())[:200]
    except NoSuchExample:
        return "no config of this row can be drawn"
    return None


def _runnable(rows: list[dict], target: Any, base: Any) -> tuple[list[dict], list[str]]:
    """The rows without the feature rows the target's version lacks, and a
    note on each left out. A row the target refuses but the base runs stays
    (the change broke that path: the row says how)."""
    from impl.target import make_target

    kept, notes, base_target = [], [], None
    for row in rows:
        why = refusal(target, row) if row.get("feature") else None
        if why and not base.same:
            base_target = base_target or make_target(base.target)
            if refusal(base_target, {**row, "target": base.target}) is None:
                why = None
        if why:
            notes.append(f"{row['id']}: left out, the target refuses it ({why})")
        else:
            kept.append(row)
    return kept, notes


def min_budget(target: str) -> float:
    return MIN_BUDGET_S.get(target.partition("@")[0], 30.0)


def run_gate(o: GateOptions, say: Any = print, ticker: Any = None) -> int:
    from impl.target import Unsupported, make_target
    from properties.jobs import default_workers

    t0 = time.monotonic()
    budget = o.minutes * 60
    if budget < min_budget(o.target):
        raise BudgetError(f"--minutes {o.minutes:g}: below the {min_budget(o.target):.0f} s "
                          f"that starting the workers and one row takes on {o.target}")
    target = make_target(o.target)  # an unknown or missing vLLM: exit 2 / 3 here
    base = given_base(o.target, o.base) if o.base else default_base(o.target)
    workers = o.workers or default_workers()
    hybrid_probe = getattr(target, "hybrid_failed_loads", None)
    hybrid_loads = ("hybrid" in target.capabilities.kinds and hybrid_probe is not None
                    and hybrid_probe())
    rows, notes = gate_matrix(o.target, target.capabilities, hybrid_failed_loads=hybrid_loads)
    rows += feature_rows(o.target, target.capabilities)
    everything = len(rows)
    rows = narrow(rows, o.rows, o.kinds)
    rows, left_out = _runnable(rows, target, base)
    rows = rare_first(rows)
    notes += left_out
    if not rows:
        raise Unsupported(f"--rows {' '.join(o.rows) or '-'} --kind {' '.join(o.kinds) or '-'}: "
                          f"no row of the {everything} in the matrix is left")
    narrowed = f" (of {everything})" if len(rows) < everything else ""
    shard = None
    if o.shard is not None:
        from gate.shards import split

        i, n = o.shard
        part = split(rows, n)[i - 1]
        shard = {"index": i, "count": n, "rows": len(part), "rows_all": len(rows)}
        budget *= len(part) / len(rows)  # each row gets what the whole run gives it
        narrowed = (f" (shard {i}/{n} of {len(rows)}"
                    + (f", of {everything} in the matrix" if len(rows) < everything else "")
                    + f"; {budget / 60:.1f} min of the budget)")
        rows = part
        if rows and budget < min_budget(o.target) and not o.list_rows:
            raise BudgetError(f"--minutes {o.minutes:g} --shard {i}/{n}: this shard's part "
                              f"({budget:.0f} s for {len(rows)} rows) is below the "
                              f"{min_budget(o.target):.0f} s that starting the workers and one "
                              f"row takes on {o.target}")
    if o.list_rows:
        for r in rows:
            say(r["id"])
        return 0
    reports = fresh_run_dir(Path(o.reports))
    db = str(Path(o.db).resolve()) if o.db else None
    changes = Changes() if base.same else changed_lines(o.target, base.target)
    say(f"gate {o.target} against base {base.target} ({base.why})")
    if not base.same:
        say(f"changed: {changes.text()}")
    deadline = t0 + budget
    findings = known_findings()
    fixed, tried = [], (0, 0)
    if not base.same:
        if ticker is not None:
            ticker.update("replaying the known findings on base and target", force=True)
        fixed, done, total = fixed_by_change(base, o.target,
                                             time.monotonic() + FIXED_SHARE * budget,
                                             changed=set(changes.files))
        tried = (done, total)

    probed = None
    if o.probe and changes.files and o.target.startswith("vllm@"):
        from gate.base import _tree_of
        from gate.coverage import prioritize, probe

        if ticker is not None:
            ticker.update("probing which rows execute the changed lines", force=True)
        probed = probe(rows, changes, o.target, _tree_of(o.target).parent,
                       deadline - time.monotonic(), workers, o.seed)
        rows = prioritize(rows, probed)
        say(probed.text(changes))

    def progress(done: list[dict], total: int) -> None:
        if ticker is None:
            return
        intro = sum(1 for r in done if r["status"] in ("introduced", "new"))
        ex = sum(r.get("examples", 0) for r in done)
        left = max(0, deadline - time.monotonic())
        ticker.update(f"gate: {len(done)}/{total} rows, {ex:,} examples, {intro} introduced, "
                      f"{int(left // 60)}:{int(left % 60):02d} left")

    results = run_rows(rows, deadline - time.monotonic(), workers, db, reports,
                       seed=o.seed, base=base, fail_fast=o.fail_fast, on_progress=progress,
                       deadline=deadline, findings=findings, origin=t0,
                       log=None if o.quiet or ticker is not None else None)
    if ticker is not None:
        ticker.close()
    code = exit_status(results)
    junit = Path(o.junit) if o.junit else reports / "junit.xml"
    run = GateRun(o.target, base, changes, workers, o.minutes, time.monotonic() - t0, results,
                  fixed, tried, notes, code, reports, junit, narrowed, probed)
    replace_file(reports / "gate.md", markdown(run))
    replace_file(reports / "gate.json", json.dumps(
        {"target": o.target, "base": base.target, "base_why": base.why,
         "base_same": base.same, "base_release": base.release, "exit": code,
         "verdict": run.verdict, "changed": changes.files,
         "fixed": [f.__dict__ for f in fixed], "fixed_tried": list(tried),
         "changed_lines_executed": None if probed is None else
         {k: sorted(v) for k, v in probed.executed.items()},
         "probe": None if probed is None else
         {"probes": probed.probes, "seconds": probed.seconds,
          "kinds_read": sorted(probed.kinds_read)},
         "workers": workers, "minutes": o.minutes, "seconds": run.seconds, "notes": notes,
         "narrowed": narrowed, "shard": shard, "matrix_rows": everything,
         "provenance": provenance([o.target, base.target], o.seed), "rows": results},
        indent=1, default=str))
    write_junit(results, junit, "kvcheck-gate")
    for line in summary(run):
        say(line)
    return code
