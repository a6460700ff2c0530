#!/usr/bin/env python3
"""The gate against vLLM slips it has never seen (issue: a gate a reviewer can trust).

Every vLLM row of ``scripts/mutants.py`` is built as a checkout (the release
with the one edit, :func:`mutants.mutant_tree`) and gated as a reviewer would
gate a pull request::

    ./kvcheck gate --target vllm@TREE --base vllm@0.33.0 --fail-fast --minutes 4

twice: with the changed-line probe (the default) and with ``--no-probe``
(every row an even share). A row that should be killed must end FAIL with an
*introduced* counterexample, and no known 0.33.0 finding may be marked
introduced; a harmless row must not FAIL. Rows whose mutant starts from a fix
(``Mutant.base``) are gated against the release with that fix.

    .venv/bin/python scripts/gate_sweep.py [--only NAME,...] [--minutes 4] [--mode probe|even]

Results are kept, row by row, in ``docs/gate-sweep.json`` (a later run adds
to them: the sweep can be run in parts); the table of every row measured so
far is written into ``docs/FIGURES.md`` between its markers. Exit status 0
every measured row as expected, 1 otherwise, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import mutants as M  # noqa: E402

from gate.known import with_fix  # noqa: E402

RESULTS = ROOT / "docs" / "gate-sweep.json"  # measurements kept with the figures they make
FIGURES = ROOT / "docs" / "FIGURES.md"
BEGIN, END = "<!-- gate-sweep:begin -->", "<!-- gate-sweep:end -->"
MODES = {"probe": [], "even": ["--no-probe"]}


def gated(m: M.Mutant) -> bool:
    """The rows the sweep gates: vLLM edits, not the controls (a control is
    the base itself)."""
    return m.subject == "vllm" and bool(m.file)


def gate_one(m: M.Mutant, mode: str, minutes: float, seed: int, work: Path) -> dict:
    tree = M.mutant_tree(m, work / f"{m.name}-{mode}" / "tree")
    reports = work / f"{m.name}-{mode}" / "reports"
    base = with_fix(f"vllm@{M.RELEASE}", m.base)
    cmd = [sys.executable, str(ROOT / "kvcheck"), "gate", "--target", f"vllm@{tree}",
           "--base", base, "--fail-fast", "--minutes", str(minutes), "--seed", str(seed),
           "--quiet", "--reports", str(reports), *MODES[mode]]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=minutes * 60 * 2 + 120)
    wall = round(time.monotonic() - t0, 1)
    row = {"mutant": m.name, "mode": mode, "wanted": m.outcome, "expect": sorted(m.expect),
           "exit": p.returncode, "wall_s": wall, "minutes": minutes, "seed": seed,
           "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
           "load": round(os.getloadavg()[0], 1), "lines": len(p.stdout.splitlines()),
           "commit": _commit()}
    js = reports / "latest" / "gate.json"
    if not js.is_file():
        row.update(verdict="ERROR", note=" ".join((p.stdout + p.stderr).split())[-300:])
        return row
    g = json.loads(js.read_text())
    intro = [r for r in g["rows"] if r["status"] == "introduced"]
    row.update(verdict=g["verdict"], introduced=len(intro),
               on_base=sum(r["status"] == "on base" for r in g["rows"]),
               first_s=min((r["ended_s"] for r in intro), default=None),
               props=sorted({r["prop"] for r in intro if r["prop"] is not None}),
               crashes=sum(r["prop"] is None for r in intro),
               first_row=min(intro, key=lambda r: r["ended_s"])["id"] if intro else None,
               known_introduced=_known_among(intro, base))
    return row


def _commit() -> str:
    """The checkout's commit, ``-dirty`` where files other than the sweep's
    own outputs (docs/) differ from it."""
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    d = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no",
                        "--", ".", ":(exclude)docs"], capture_output=True, text=True)
    return (r.stdout.strip() or "?") + ("-dirty" if d.stdout.strip() else "")


def _known_among(intro: list[dict], base: str) -> list[str]:
    """Introduced counterexamples that a known 0.33.0 finding explains by its
    shape and that fail on the base too (they should have been on the base).
    The shape alone is not enough: a slip can end in a finding's words (an
    EAGLE hash slip reads another continuation's KV, as finding 6 does), and
    what decides is the base, replayed here apart from the gate."""
    from types import SimpleNamespace

    from gate.known import classify, in_repo, known_findings
    from impl.target import TargetCrash
    from model.events import Trace
    from properties.replay import replay

    findings = known_findings()
    out = []
    for r in intro:
        text = r.get("detail") or ""
        trace = Trace.load(r["trace"]) if r.get("trace") else None
        res = SimpleNamespace(
            trace=trace, spec=None, crash=text if r["prop"] is None else None,
            violation=None if r["prop"] is None else SimpleNamespace(prop=r["prop"],
                                                                     message=text))
        hit = classify(res, findings)
        if hit is None or trace is None:
            continue
        try:
            rr = replay(trace, in_repo(base))
            on_base = rr.crash is not None or rr.first is not None
        except TargetCrash:
            on_base = True
        if on_base:
            out.append(f"{r['id']}: {hit}")
    return out


def as_expected(row: dict) -> bool:
    if row["verdict"] == "ERROR" or row.get("known_introduced"):
        return False
    if row["wanted"] == "vacuous":
        # a slip that takes the freeing away (nothing to check): never a PASS
        return row["exit"] != 0
    if row["wanted"] == "survives" or row["expect"] == [6]:
        # harmless, or a safe slip that frees later (property 6 alone): the
        # gate lists it as changed and does not fail
        return row["exit"] != 1 and row["exit"] != 3
    return row["exit"] in (1, 3) and row["introduced"] > 0


def render(rows: list[dict]) -> str:
    by = {(r["mutant"], r["mode"]): r for r in rows}
    names = list(dict.fromkeys(r["mutant"] for r in rows))
    good = sum(as_expected(r) for r in rows)
    lines = [BEGIN, "", "## The gate against slips it has not seen (`scripts/gate_sweep.py`)", "",
             "Each vLLM row of `scripts/mutants.py`, built as a checkout and gated "
             "`--base vllm@0.33.0 --fail-fast --minutes M`, with the changed-line probe "
             "(*probe*) and without it (*even*, `--no-probe`). *first*: seconds from the "
             "gate's start to the end of the first row with an introduced counterexample; "
             "*wall*: the whole gate. Load: the 1-minute load average when the row ended "
             f"(2 cores). {good} of {len(rows)} gates as expected.", "",
             "| mutant | wanted | probe: verdict | first s | wall s | even: verdict | first s "
             "| wall s | properties | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        cells = []
        props, load = set(), []
        for mode in MODES:
            r = by.get((n, mode))
            if r is None:
                cells += ["-", "-", "-"]
                continue
            mark = "" if as_expected(r) else " **UNEXPECTED**"
            cells += [f"{r['verdict']}{mark}", str(r.get("first_s") or "-"), str(r["wall_s"])]
            props |= set(r.get("props") or [])
            load.append(str(r["load"]))
            wanted = r["wanted"]
        lines.append(f"| {n} | {wanted} | " + " | ".join(cells)
                     + f" | {', '.join(f'p{p}' for p in sorted(props)) or '-'} | "
                       f"{'/'.join(load)} |")
    firsts = {mode: sorted(r["first_s"] for r in rows if r["mode"] == mode and r.get("first_s"))
              for mode in MODES}
    med = {k: (v[len(v) // 2] if v else None) for k, v in firsts.items()}
    lines += ["", f"Median time to the first introduced counterexample: probe {med['probe']} s "
                  f"({len(firsts['probe'])} rows), even {med['even']} s "
                  f"({len(firsts['even'])} rows).", "", END]
    return "\n".join(lines) + "\n"


def write_figures(text: str) -> None:
    old = FIGURES.read_text() if FIGURES.is_file() else "# Figures\n"
    if BEGIN in old and END in old:
        head, _, rest = old.partition(BEGIN)
        _, _, tail = rest.partition(END)
        new = head + text.rstrip("\n") + tail
    else:
        new = old.rstrip("\n") + "\n\n" + text
    FIGURES.write_text(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--mode", action="append", choices=list(MODES), default=[],
                    help="probe, even, or both (default)")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    rows_all = [m for m in M.MUTANTS if gated(m)]
    names = [n for n in a.only.split(",") if n]
    unknown = set(names) - {m.name for m in rows_all}
    if unknown:
        print(f"gate_sweep: not a gated vLLM mutant: {', '.join(sorted(unknown))}",
              file=sys.stderr)
        return 2
    chosen = [m for m in rows_all if not names or m.name in names]
    modes = a.mode or list(MODES)
    kept = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    ok = True
    with tempfile.TemporaryDirectory(prefix="kvcheck-gate-sweep-") as tmp:
        for m in chosen:
            for mode in modes if m.outcome != "survives" else ["probe"]:
                try:
                    row = gate_one(m, mode, a.minutes, a.seed, Path(tmp))
                except M.AnchorError as e:
                    print(f"gate_sweep: {e}", file=sys.stderr)
                    return 2
                kept = [r for r in kept if (r["mutant"], r["mode"]) != (m.name, mode)] + [row]
                RESULTS.parent.mkdir(parents=True, exist_ok=True)
                RESULTS.write_text(json.dumps(kept, indent=1) + "\n")
                ok &= as_expected(row)
                print(f"{m.name:36} {mode:5} {row['verdict']:10} exit {row['exit']} "
                      f"first {row.get('first_s')} s, wall {row['wall_s']} s "
                      f"{'ok' if as_expected(row) else 'UNEXPECTED'}", flush=True)
    order = {m.name: i for i, m in enumerate(M.MUTANTS)}
    kept.sort(key=lambda r: (order.get(r["mutant"], 10**6), r["mode"] != "probe"))
    write_figures(render(kept))
    print(f"table: {FIGURES} ({len(kept)} gates so far)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
