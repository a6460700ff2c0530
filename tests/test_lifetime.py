"""Finished requests leave the targets' and the checker's state.

A long run costs the same per event as a short one only if what the reference
target, the vLLM driver, the checker and the report keep does not grow with
the requests that came before. These tests assert that structure (how many
requests each holds, what the counters list), never time; ``make bench``'s
"cost against trace length" table measures the time.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from impl.reference.target import ReferenceTarget
from model.events import AddRequest, Finish, Process, Schedule, Trace, config_for
from model.observations import AllocObs, FinishObs, FreeObs, Observed, ProcessObs
from properties.invariants import Checker
from properties.replay import replay
from report.report import build_grid, render_timeline

ROOT = Path(__file__).resolve().parent.parent


def _long_traces():
    spec = importlib.util.spec_from_file_location("kvcheck_long_traces",
                                                  ROOT / "scripts" / "long_traces.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


long_traces = _long_traces()
CONC = 8


def _run(trace: Trace, target=None):
    """Replay ``trace`` event by event on the reference under a checker; yield
    (event, observed, target, checker) after each event."""
    t = target or ReferenceTarget()
    ch = Checker(trace.config)
    ch.feed(None, t.reset(trace.config))
    for ev in trace.events:
        obs = t.apply(ev)
        assert not ch.feed(ev, obs), ev
        yield ev, obs, t, ch


def test_request_stream_replays_on_the_reference():
    t = long_traces.request_stream(60, concurrency=CONC)
    added = sum(isinstance(e, AddRequest) for e in t.events)
    assert added == 60
    res = replay(t, "reference")
    assert res.first is None and res.crash is None
    finished = {it.rid for row in res.rows for it in row.obs.items if isinstance(it, FinishObs)}
    assert len(finished) == 60  # every request ran to its end


def test_reference_and_checker_hold_only_live_requests():
    """After every event: the scheduler, its coordinator and the checker keep
    state for the live requests only (those that ended in this event still
    show, retired by the next), however many finished before."""
    trace = long_traces.request_stream(400, concurrency=CONC)
    finished = 0
    most = {"sched": 0, "coord": 0, "checker": 0, "counters": 0}
    for _ev, obs, t, ch in _run(trace):
        s = t._s
        finished += sum(isinstance(it, FinishObs) for it in obs.items)
        live = {rid for rid, r in s.requests.items() if r.status != "finished"}
        assert len(live) <= CONC
        most["sched"] = max(most["sched"], len(s.requests))
        most["coord"] = max(most["coord"], len(s.coord.live), len(s.coord.prompt_len),
                            len(s.coord._last_tables))
        most["checker"] = max(most["checker"], len(ch.reqs), len(ch.prompt_len),
                              len(ch._nheld))
        most["counters"] = max(most["counters"], len(obs.counters.reqs))
    assert finished == 400
    # a request is forgotten once it ended and no step in flight or held event names it
    assert all(n <= 2 * CONC for n in most.values()), most
    assert not s.requests and len(s.ended) == 400
    assert not ch.holder and not ch.detached


def test_counters_list_no_request_that_finished_earlier():
    trace = long_traces.request_stream(100, concurrency=CONC)
    gone: set[str] = set()
    for _ev, obs, _t, _ch in _run(trace):
        listed = set(obs.counters.reqs)
        assert not listed & gone, listed & gone
        for rid, rc in obs.counters.reqs.items():
            if rc.status == "finished":
                gone.add(rid)
    assert len(gone) == 100


def test_a_finished_id_stays_taken_and_finished():
    cfg = config_for("sliding", window=16, block_size=16, num_blocks=32,
                     max_num_batched_tokens=64, max_model_len=96)
    t = ReferenceTarget()
    t.reset(cfg)
    for ev in (AddRequest("a", 20, 2, 0), Schedule(), Process(), Finish("a")):
        t.apply(ev)
    assert "a" not in t._s.requests  # retired
    assert not t.can_apply(AddRequest("a", 20, 2, 0))
    assert not t.can_apply(Finish("a"))
    try:
        t.apply(Finish("a"))
    except ValueError as e:
        assert "has finished" in str(e)
    else:
        raise AssertionError("a Finish of a finished request was accepted")


def test_content_of_a_retired_requests_blocks_serves_a_later_prefix_hit():
    """Property 2's content rule keys what a slot holds by block, not by
    request: a request that finished and was forgotten leaves its blocks'
    contents for a later request's prefix hit to read (and be judged by)."""
    cfg = config_for("full", block_size=16, num_blocks=32, max_num_batched_tokens=128,
                     max_model_len=128, prefix_caching=True)
    t, ch = ReferenceTarget(), Checker(cfg)
    ch.feed(None, t.reset(cfg))
    hit = False

    def run(ev):
        nonlocal hit
        obs = t.apply(ev)
        hit |= any(isinstance(it, AllocObs) and it.cached and it.rid == "b" for it in obs.items)
        assert not ch.feed(ev, obs), ev
        return obs

    run(AddRequest("a", 64, 2, 0))
    done = False
    while not done:
        obs = run(Schedule()) if ch.in_flight_steps() < cfg.depth else None
        if obs is None or not any(type(it).__name__ == "StepObs" for it in obs.items):
            obs = run(Process())  # the queue is full, or a's last token is in flight
        done = any(isinstance(it, FinishObs) for it in obs.items)
    while ch.in_flight_steps():
        run(Process())
    run(Schedule())  # an empty step: a is retired at the next event
    assert "a" not in ch.reqs and "a" not in ch.prompt_len
    assert ch.content  # but what its blocks hold is kept
    run(AddRequest("b", 64, 2, 0))
    run(Schedule())
    assert hit and ch.witness["prefix_hit"]
    assert ch._ok.get("b")  # b's reads through the hit were checked against the contents


class _DropsAFree(ReferenceTarget):
    """The reference, except that the first block the request ``victim``
    returns is left out of the observations (a pool accounting slip)."""

    def __init__(self, victim: str):
        super().__init__()
        self.victim = victim
        self.dropped = False

    def apply(self, ev):
        obs = super().apply(ev)
        if self.dropped:
            return obs
        items = []
        for it in obs.items:
            if not self.dropped and isinstance(it, FreeObs) and it.rid == self.victim:
                self.dropped = True
                continue
            items.append(it)
        return Observed(items, obs.counters)


def test_a_long_replay_finds_what_the_short_one_finds():
    """The same slip at the end of a 12-request and of a 1,200-request trace:
    the same property, at the same event counted from the end."""
    found = []
    for n in (12, 1200):
        trace = long_traces.request_stream(n, concurrency=CONC)
        res = replay(trace, _DropsAFree(f"r{n - 1}"))
        v = res.first
        assert v is not None and v.prop == 3, v
        found.append((v.prop, len(trace.events) - v.event_index, v.message.split(":")[0]))
        text = render_timeline(res)
        assert "VIOLATION" in text and "property 3" in text
    assert found[0] == found[1], found


def test_the_report_draws_only_the_requests_of_the_rows_shown():
    """A long trace's timeline follows every event but keeps (and draws) the
    requests live in the rows shown, not the thousands finished before."""
    trace = long_traces.request_stream(800, concurrency=CONC)
    res = replay(trace, "reference")
    grid = build_grid(res, shown=50)
    assert grid.first_index > 0 and len(grid.rows) == 50
    rids = {ln.rid for ln in grid.lanes}
    shown = {e.id for e in trace.events[grid.first_index:] if isinstance(e, AddRequest)}
    assert len(rids) <= CONC + len(shown), rids
    assert all(set(r.counts) <= rids | shown for r in grid.rows)


def test_a_long_decode_shares_its_unchanged_tables():
    """One request decoding for 2,000 steps: a step whose table did not change
    hands out the very tuple the step before had (memory per change of the
    table, not per step)."""
    trace = long_traces.pair_stream(2000)
    res = replay(trace, "reference")
    assert res.first is None
    tables = [it.reqs[0].tables[0] for row in res.rows for it in row.obs.items
              if type(it).__name__ == "StepObs"]
    assert len(tables) == 2000
    distinct = {id(t) for t in tables}
    # a table changes when a block is added or leaves the window: twice per 16 tokens
    assert len(distinct) <= 2 * (2000 // 16) + 2, len(distinct)
    assert all(a is b for a, b in zip(tables, tables[1:], strict=False) if a == b)


_DRIVER_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from impl.vllm.driver import Driver
from model.events import Trace
trace = Trace.load(sys.argv[2])
d = Driver()
d.reset(trace.config)
most = 0
listed = 0
for ev in trace.events:
    obs = d.apply(ev)
    most = max(most, len(d.reqs), len(d.table), len(d.live), len(d.last_tables), len(d.active))
    listed = max(listed, len(obs.counters.reqs))
print(json.dumps({"most": most, "listed": listed, "ended": len(d.ended), "reqs": len(d.reqs)}))
"""


def test_vllm_driver_holds_only_live_requests(tmp_path):
    """The vLLM driver (in the process that imports vLLM 0.33.0, as the worker
    runs it) forgets a finished request once no step in flight has it."""
    from impl.vllm import resolve

    inst = resolve("0.33.0")
    path = tmp_path / "stream.json"
    long_traces.request_stream(300, concurrency=CONC).save(path)
    env = {"PYTHONPATH": ":".join([*(str(p) for p in inst.path), str(ROOT)]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR",
           "VLLM_NO_USAGE_STATS": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _DRIVER_CHILD, str(ROOT), str(path)],
                         capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ended"] == 300 and got["reqs"] == 0, got
    assert got["most"] <= 2 * CONC and got["listed"] <= 2 * CONC, got


# ------------------------------------------------------- many requests live at once


def test_a_burst_lists_what_each_event_touches_not_what_is_live():
    """2,000 AddRequests before anything runs, a pool that holds 8: each
    event's counters list the requests it may have changed (the running ones
    and those it added, preempted or finished), never the 2,000 waiting; the
    checker still knows every live request's counters."""
    trace = long_traces.burst(2000)
    cfg = trace.config
    most_listed = most_live = 0
    for _ev, obs, t, ch in _run(trace):
        most_listed = max(most_listed, len(obs.counters.reqs))
        most_live = max(most_live, ch.live_requests())
        assert len(obs.counters.reqs) <= cfg.max_num_seqs + 1
        running = [r for r in t._s.running]
        assert all(r.rid in obs.counters.reqs for r in running) or isinstance(_ev, AddRequest)
    assert most_live == 2000 and most_listed <= cfg.max_num_seqs + 1, (most_live, most_listed)
    res = replay(trace, "reference")
    assert res.first is None and sum(isinstance(it, FinishObs) for row in res.rows
                                     for it in row.obs.items) == 2000


class _StaleCounters(ReferenceTarget):
    """The reference, except that after the first output of request ``victim``
    is processed it is left out of the counters of every later event: the
    checker's last counters of it say tokens are in flight that no step holds."""

    def __init__(self, victim: str):
        super().__init__()
        self.victim = victim
        self.hide = False

    def apply(self, ev):
        obs = super().apply(ev)
        if self.hide:
            reqs = {r: c for r, c in obs.counters.reqs.items() if r != self.victim}
            return Observed(obs.items, replace(obs.counters, reqs=reqs))
        self.hide = isinstance(ev, Process) and any(
            isinstance(it, ProcessObs) and any(r == self.victim for r, _ in it.accepted)
            for it in obs.items)
        return obs


def test_a_request_left_out_of_the_counters_is_judged_by_what_it_last_reported():
    """Property 4 over a request the counters stop listing: every event that
    changes what the checker expects of it (its next step scheduled and
    processed) judges it by the counters it last reported, so the stale
    in-flight count is caught, with 1,000 requests waiting behind it."""
    trace = long_traces.burst(1000)
    res = replay(trace, _StaleCounters("r0"))
    v = res.first
    assert v is not None and v.prop == 4 and v.rid == "r0", v
