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
    g.add_argument("--shard", default=None, metavar="I/N",
                   help="run the I-th of N parts of the rows (for CI's parallel jobs: the same "
                        "split on every machine; each row gets what the whole --minutes would "
                        "give it); join the parts with ./kvcheck merge")
    g.add_argument("--list-rows", action="store_true",
                   help="print the ids of the rows it would run (of the shard, with --shard) "
                        "and run nothing")


def add_merge_parser(sub: Any) -> None:
    m = sub.add_parser(
        "merge", help="join the reports of gate shards (--shard I/N) into one",
        epilog="example:\n  ./kvcheck merge shard1/latest shard2/latest --reports reports/gate\n"
               "the exit status is the joined rows' verdict, as the gate's")
    m.add_argument("reports_in", nargs="+", metavar="REPORT_DIR",
                   help="a gate run's report folder (holding gate.json)")
    m.add_argument("--reports", default="reports/gate",
                   help="the joined gate.md, gate.json and junit.xml go into a fresh folder here")
    m.add_argument("--junit", default=None, help="also write the joined JUnit XML here")


def cmd_merge(a: Any) -> int:
    from cli.common import UsageError, usable_out
    from gate.shards import ShardError, merge
    from report.output import OutputError, check_named_file

    usable_out(a.reports, "--reports")
    try:
        if a.junit is not None:
            check_named_file(a.junit, "--junit")
        return merge(a.reports_in, a.reports, a.junit, say=lambda line: print(line, flush=True))
    except (ShardError, OutputError) as e:
        raise UsageError(str(e)) from None


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
    shard = None
    if a.shard is not None:
        from gate.shards import ShardError, parse_shard

        try:
            shard = parse_shard(a.shard)
        except ShardError as e:
            raise UsageError(str(e)) from None
    opts = GateOptions(a.target, a.base, a.minutes, a.workers, a.seed, a.db, a.reports,
                       a.junit, a.rows, a.kind, a.fail_fast, a.quiet, a.probe, shard,
                       a.list_rows)
    ticker = None if a.quiet or a.list_rows else Ticker()
    try:
        return run_gate(opts, say=lambda line: print(line, flush=True), ticker=ticker)
    except (BudgetError, OutputError) as e:
        raise UsageError(str(e)) from None
    finally:
        if ticker is not None:
            ticker.close()
