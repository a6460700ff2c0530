"""Runs beside the target: parallel fuzz runs, a worker that dies or hangs.

A vLLM crash is injected with a patched tree (``vllm@0.33.0+DIFF``): the
third ``schedule()`` of every scheduler ends the process (``os._exit``) or
never returns. The run must end with exit 3 and the trace that did it (the
flight recorder's), not hang.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from properties.jobs import merge, run_fuzz, seeds, split
from properties.machine import FuzzSpec

ROOT = Path(__file__).resolve().parent.parent
SCHED = "vllm/v1/core/sched/scheduler.py"
LINE = "        self.current_step += 1\n"


def _diff(tmp_path: Path, name: str, inject: str) -> Path:
    src = (ROOT / ".vllm" / "0.33.0" / SCHED).read_text().splitlines(keepends=True)
    i = src.index(LINE)
    new = [*src[: i + 1], "        if self.current_step == 3:\n", f"            {inject}\n",
           *src[i + 1:]]
    text = "".join(difflib.unified_diff(src, new, f"a/{SCHED}", f"b/{SCHED}"))
    p = tmp_path / f"{name}.diff"
    p.write_text(text)
    return p


def _fuzz(tmp_path: Path, target: str, *extra: str, env: dict | None = None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, str(ROOT / "kvcheck"), "fuzz", "--target", target,
                           "--kind", "full", "--hazard", "ordered", "--no-external",
                           "--examples", "30", "--workers", "1", "--seed", "0", "--quiet",
                           "--out", str(tmp_path / "ce"), *extra],
                          capture_output=True, text=True, cwd=ROOT, env=e, timeout=400)


def test_split_and_seeds():
    assert split(10, 3) == [4, 3, 3] and split(2, 4) == [1, 1] and sum(split(7, 2)) == 7
    assert seeds(5, 3) == [5, 6, 7] and seeds(None, 2) == [None, None]


def test_reference_runs_in_parallel_merge_their_counts():
    spec = FuzzSpec(kind="sliding", policy="settled", depth=2, external=False)
    res = run_fuzz(spec, 40, workers=2, seed=3)
    assert res.workers == 2 and res.violation is None and res.crash is None
    assert res.stats.examples >= 40 and res.stats.events["Schedule"] > 0
    one = run_fuzz(spec, 20, workers=1, seed=3)
    # the first of the two runs is the one-worker run with the same seed and count
    assert res.stats.events["Schedule"] > one.stats.events["Schedule"]
    again = merge(spec, [one, one])
    assert again.stats.examples == 2 * one.stats.examples
    assert again.stats.witness == one.stats.witness + one.stats.witness


def test_parallel_runs_give_the_shortest_counterexample():
    spec = FuzzSpec(kind="sliding", policy="optimistic", depth=2, external=False)
    res = run_fuzz(spec, 100, workers=2, seed=1)
    assert res.violation is not None and res.violation.prop == 1 and res.trace is not None
    alone = [run_fuzz(spec, 50, workers=1, seed=s) for s in (1, 2)]
    assert all(r.trace is not None for r in alone)
    long, short = sorted(alone, key=lambda r: -len(r.trace.events))
    if len(long.trace.events) > len(short.trace.events):
        assert merge(spec, [long, short]).trace is short.trace
    crashed = run_fuzz(spec, 4, workers=1, seed=1)
    crashed.crash, crashed.violation = "boom", None
    assert merge(spec, [short, crashed]).crash == "boom"  # a crash comes first


@pytest.mark.vllm
def test_a_vllm_worker_that_dies_is_exit_3_with_its_trace(tmp_path):
    diff = _diff(tmp_path, "dies", "__import__('os')._exit(70)")
    p = _fuzz(tmp_path, f"vllm@0.33.0+{diff}")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "verdict: TARGET FAILED" in p.stdout and "exit status 70" in p.stdout, p.stdout
    saved = sorted((tmp_path / "ce").glob("crash-*.json"))
    assert saved, p.stdout
    trace = json.loads(saved[0].read_text())
    kinds = [e["type"] for e in trace["events"]]
    assert kinds.count("Schedule") == 3 and kinds[-1] == "Schedule", kinds
    # the saved trace replays to the same crash (a fresh worker: it was restarted)
    r = subprocess.run([sys.executable, str(ROOT / "kvcheck"), "replay", str(saved[0]),
                        "--target", f"vllm@0.33.0+{diff}", "--no-report"],
                       capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert r.returncode == 3 and "exit status 70" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.vllm
def test_a_vllm_worker_that_hangs_is_stopped_exit_3(tmp_path):
    diff = _diff(tmp_path, "hangs", "__import__('time').sleep(3600)")
    p = _fuzz(tmp_path, f"vllm@0.33.0+{diff}", env={"KVCHECK_HANG_TIMEOUT": "5"})
    assert p.returncode == 3, p.stdout + p.stderr
    assert "no event finished for 5s" in p.stdout, p.stdout
    saved = sorted((tmp_path / "ce").glob("crash-*.json"))
    kinds = [e["type"] for e in json.loads(saved[0].read_text())["events"]]
    assert kinds.count("Schedule") == 3 and kinds[-1] == "Schedule", kinds


def test_gate_matrix_and_known_findings():
    from gate.known import classify, known_findings, trace_path
    from gate.matrix import gate_matrix
    from gate.rows import exit_status
    from impl.target import Capabilities
    from model.events import Trace
    from properties.invariants import Violation
    from properties.machine import FuzzResult, RunStats

    caps = Capabilities(kinds=frozenset({"full", "mamba", "hybrid"}), fixed_policy="settled",
                        pinned={"mamba": (("prefix_caching", True, ""), ("spec_tokens", 0, ""))})
    rows, notes = gate_matrix("vllm@X", caps)
    by = {}
    for r in rows:
        by.setdefault(r["kind"], []).append(r["knobs"])
    assert len(by["full"]) == 36 and len(by["hybrid"]) == 24 and len(by["mamba"]) == 9
    assert all(k["prefix_caching"] and not k["spec_tokens"] for k in by["mamba"])
    assert not any(k["failed_loads"] and k["hazard"] == "ordered" for ks in by.values()
                   for k in ks)
    assert any("rswa" in n for n in notes)  # what the target lacks is said
    # a tree that survives failed loads on hybrids gets those rows too
    fixed = {r["id"] for r in gate_matrix("vllm@X", caps, hybrid_failed_loads=True)[0]}
    added = [r for r in gate_matrix("vllm@X", caps, hybrid_failed_loads=True)[0]
             if r["id"] not in {r["id"] for r in rows}]
    assert len(fixed) == len(rows) + 12 and all(
        r["kind"] == "hybrid" and r["knobs"]["failed_loads"] for r in added)
    findings = known_findings()
    assert findings
    for f in findings:
        t = Trace.load(trace_path(f.name))
        if f.prop is None:
            res = FuzzResult(None, RunStats(), crash=f"vLLM raised: {f.text}", trace=t)
        else:
            res = FuzzResult(None, RunStats(), violation=Violation(f.prop, f"... {f.text} ..."),
                             trace=t)
        # the finding itself, or one of the same signature (findings of one bug
        # on two configs of one shape are both known; either name is right)
        got = next(g for g in findings if g.name == classify(res, findings))
        assert (got.prop, got.text, got.events, got.kinds, got.drafter) == \
            (f.prop, f.text, f.events, f.kinds, f.drafter), (f.name, got.name)
    assert not any(f.name == "failed-load-rollback-to-held-window-reads-null" for f in findings)
    # the same message on a counterexample without the finding's events is new
    sliding = next(f for f in findings if f.name == "failed-load-recompute-reads-null-sliding")
    t = Trace.load(trace_path(sliding.name))
    t = Trace(t.config, [e for e in t.events if type(e).__name__ != "FailLoad"])
    res = FuzzResult(None, RunStats(), violation=Violation(2, "maps to the NULL block"), trace=t)
    assert classify(res, findings) is None
    assert exit_status([{"exit": 0}, {"exit": 1}]) == 1
    assert exit_status([{"exit": 1}, {"exit": 3}]) == 3 and exit_status([{"exit": 0}]) == 0


def test_gate_finding_text_and_load_failure_policy():
    from gate.known import classify, known_findings, trace_path
    from model.events import Trace
    from properties.invariants import Violation
    from properties.machine import FuzzResult, RunStats

    findings = {f.name: f for f in known_findings()}
    short = findings["mamba-align-load-admits-one-block-short"]
    # a crash's numbers stand for any number; a violation's are matched as written
    assert short.says("ValueError: Cannot get 3 free blocks from the pool")
    assert not short.says("ValueError: Cannot get free blocks from the pool")
    sync = findings["failed-load-fail-policy-sharer-reads-missing-kv-sync"]
    assert sync.load_failure == "fail" and sync.says("the output of step 0 for r1 counts")
    assert not sync.says("the output of step 1 for r1 counts")
    # the same text under the recompute policy is not the fail-policy finding
    t = Trace.load(trace_path(sync.name))
    v = Violation(2, "... the output of step 0 for r1 counts, but the step read ...")
    res = FuzzResult(None, RunStats(), violation=v, trace=t)
    assert classify(res, list(findings.values())) == sync.name
    from dataclasses import replace
    res.trace = Trace(replace(t.config, kv_load_failure_policy="recompute"), t.events)
    assert classify(res, list(findings.values())) != sync.name


def test_gate_known_by_the_findings_fix():
    """Finding failed-load-in-flight-output-delivered was found on full
    attention; the gate's counterexample on sliding has its text but not its
    kind. It is known because it holds on that finding's fix, replayed beside
    the patched tree; a fix that does not clear it leaves it new."""
    from gate.known import classify, classify_by_fix, known_findings
    from model.events import Trace
    from properties.jobs import replay_beside
    from properties.machine import FuzzResult, RunStats

    findings = known_findings()
    t = Trace.load(ROOT / "traces" / "vllm" / "failed-load-in-flight-output-sliding-0.33.0.json")
    rr = replay_beside(t, "vllm@0.33.0")
    assert rr.first is not None and rr.first.prop == 2, rr.crash
    res = FuzzResult(None, RunStats(), violation=rr.first, trace=t)
    assert classify(res, findings) is None  # not its shape: full attention only
    assert classify_by_fix(res, findings, "vllm@0.33.0") == \
        "failed-load-in-flight-output-delivered"
    tried = []

    def still_fails(trace, fixed):
        tried.append(fixed)
        return rr

    assert classify_by_fix(res, findings, "vllm@0.33.0", replay=still_fails) is None
    fixes = str(ROOT / "findings")
    assert tried and all(x.startswith(f"vllm@0.33.0+{fixes}/") for x in tried), tried
    # on another tree than the finding's release no fix is tried
    assert classify_by_fix(res, findings, "vllm@/some/checkout", replay=still_fails) is None
    assert len(tried) == len(set(tried))


def test_a_vacuous_run_goes_on_for_its_grace():
    """``fuzz_job(seconds, vacuous_grace)``: at the end of its time a run that
    has not reached every witness its configs can produce goes on, up to
    ``grace`` times its time more; one that has stops there."""
    from properties.jobs import fuzz_job

    spec = FuzzSpec(kind="sliding", policy="settled", depth=2, hazard="ordered",
                    external=False)
    cut = fuzz_job(spec, 10**7, 3, None, 0.0)
    assert cut.stats.examples == 1 and cut.vacuous  # stopped at its first example
    graced = fuzz_job(spec, 10**7, 3, None, 0.01, vacuous_grace=30000.0)
    assert graced.stats.examples > 1 and not graced.vacuous, graced.vacuous
    # with every witness reached it stops at once past its time, far inside its grace
    assert graced.stats.examples < 2000


def test_naming_by_fix_tries_the_likeliest_fix_first():
    """Finding 3 seen as a stall (property 7, full attention, failed loads):
    its text is no finding's, so every fix its events allow may clear it, and
    each costs a worker's start against the naming deadline. The fix of a
    finding found on its kinds with the most of its event types comes first,
    and it is the one that clears it."""
    from gate.known import classify_by_fix, fix_candidates, known_findings
    from model.events import Trace
    from properties.jobs import replay_beside
    from properties.machine import FuzzResult, RunStats

    findings = known_findings()
    t = Trace.load(ROOT / "traces" / "vllm" / "failed-load-in-flight-output-stalls-0.33.0.json")
    rr = replay_beside(t, "vllm@0.33.0")
    assert rr.first is not None and rr.first.prop == 7, rr.crash
    res = FuzzResult(None, RunStats(), violation=rr.first, trace=t)
    first = fix_candidates(res, findings, "vllm@0.33.0", any_text=True)[0]
    assert first.kinds <= {"full"} and "FailLoad" in first.events, first
    assert "03-failed-load-in-flight-output-delivered/fix.diff" in first.fixed_by
    tried = []

    def replay(trace, fixed):
        tried.append(fixed)
        return replay_beside(trace, fixed)

    assert classify_by_fix(res, findings, "vllm@0.33.0", replay=replay, any_text=True) == \
        first.name
    assert len(tried) == 1, tried
