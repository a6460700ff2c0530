"""``./kvcheck check`` (``make check``): the main job and its verdict table.

1. prove: Z3 proofs for every kind under ``settled``, refutations of the
   broken policies;
2. fuzz: every kind and a hybrid config under ``settled`` on the target; a
   violation or a vacuous run fails the job;
3. power: the checker must still find the known bugs (``optimistic`` at
   depth 2 for sliding and chunked-local) - a checker that finds nothing
   there is broken, not reassuring;
4. attention: the fixed traces replayed through real attention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from model.events import Trace
from model.kinds import make_kind

ROOT = Path(__file__).resolve().parent.parent
ATTENTION_TRACES = ROOT / "traces" / "attention"  # found from the installation, any folder


@dataclass
class Row:
    part: str
    subject: str
    verdict: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0


def _fuzz_rows(a) -> list[Row]:
    from cli.main import save_trace
    from properties.machine import FuzzSpec, fuzz

    rows = []
    from model.events import KINDS

    for kind in (*KINDS, "hybrid"):
        spec = FuzzSpec(target=a.target, kind=kind, policy="settled")
        res = fuzz(spec, examples=a.examples, seed=a.seed)
        ev = sum(res.stats.events.values())
        verdict = res.verdict  # the one verdict of a fuzz run (FuzzResult.verdict)
        if verdict == "crashed":
            rows.append(Row("fuzz", kind, "target failed", False, res.crash.splitlines()[0],
                            res.seconds))
        elif verdict == "violation":
            path = save_trace(res.trace, Path(a.out), f"check-{kind}.json")
            rows.append(Row("fuzz", kind, f"VIOLATION p{res.violation.prop}", False,
                            f"{res.violation.message[:90]}... ({path})", res.seconds))
        elif verdict == "vacuous":
            rows.append(Row("fuzz", kind, "VACUOUS", False,
                            "never reached: " + ", ".join(res.vacuous), res.seconds))
        elif verdict == "holds":
            w = sum(1 for k in res.stats.expected if res.stats.witness.get(k))
            rows.append(Row("fuzz", kind, "holds", True,
                            f"{res.stats.examples} examples, {ev} events, "
                            f"{w}/{len(res.stats.expected)} witnesses", res.seconds))
        else:
            rows.append(Row("fuzz", kind, verdict.upper(), False, "", res.seconds))
    return rows


def _power_rows(a) -> list[Row]:
    from properties.machine import FuzzSpec, fuzz

    rows = []
    for kind, prop in (("sliding", 1), ("chunked_local", 1)):
        spec = FuzzSpec(target="reference", kind=kind, policy="optimistic", depth=2)
        res = fuzz(spec, examples=200, seed=a.seed)
        found = res.verdict == "violation" and res.violation.prop == prop
        n = len(res.trace.events) if res.trace else 0
        rows.append(Row("power", f"optimistic {kind} d2", "found" if found else "MISSED", found,
                        f"property {res.violation.prop if res.violation else '-'} in {n} events",
                        res.seconds))
    return rows


def _prove_rows(a) -> list[Row]:
    try:
        from cli.main import save_trace
        from model.policy import EXPECTED_SAFE
        from prove import proof
    except ImportError as e:
        return [Row("prove", "all", "MISSING", False, f"prove.proof not importable: {e}")]
    rows = []
    for r in proof.prove_all():
        # full attention (and sink, its sibling) frees nothing out of window:
        # every policy is safe there
        should_hold = r.policy in EXPECTED_SAFE or not make_kind(r.kind).frees_early
        expected_ok = r.status == ("proved" if should_hold else "refuted")
        verdict = r.status
        detail = r.covers if r.status == "proved" else r.detail
        if r.trace is not None:
            path = save_trace(r.trace, Path(a.out), f"prove-{r.kind}-{r.policy}.json")
            detail = f"trace {path}"
        rows.append(Row("prove", f"{r.kind} {r.policy}", verdict, expected_ok, detail[:100],
                        r.seconds))
    for b in proof.admission_bounds():
        ok = b.status == "proved"
        rows.append(Row("prove", f"bound {b.kind}", b.status, ok,
                        f"{b.formula}; sufficient {b.sufficient}, tight {b.tight}"[:100],
                        b.seconds))
    return rows


def _attention_rows(a) -> list[Row]:
    try:
        from confirm.attention import replay_attention
    except ImportError as e:
        return [Row("attention", "all", "MISSING", False, f"confirm.attention: {e}")]
    rows = []
    for path in sorted(ATTENTION_TRACES.glob("*.json")):
        t0 = time.perf_counter()
        trace = Trace.load(path)
        on = trace.meta.get("target", "reference")
        if on != "reference":  # a layout only that target builds: make attention runs it there
            rows.append(Row("attention", path.stem, "not run here", True,
                            f"its layout is {on}'s: make attention replays it there",
                            0.0))
            continue
        rep = replay_attention(trace, target_spec="reference")
        expect_bad = bool(trace.meta.get("expect_violation"))
        ok = (not rep.ok) if expect_bad else rep.ok
        verdict = ("garbled/NaN as expected" if expect_bad and not rep.ok
                   else "clean" if rep.ok else "GARBLED")
        if expect_bad and rep.ok:
            verdict = "MISSED"
        rows.append(Row("attention", path.stem, verdict, ok,
                        f"{rep.device} max err {rep.max_err:.2e}, NaN reads {rep.nan_reads}",
                        time.perf_counter() - t0))
    if not rows:
        rows.append(Row("attention", str(ATTENTION_TRACES), "MISSING", False, "no traces"))
    return rows


def format_table(rows: list[Row]) -> str:
    w = [max(len(x) for x in col) for col in zip(
        *[(r.part, r.subject, r.verdict) for r in rows], strict=True)]
    out = [f"{'part':<{w[0]}}  {'subject':<{w[1]}}  {'verdict':<{w[2]}}  {'s':>6}  detail"]
    out.append("-" * (sum(w) + 30))
    for r in rows:
        out.append(f"{r.part:<{w[0]}}  {r.subject:<{w[1]}}  {r.verdict:<{w[2]}}  "
                   f"{r.seconds:6.1f}  {r.detail}")
    return "\n".join(out)


def run_check(a) -> int:
    """The parts not skipped, their table, ``OUT/check/<time>/check.md``
    (``OUT/check/latest`` points at it; the traces a part saves go there too)."""
    from report.output import fresh_run_dir

    t0 = time.perf_counter()
    run_dir = fresh_run_dir(Path(a.out) / "check")
    a.out = str(run_dir)
    rows: list[Row] = []
    parts = [("prove", _prove_rows), ("fuzz", _fuzz_rows), ("power", _power_rows),
             ("attention", _attention_rows)]
    for name, fn in parts:
        if name in a.skip:
            continue
        new = fn(a)
        for r in new:
            print(f"[{r.part}] {r.subject}: {r.verdict} ({r.seconds:.1f}s)", flush=True)
        rows.extend(new)
    table = format_table(rows)
    ok = all(r.ok for r in rows)
    verdict = "PASS" if ok else "FAIL"
    print()
    print(table)
    print(f"\nverdict: {verdict} ({time.perf_counter() - t0:.0f}s)")
    from report.output import replace_file

    replace_file(run_dir / "check.md",
                 f"# kvcheck check\n\n```\n{table}\n```\n\nverdict: {verdict}\n")
    print(f"report: {run_dir / 'check.md'}")
    return 0 if ok else 1
