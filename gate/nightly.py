#!/usr/bin/env python3
"""The nightly fuzz job (``./kvcheck nightly``, ``make nightly``): every
target x kind x policy that should hold, fuzzed in parallel for a time
budget, with a persistent example database, and a report a reviewer can read
in the morning.

    NIGHTLY_MINUTES=30 ./kvcheck nightly [--reports DIR] [--db DIR] [--shard I/N]

The matrix (see :func:`build_matrix`): the reference target under the
``settled`` policy for full, sliding, chunked_local, mamba and hybrid; and
the gate's matrix (``gate/matrix.py``: every kind x hazard x depth x drafts x
prefix caching x failed loads) for the newest supported vLLM release
(``vllm@0.33.0``), its known findings listed as known. The rows run on the
gate's engine (:func:`gate.rows.run_rows`): each a fuzz run in a worker beside
its target, the budget spread over the cores. A target that cannot be loaded is a failed row that
says why, never a silent omission. ``KVCHECK_NIGHTLY_MATRIX`` restricts or
extends it, entries separated by commas::

    reference:sliding:optimistic:depth=2   only this row (and any others named)
    reference:*                            keep the default rows matching (fnmatch)
    +vllm@0.25.1:sliding                   the default rows plus this one
    -vllm@*                                the default rows without these

An entry is ``TARGET:KIND[:POLICY][:KEY=VALUE...]`` with keys ``depth``,
``spec_tokens``, ``hazard``, ``prefix_caching``, ``block_size``, ``external``,
``aligned_loads``, ``failed_loads``, ``steps``; a JSON list of such objects works too. The default
vLLM rows run with ``failed_loads=off``: they fuzz past the known failed-load
findings (findings/README.md), which tests/test_findings.py pins.

Why not HypoFuzz: the rows are independent, time-boxed Hypothesis runs with
a verdict each; HypoFuzz schedules test functions and reports through its
dashboard rather than a JUnit file; the persistent database we share with it
would be the only common part anyway. Each row gets the time left divided
among the rows left, times the workers (one per core by default).

The example database is the directory ``.hypothesis/kvcheck`` (``--db``), or
Redis when ``KVCHECK_REDIS_URL`` is set (:func:`properties.database.open_database`):
a failure found once is saved there and replayed first on every later night,
and ``summary.json`` says so per row (``replayed_from_database``,
``examples_to_fail``).

Writes into a fresh run folder ``reports/YYYYMMDD-HHMMSS/`` (``reports/latest``
links to the newest; an earlier night's folder is never written over):
``junit.xml`` (one ``test_row[ID]`` per row), ``summary.json``, ``summary.md``,
and per failing row under ``counterexamples/`` the trace, its picture
(``.png``) and a pytest reproducer (``test_*.py``).
Exit status (the gate's, :mod:`gate.rows`): 0 every row holds or is a known
finding, 1 a new counterexample, 3 a new crash or a target that cannot run,
4 incomplete (rows that did not reach their witnesses in their share), 2 a
bad matrix.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from gate.matrix import KNOBS, feature_rows, gate_matrix, row_id, target_label

KINDS = ("full", "sliding", "chunked_local", "mamba", "hybrid", "rswa", "sink")
REFERENCE_KINDS = ("full", "sliding", "chunked_local", "mamba", "hybrid")
DEFAULT_VLLM = "vllm@0.33.0"


class MatrixError(ValueError):
    pass


# ------------------------------------------------------------------ matrix


def _probe(target: str, cache: dict) -> tuple[object | None, str | None]:
    """Build the target once: (capabilities, None) or (None, why not)."""
    if target not in cache:
        try:
            from impl.target import make_target

            t = make_target(target)
            cache[target] = (t.capabilities, None)
            close = getattr(t, "close", None)
            if callable(close):
                close()
        except Exception as e:  # noqa: BLE001 - any reason is reported in the row
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            cache[target] = (None, f"target {target} unavailable: {type(e).__name__}: {msg}")
    return cache[target]


def make_row(target: str, kind: str, policy: str | None, knobs: dict, cache: dict,
             source: str) -> dict:
    caps, why = _probe(target, cache)
    fixed = getattr(caps, "fixed_policy", None) if caps is not None else None
    policy = policy or fixed or "settled"
    if caps is not None and why is None:
        if kind not in caps.kinds:
            why = f"target {target} does not support kind {kind}"
        elif fixed and policy not in (fixed, "settled"):
            why = f"target {target} implements the {fixed} policy, not {policy}"
        elif fixed:
            policy = fixed
    shown = policy if not fixed else None  # a target that implements its own: no policy
    return {"id": row_id(kind, knobs, target, shown), "target": target, "kind": kind,
            "policy": policy, "knobs": knobs, "unavailable": why, "source": source}


def default_matrix(cache: dict, vllm: str | None = DEFAULT_VLLM
                   ) -> tuple[list[dict], list[str]]:
    """The rows that should hold, and notes on kinds a target does not
    support (``vllm`` None: the reference's rows alone, nothing said of vLLM)."""
    rows = [make_row("reference", k, "settled", {}, cache, "default") for k in REFERENCE_KINDS]
    notes: list[str] = []
    if vllm is None:
        return rows, notes
    caps, why = _probe(vllm, cache)
    if caps is None:
        rows.append({"id": row_id("all", {}, vllm), "target": vllm, "kind": "all",
                     "policy": "-", "knobs": {}, "unavailable": why, "source": "default"})
    else:
        gate, notes = gate_matrix(vllm, caps)
        gate += feature_rows(vllm, caps)
        rows += [{**r, "id": f"{target_label(vllm)}-{r['id']}", "source": "default"}
                 for r in gate]
    return rows, notes


def parse_entry(text: str, cache: dict, source: str) -> dict:
    fields = [f.strip() for f in text.split(":")]
    ki = next((i for i, f in enumerate(fields) if f in KINDS and i > 0), None)
    if ki is None:
        raise MatrixError(f"matrix entry {text!r}: expected TARGET:KIND[:POLICY][:KEY=VALUE...] "
                          f"with KIND one of {', '.join(KINDS)}")
    target = ":".join(fields[:ki])
    kind = fields[ki]
    rest = fields[ki + 1:]
    policy = None
    if rest and "=" not in rest[0]:
        policy = rest.pop(0) or None
    knobs = {}
    for kv in rest:
        if "=" not in kv:
            raise MatrixError(f"matrix entry {text!r}: {kv!r} is not KEY=VALUE")
        k, v = kv.split("=", 1)
        knobs.update(_knob(k.strip(), v.strip(), text))
    if policy is not None:
        from model.policy import REGISTRY

        if policy not in REGISTRY:
            raise MatrixError(f"matrix entry {text!r}: unknown policy {policy!r} "
                              f"(known: {', '.join(REGISTRY)})")
    return make_row(target, kind, policy, knobs, cache, source)


def _knob(k: str, v, where: str) -> dict:
    if k not in KNOBS:
        raise MatrixError(f"matrix entry {where!r}: unknown key {k!r} (known: {', '.join(KNOBS)})")
    typ = KNOBS[k]
    try:
        if typ is bool:
            if isinstance(v, bool):
                return {k: v}
            if str(v).lower() not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
                raise ValueError(v)
            return {k: str(v).lower() in ("1", "true", "on", "yes")}
        return {k: typ(v)}
    except (TypeError, ValueError):
        raise MatrixError(f"matrix entry {where!r}: {k}={v!r} is not a {typ.__name__}") from None


def build_matrix(spec: str | None, cache: dict | None = None) -> tuple[list[dict], list[str]]:
    """The rows to run, from the default matrix and ``KVCHECK_NIGHTLY_MATRIX``."""
    cache = {} if cache is None else cache
    spec = (spec or "").strip()
    if spec.startswith("["):
        try:
            items = json.loads(spec)
        except json.JSONDecodeError as e:
            raise MatrixError(f"KVCHECK_NIGHTLY_MATRIX: not valid JSON ({e.msg})") from None
        rows = []
        for it in items:
            if not isinstance(it, dict) or "target" not in it or "kind" not in it:
                raise MatrixError(f"matrix entry {it!r}: needs 'target' and 'kind'")
            knobs = {}
            for k, v in it.items():
                if k not in ("target", "kind", "policy"):
                    knobs.update(_knob(k, v, json.dumps(it)))
            entry = ":".join([it["target"], it["kind"], it.get("policy") or ""])
            row = parse_entry(entry, cache, "env")
            row = make_row(row["target"], row["kind"], it.get("policy"), knobs, cache, "env")
            rows.append(row)
        return _dedupe(rows), []
    entries = [e.strip() for e in spec.replace(";", ",").split(",") if e.strip()]
    plus = [e[1:] for e in entries if e.startswith("+")]
    minus = [e[1:] for e in entries if e.startswith("-")]
    plain = [e for e in entries if e[0] not in "+-"]
    patterns = [e for e in plain if any(c in e for c in "*?[")]
    explicit = [e for e in plain if e not in patterns]
    notes: list[str] = []
    if explicit and not patterns:
        rows = []
    else:
        # patterns that keep no vLLM row, or a minus dropping them: the vLLM
        # target is neither started nor spoken of
        keeps = not patterns or any(fnmatch.fnmatchcase(DEFAULT_VLLM, p.split(":")[0])
                                    for p in patterns)
        dropped = any(fnmatch.fnmatchcase(DEFAULT_VLLM, m) for m in minus)
        rows, notes = default_matrix(cache, DEFAULT_VLLM if keeps and not dropped else None)
        if patterns:
            rows = [r for r in rows if any(_match(r, p) for p in patterns)]
    rows += [parse_entry(e, cache, "env") for e in explicit]
    rows += [parse_entry(e, cache, "env") for e in plus]
    rows = [r for r in rows if not any(_match(r, p) for p in minus)]
    if not rows:
        raise MatrixError(f"KVCHECK_NIGHTLY_MATRIX={spec!r} leaves no row to run")
    return _dedupe(rows), notes


def _match(row: dict, pattern: str) -> bool:
    name = f"{row['target']}:{row['kind']}:{row['policy']}"
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ":*")


def _dedupe(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in rows:
        if r["id"] not in seen:
            seen.add(r["id"])
            out.append(r)
    return out


# ------------------------------------------------------------------- run


def _db_label(db: str) -> str:
    url = os.environ.get("KVCHECK_REDIS_URL")
    if url:
        host = url.split("@")[-1]  # never print a password
        return f"redis {host}"
    return f"directory {db}"


def run(minutes: float, reports: Path, db: str, workers: int | None = None,
        matrix_spec: str | None = None, python: str = sys.executable,
        shard: tuple[int, int] | None = None, list_rows: bool = False) -> int:
    from gate.report import provenance, write_junit
    from gate.rows import exit_status, run_rows
    from report.output import OutputError, fresh_run_dir

    t0 = time.time()
    started = datetime.now(UTC)
    try:
        rows, notes = build_matrix(matrix_spec)
    except MatrixError as e:
        print(f"nightly: {e}", file=sys.stderr)
        return 2
    share = 1.0
    if shard is not None:
        from gate.shards import split

        part = split(rows, shard[1])[shard[0] - 1]
        share = len(part) / len(rows)  # each row gets what the whole job gives it
        rows = part
    if list_rows:
        for r in rows:
            print(r["id"])
        return 0
    if not rows:
        print(f"nightly: shard {shard[0]}/{shard[1]} holds no row", flush=True)
        return 0
    try:
        reports = fresh_run_dir(reports)  # a night's reports never replace another's
    except (OutputError, OSError) as e:
        print(f"nightly: --reports: {e}", file=sys.stderr)
        return 2
    budget = max(1.0, minutes * 60 * share) - (time.time() - t0)
    ncpu = os.cpu_count() or 1
    workers = max(1, min(workers or ncpu, len(rows)))
    print(f"nightly: {len(rows)} rows on {workers} worker(s), budget {minutes:g} min, "
          f"database {_db_label(db)}", flush=True)
    results = run_rows(rows, budget, workers, db, reports,
                       log=lambda line: print(line, flush=True))
    junit = reports / "junit.xml"
    write_junit(results, junit, "kvcheck-nightly")
    code = exit_status(results) if results else 1
    ok = code == 0
    summary = {"ok": ok, "exit": code, "passed": sum(1 for r in results if r["ok"]),
               "failed": sum(1 for r in results if r["exit"] not in (0, 4)),
               "not_covered": sum(1 for r in results if r["exit"] == 4), "rows": results,
               "junit": str(junit),
               "started": started.isoformat(timespec="seconds"),
               "seconds": round(time.time() - t0, 1),
               "minutes": minutes, "workers": workers, "cpus": ncpu,
               "per_row_seconds": round(budget * workers / max(1, len(rows)), 1),
               "database": _db_label(db), "notes": notes,
               "shard": None if shard is None else {"index": shard[0], "count": shard[1]},
               "provenance": provenance([r["target"] for r in rows], None)}
    (reports / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    md = format_markdown(summary, reports)
    (reports / "summary.md").write_text(md)
    print(md)
    return code


def _rel(p: str | None, base: Path) -> str | None:
    if not p:
        return None
    try:
        return os.path.relpath(p, base)
    except ValueError:
        return p


def format_markdown(s: dict, reports: Path) -> str:
    head = ("PASS" if s["ok"] else f"FAIL: {s['failed']} of {len(s['rows'])} rows" if s["failed"]
            else f"INCOMPLETE: {s.get('not_covered', 0)} of {len(s['rows'])} rows not covered")
    lines = [f"# kvcheck nightly: {head}", "",
             f"{s['started']}, {s['seconds']:.0f}s: budget {s['minutes']:g} min, "
             f"{len(s['rows'])} rows on {s['workers']} worker(s) ({s['cpus']} CPUs), "
             f"about {s['per_row_seconds']:.0f}s per row; example database: {s['database']}", "",
             "| row | verdict | examples | ex/s | events | witnesses | s | counterexample |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for r in s["rows"]:
        ev = sum((r.get("events") or {}).values())
        wit = r.get("witnesses") or {}
        exp = r.get("expected") or []
        wtxt = f"{sum(1 for w in exp if wit.get(w))}/{len(exp)}" if exp else "-"
        verdict = r["verdict"]
        if r.get("examples_to_fail") and not r.get("known"):
            verdict += f" at example {r['examples_to_fail']}"
        if r.get("replayed_from_database"):
            verdict += " (replayed from the database)"
        links = []
        for key, label in (("png", "picture"), ("reproducer", "reproducer"), ("trace", "trace")):
            rel = _rel(r.get(key), reports)
            if rel:
                links.append(f"[{label}]({rel})")
        lines.append(f"| `{r['id']}` | {verdict} | {r.get('examples', 0)} | "
                     f"{r.get('examples_per_s', 0):.1f} | {ev} | {wtxt} | "
                     f"{r.get('seconds', 0):.0f} | {' '.join(links)} |")
    bad = [r for r in s["rows"] if not r["ok"]]
    if bad:
        lines += ["", "## Failures"]
        for r in bad:
            lines += ["", f"### `{r['id']}`: {r['verdict']}", "", r.get("detail") or ""]
            if r.get("vacuous"):
                lines.append(f"never reached: {', '.join(r['vacuous'])}")
            if r.get("png"):
                lines += ["", f"![{r['id']}]({_rel(r['png'], reports)})"]
            if r.get("reproducer"):
                lines += ["", f"reproduce: `.venv/bin/python -m pytest {r['reproducer']}`"]
            if r.get("trace"):
                lines += [f"replay: `./kvcheck replay {r['trace']} --target {r['target']}`"]
    if s.get("notes"):
        lines += ["", "## Not in the matrix", ""] + [f"- {n}" for n in s["notes"]]
    return "\n".join(lines) + "\n"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    env_minutes = os.environ.get("NIGHTLY_MINUTES") or "30"
    ap.add_argument("--minutes", default=env_minutes,
                    help="time budget for the whole job (default $NIGHTLY_MINUTES or 30)")
    ap.add_argument("--reports", default=os.environ.get("KVCHECK_NIGHTLY_REPORTS", "reports"))
    ap.add_argument("--db", default=os.environ.get("KVCHECK_NIGHTLY_DB", ".hypothesis/kvcheck"),
                    help="example database directory (ignored when KVCHECK_REDIS_URL is set)")
    ap.add_argument("--workers", type=int, default=None, help="default: one per CPU")
    ap.add_argument("--shard", default=None, metavar="I/N",
                    help="run the I-th of N parts of the rows (the gate's split, "
                         "gate/shards.py); --minutes stays the whole job's budget")
    ap.add_argument("--list-rows", action="store_true",
                    help="print the ids of the rows it would run and run nothing")
    ap.add_argument("--releases", action="store_true",
                    help="print the vLLM releases the matrix names (what make nightly "
                         "installs) and run nothing")


EPILOG = ("example:\n  NIGHTLY_MINUTES=30 ./kvcheck nightly\n"
          "  KVCHECK_NIGHTLY_MATRIX='reference:*' ./kvcheck nightly --minutes 5\n"
          "exit 0 every row holds or is a known finding, 1 a new counterexample, 3 a new "
          "crash or a target that cannot run, 4 incomplete, 2 a bad matrix or usage")


def cmd(a: argparse.Namespace) -> int:
    """``./kvcheck nightly``."""
    try:
        minutes = float(a.minutes)
        given = f"--minutes {minutes}"
    except ValueError:
        minutes = math.nan
        given = (f"NIGHTLY_MINUTES={a.minutes!r:.40}" if a.minutes == os.environ.get(
            "NIGHTLY_MINUTES") else f"--minutes {a.minutes!r:.40}")
    if not (math.isfinite(minutes) and minutes > 0):
        print(f"nightly: {given}: the time budget must be a positive number of minutes",
              file=sys.stderr)
        return 2
    if a.workers is not None and a.workers < 1:
        print(f"nightly: --workers {a.workers}: must be at least 1", file=sys.stderr)
        return 2
    shard = None
    if a.shard is not None:
        from gate.shards import ShardError, parse_shard

        try:
            shard = parse_shard(a.shard)
        except ShardError as e:
            print(f"nightly: {e}", file=sys.stderr)
            return 2
    spec = os.environ.get("KVCHECK_NIGHTLY_MATRIX")
    if a.releases:
        try:
            print("\n".join(releases(spec)))
        except MatrixError as e:
            print(f"nightly: {e}", file=sys.stderr)
            return 2
        return 0
    db = a.db if os.path.isabs(a.db) else str((Path.cwd() / a.db).resolve())
    return run(minutes, Path(a.reports).resolve(), db, a.workers, spec, shard=shard,
               list_rows=a.list_rows)


def releases(spec: str | None) -> list[str]:
    """The vLLM releases the matrix names (read from its entries, without
    loading any target): the default rows' and every entry's ``vllm@X.Y.Z``."""
    import re

    spec = (spec or "").strip()
    if spec.startswith("["):
        try:
            items = json.loads(spec)
        except json.JSONDecodeError as e:
            raise MatrixError(f"KVCHECK_NIGHTLY_MATRIX: not valid JSON ({e.msg})") from None
        targets = [str(it.get("target", "")) for it in items if isinstance(it, dict)]
        default = False
    else:
        entries = [e.strip() for e in spec.replace(";", ",").split(",") if e.strip()]
        plain = [e for e in entries if e[0] not in "+-"]
        explicit = [e for e in plain if not any(c in e for c in "*?[")]
        default = not explicit or len(explicit) < len(plain)
        minus = [e[1:] for e in entries if e.startswith("-")]
        if default and any(fnmatch.fnmatchcase(DEFAULT_VLLM, m.split(":")[0]) for m in minus):
            default = False
        if default and plain and len(explicit) < len(plain) and not any(
                fnmatch.fnmatchcase(DEFAULT_VLLM, e.split(":")[0]) for e in plain
                if e not in explicit):
            default = False  # patterns that keep no vLLM row
        targets = [e.lstrip("+").split(":")[0] for e in entries if not e.startswith("-")]
    names = [DEFAULT_VLLM] if default else []
    names += [t for t in targets if re.fullmatch(r"vllm@\d+\.\d+\.\d+", t)]
    return sorted({t.partition("@")[2] for t in names})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvcheck nightly", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    add_arguments(ap)
    return cmd(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
