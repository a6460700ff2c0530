"""``./kvcheck gate``: parse, check the input, print. The engine is :mod:`gate`."""

from __future__ import annotations

import math
from typing import Any


def add_parser(sub: Any) -> None:
    import argparse

    from gate.matrix import KINDS

    g = sub.add_parser(
        "gate", help="fuzz the matrix a reviewer needs within a time budget, against a base",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  ./kvcheck gate --target vllm@$PWD/pr --minutes 10\n"
               "  ./kvcheck gate --target vllm@0.33.0+findings/NN-NAME/fix.diff "
               "--base vllm@0.33.0\n"
               "a counterexample found on the target is replayed on the base: introduced "
               "(fails on the target only: FAIL), also on base (listed, named when a known "
               "finding), and the findings fixed by the change are listed; exit 0 pass, "
               "1 an introduced counterexample, 3 an introduced crash or a target that cannot "
               "run, 4 incomplete (rows not covered in the budget), 2 bad input")
    g.add_argument("--target", required=True,
                   help="vllm@VERSION | vllm@PATH | vllm@VERSION+FIX.diff | reference")
    g.add_argument("--base", default=None,
                   help="what the target is compared with (default: a checkout's merge-base "
                        "with the branch it tracks, else the release it is laid over; a "
                        "release: itself)")
    g.add_argument("--minutes", type=float, default=10.0,
                   help="time budget of the whole gate (default 10); it ends within 10%% of it")
    g.add_argument("--rows", action="append", default=[], metavar="PATTERN",
                   help="only rows whose id matches (fnmatch, or a part of the id); repeatable")
    g.add_argument("--kind", action="append", default=[], choices=KINDS,
                   help="only rows of this kind; repeatable")
    g.add_argument("--fail-fast", action="store_true",
                   help="start no row after the first introduced counterexample")
    g.add_argument("--no-probe", dest="probe", action="store_false",
                   help="do not probe which rows execute the changed lines: every row gets "
                        "an even share of the budget")
    g.add_argument("--workers", type=int, default=None, metavar="N",
                   help="rows at once, each in a worker beside the target (default: one per core)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--db", default=None, help="Hypothesis example database directory")
    g.add_argument("--reports", default="reports/gate",
                   help="each run writes a fresh folder here (gate.md, gate.json, junit.xml, "
                        "rows/, counterexamples/) and points REPORTS/latest at it")
    g.add_argument("--junit", default=None,
                   help="also write JUnit XML here (replaced atomically, as pytest does)")
    g.add_argument("--quiet", action="store_true", help="no progress line")


def cmd_gate(a: Any) -> int:
    from cli.common import UsageError, usable_out
    from gate.run import BudgetError, GateOptions, run_gate
    from report.output import OutputError, check_named_file
    from report.progress import Ticker

    if not (math.isfinite(a.minutes) and a.minutes > 0):
        raise UsageError(f"--minutes {a.minutes}: the time budget must be a positive number")
    if a.workers is not None and a.workers < 1:
        raise UsageError(f"--workers {a.workers}: must be at least 1")
    if a.base is not None and not a.base.strip():
        raise UsageError("--base '': name a target (vllm@VERSION, vllm@PATH)")
    if a.db is not None:
        from properties.database import open_database

        open_database(a.db)
    usable_out(a.reports, "--reports")
    if a.junit is not None:
        try:
            check_named_file(a.junit, "--junit")
        except OutputError as e:
            raise UsageError(str(e)) from None
    opts = GateOptions(a.target, a.base, a.minutes, a.workers, a.seed, a.db, a.reports,
                       a.junit, a.rows, a.kind, a.fail_fast, a.quiet, a.probe)
    ticker = None if a.quiet else Ticker()
    try:
        return run_gate(opts, say=lambda line: print(line, flush=True), ticker=ticker)
    except (BudgetError, OutputError) as e:
        raise UsageError(str(e)) from None
    finally:
        if ticker is not None:
            ticker.close()
