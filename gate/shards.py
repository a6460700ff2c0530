"""The gate split over CI's parallel jobs, and their reports joined again.

``gate --shard I/N`` runs the I-th of N parts of the matrix. The split is
deterministic: the rows (after ``--rows`` / ``--kind`` and the target's
refusals) are dealt longest first to the part with the least time so far,
by the seconds a row took in a gate run (:data:`COSTS`, kept in the
repository so every machine splits alike; ``scripts/row_costs.py`` writes it
from a run's ``gate.json``; a row it does not list counts as the mean). A
shard's budget is its rows' part of ``--minutes``: each row gets what the
whole run would give it. ``kvcheck merge DIR...`` joins the shards'
``gate.json`` into one report (``gate.md``, ``gate.json``, JUnit) with the
verdict the whole run's rows give.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

COSTS = Path(__file__).resolve().parent / "row_costs.json"


class ShardError(ValueError):
    """A shard or a merge that cannot be (exit 2)."""


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> (2, 4)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m[1]) <= int(m[2]) or int(m[2]) > 1000:
        raise ShardError(f"--shard {text!r}: give I/N with 1 <= I <= N <= 1000, e.g. 1/4")
    return int(m[1]), int(m[2])


def engine(target: str) -> str:
    """``vllm@0.33.0`` -> ``vllm``: the costs a row's target is timed under
    (one row id names the same row on every target of an engine)."""
    return target.partition("@")[0]


def load_costs(path: Path = COSTS) -> dict[str, float]:
    """``engine:row id`` -> seconds."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    rows = data.get("rows", {}) if isinstance(data, dict) else {}
    return {str(k): float(v) for k, v in rows.items()
            if isinstance(v, (int, float)) and v > 0}


def split(rows: list[dict], n: int, costs: dict[str, float] | None = None) -> list[list[dict]]:
    """``rows`` in ``n`` parts of about equal time, each in the rows' order."""
    costs = load_costs() if costs is None else costs
    costs = {r["id"]: costs[k] for r in rows
             if (k := f"{engine(r.get('target', ''))}:{r['id']}") in costs}
    known = [costs[r["id"]] for r in rows if r["id"] in costs]
    mean = sum(known) / len(known) if known else 1.0
    cost = {r["id"]: costs.get(r["id"], mean) for r in rows}
    load, parts = [0.0] * n, [set() for _ in range(n)]
    for r in sorted(rows, key=lambda r: (-cost[r["id"]], r["id"])):
        i = min(range(n), key=lambda k: (load[k], k))
        load[i] += cost[r["id"]]
        parts[i].add(r["id"])
    return [[r for r in rows if r["id"] in p] for p in parts]


def run_of(d: dict, reports: Path | None = None, junit: Path | None = None) -> Any:
    """A :class:`gate.report.GateRun` from a run's ``gate.json``."""
    from gate.attribution import Fixed
    from gate.base import Base, Changes
    from gate.coverage import Probe
    from gate.report import GateRun

    base = None
    if d.get("base") is not None:
        base = Base(d["base"], d.get("base_why", ""), bool(d.get("base_same")),
                    d.get("base_release"))
    p = d.get("probe")
    probe = None
    if p is not None:
        probe = Probe({k: set(v) for k, v in (d.get("changed_lines_executed") or {}).items()},
                      probes=p.get("probes", 0), seconds=p.get("seconds", 0.0),
                      kinds_read=set(p.get("kinds_read", ())))
    return GateRun(d["target"], base, Changes(d.get("changed") or {}), d.get("workers", 1),
                   d.get("minutes", 0.0), d.get("seconds", 0.0), d["rows"],
                   [Fixed(**f) for f in d.get("fixed", [])], tuple(d.get("fixed_tried", (0, 0))),
                   list(d.get("notes", [])), d["exit"], reports, junit, d.get("narrowed", ""),
                   probe)


def _load(folder: str) -> dict:
    p = Path(folder)
    p = p / "gate.json" if p.is_dir() else p
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ShardError(f"{folder}: no gate.json there (give a gate run's report folder)") \
            from None
    except (OSError, ValueError) as e:
        raise ShardError(f"{p}: not a gate report ({type(e).__name__})") from None
    if not isinstance(d, dict) or not isinstance(d.get("rows"), list) or "target" not in d:
        raise ShardError(f"{p}: not a gate report (no target or rows)")
    return d


def merge(folders: list[str], reports: str, junit: str | None = None,
          say: Any = print) -> int:
    """Join shards' reports into a fresh folder under ``reports``; the exit
    status of the joined rows."""
    from gate.report import markdown, summary, write_junit
    from gate.rows import exit_status
    from report.output import fresh_run_dir, replace_file

    runs = [_load(f) for f in folders]
    first = runs[0]
    for f, d in zip(folders, runs, strict=True):
        for key in ("target", "base"):
            if d.get(key) != first.get(key):
                raise ShardError(f"{f}: {key} {d.get(key)} is not {first.get(key)} (of "
                                 f"{folders[0]}): shards of one run share target and base")
        kv = (d.get("provenance") or {}).get("kvcheck")
        if kv != (first.get("provenance") or {}).get("kvcheck"):
            raise ShardError(f"{f}: made by kvcheck {kv}, {folders[0]} by another commit")
    seen: dict[str, str] = {}
    rows: list[dict] = []
    for f, d in zip(folders, runs, strict=True):
        for r in d["rows"]:
            if r["id"] in seen:
                raise ShardError(f"row {r['id']} is in {seen[r['id']]} and {f}: the shards "
                                 f"overlap")
            seen[r["id"]] = f
            rows.append(r)
    shards = [d.get("shard") for d in runs]
    if all(shards):
        counts = {s["count"] for s in shards}
        got = sorted(s["index"] for s in shards)
        if len(counts) == 1 and got != list(range(1, counts.pop() + 1)):
            say(f"note: shards {got} of {shards[0]['count']} joined: the rest are missing")
    executed: dict[str, set[int]] = {}
    probe = None
    for d in runs:
        for k, v in (d.get("changed_lines_executed") or {}).items():
            executed.setdefault(k, set()).update(v)
        if d.get("probe") is not None:
            p = d["probe"]
            probe = probe or {"probes": 0, "seconds": 0.0, "kinds_read": set()}
            probe["probes"] += p.get("probes", 0)
            probe["seconds"] = max(probe["seconds"], p.get("seconds", 0.0))
            probe["kinds_read"] |= set(p.get("kinds_read", ()))
    fixed = {f["trace"]: f for d in runs for f in d.get("fixed", [])}
    everything = max(d.get("matrix_rows") or 0 for d in runs)
    narrowed = (f" ({len(runs)} report(s) joined"
                + (f", of {everything} in the matrix" if len(rows) < everything else "") + ")")
    code = exit_status(rows)
    out = fresh_run_dir(Path(reports))
    junit_path = Path(junit) if junit else out / "junit.xml"
    joined = {**first, "rows": rows, "exit": code, "fixed": list(fixed.values()),
              "seconds": max(d.get("seconds", 0.0) for d in runs),
              "workers": sum(d.get("workers", 1) for d in runs),
              "minutes": max(d.get("minutes", 0.0) for d in runs),
              "notes": sorted({n for d in runs for n in d.get("notes", [])}),
              "changed_lines_executed": {k: sorted(v) for k, v in executed.items()} or None,
              "probe": None if probe is None else {**probe,
                                                   "kinds_read": sorted(probe["kinds_read"])},
              "narrowed": narrowed, "shard": None,
              "merged_from": [str(Path(f).resolve()) for f in folders]}
    run = run_of(joined, out, junit_path)
    joined["verdict"] = run.verdict
    replace_file(out / "gate.md", markdown(run))
    replace_file(out / "gate.json", json.dumps(joined, indent=1, default=str))
    write_junit(rows, junit_path, "kvcheck-gate")
    head = f"gate {run.target}"
    if run.base is not None:
        head += f" against base {run.base.target} ({run.base.why})"
    say(head)
    for line in summary(run):
        say(line)
    return code
