"""The vLLM driver's counters, folded, are every live request's counters.

Each event's counters list only the requests the event may have changed
(``Driver._counters``); a request not listed keeps the counters it was last
listed with, and :class:`model.observations.LiveCounters` folds them. Here,
in a worker that imported vLLM 0.33.0, every event of every vLLM trace under
``findings/`` and ``traces/`` and of fuzz runs over several settings (depth
1 to 3, drafts, prefix caching, connector loads that fail, preemption) is
followed by a comparison of the fold with what vLLM's requests hold right
then: computed and in-flight tokens, live blocks per group, status, for every
request not finished; and no finished request whose blocks have all left it
is still kept (it leaves the counters in the event its last block left it,
as when every live request was listed). A burst of 1,000 requests waiting at
once lists what each event touched, never the 1,000.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gate.known import finding_traces
from model.events import Drain, Trace
from properties.jobs import _call

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
TARGET = "vllm@0.33.0"


class FoldMismatch(AssertionError):
    pass


def _traces() -> list[Path]:
    out = []
    for p in sorted([*finding_traces(), *(ROOT / "traces").rglob("*.json")]):
        t = Trace.load(p).meta.get("target")
        if t is None or t.startswith("vllm@"):
            out.append(p)
    return out


def _watch() -> tuple[dict[str, int], object]:
    """Patch the driver so that every reset and event compares the fold with
    vLLM's requests (raising :class:`FoldMismatch`); returns the counts of
    events and requests compared, and an undo."""
    from impl.vllm import compat
    from impl.vllm.driver import Driver
    from model.observations import LiveCounters, ReqCounters

    seen = {"events": 0, "compared": 0, "listed": 0, "most_listed": 0, "most_live": 0}
    folds: dict[int, LiveCounters] = {}
    reset, apply = Driver.reset, Driver.apply

    def check(d: Driver, obs: object) -> None:
        fold = folds[id(d)]
        fold.update(obs.counters)  # type: ignore[attr-defined]
        seen["events"] += 1
        n = len(obs.counters.reqs)  # type: ignore[attr-defined]
        seen["listed"] += n
        seen["most_listed"] = max(seen["most_listed"], n)
        truth = {}
        for rid, r in d.reqs.items():
            status = d._status(r)
            if status != "finished":
                truth[rid] = ReqCounters(r.num_computed_tokens, compat.in_flight(r),
                                         tuple(d.live[rid]), status)
        got = {rid: rc for rid, rc in fold.items() if rc.status != "finished"}
        if got != truth:
            bad = sorted({*got, *truth} - {k for k in got if got.get(k) == truth.get(k)})
            raise FoldMismatch(f"after {d.next_step} steps: " + "; ".join(
                f"{rid}: folded {got.get(rid)}, vLLM {truth.get(rid)}" for rid in bad[:4]))
        stale = [rid for rid, r in d.active.items()
                 if d._status(r) == "finished" and not any(d.live[rid])]
        if stale:
            raise FoldMismatch(f"finished requests kept with no block left: {stale}")
        seen["compared"] += len(truth)
        seen["most_live"] = max(seen["most_live"], len(truth))

    def reset_w(self: Driver, cfg: object) -> object:
        obs = reset(self, cfg)
        folds[id(self)] = LiveCounters()
        check(self, obs)
        return obs

    def apply_w(self: Driver, ev: object) -> object:
        obs = apply(self, ev)
        check(self, obs)
        return obs

    Driver.reset, Driver.apply = reset_w, apply_w

    def undo() -> None:
        Driver.reset, Driver.apply = reset, apply
    return seen, undo


def fold_job(paths: list[str], runs: list[tuple[dict, int]],
             burst: Trace | None = None) -> dict[str, object]:
    """In the worker: the traces' events, then the fuzz runs, watched; then
    ``burst``'s events, watched, with the most requests one event listed and
    the most live at once."""
    from impl.vllm.driver import Driver
    from properties.machine import FuzzSpec, fuzz

    seen, undo = _watch()
    out: dict[str, object] = {"traces": {}, "runs": []}
    try:
        d = Driver()
        for path in paths:
            trace = Trace.load(path)
            try:
                d.reset(trace.config)
            except FoldMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - a refusal: nothing to compare
                out["traces"][Path(path).name] = f"refused: {type(e).__name__}"
                continue
            n = 0
            for ev in trace.events:
                if isinstance(ev, Drain):
                    break
                try:
                    d.apply(ev)
                except FoldMismatch as e:
                    out["traces"][Path(path).name] = f"MISMATCH: {e}"
                    break
                except Exception:  # noqa: BLE001 - vLLM's crash ends the trace
                    break
                n += 1
            else:
                out["traces"][Path(path).name] = n
            out["traces"].setdefault(Path(path).name, n)
        for kw, examples in runs:
            res = fuzz(FuzzSpec(target=TARGET, **kw), examples=examples, seed=0,
                       minimize_trace=False)
            out["runs"].append((kw, res.stats.examples, res.verdict, res.crash))
        if burst is not None:
            seen["most_listed"] = seen["most_live"] = 0
            d.reset(burst.config)
            for ev in burst.events:
                d.apply(ev)
            out["burst"] = (seen["most_listed"], seen["most_live"], len(d.reqs), len(d.ended))
    finally:
        undo()
    out["seen"] = dict(seen)
    return out


RUNS = [
    ({"kind": "full", "hazard": "ordered", "external": False}, 60),
    ({"kind": "sliding", "depth": 2, "hazard": "unordered", "fail_loads": False}, 60),
    ({"kind": "full", "depth": 2, "hazard": "unordered"}, 40),
    ({"kind": "hybrid", "depth": 3, "external": False, "prefix_caching": True}, 40),
    ({"kind": "sliding", "depth": 1, "spec_tokens": 2, "hazard": "ordered",
      "prefix_caching": True, "external": False}, 40),
]


def _burst(n: int) -> Trace:
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvcheck_long_traces",
                                                  ROOT / "scripts" / "long_traces.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.burst(n)


def test_folded_counters_are_every_live_requests():
    paths = _traces()
    assert len(paths) >= 10
    burst = _burst(1000)
    got = _call(TARGET, 0, "tests.test_vllm_counters:fold_job",
                ([str(p) for p in paths], RUNS, burst))
    bad = {k: v for k, v in got["traces"].items() if isinstance(v, str) and "MISMATCH" in v}
    assert not bad, bad
    for kw, examples, _verdict, crash in got["runs"]:
        assert crash is None or "FoldMismatch" not in crash, (kw, crash)
        assert examples > 0, kw
    seen = got["seen"]
    # the comparison covered many events, and the counters listed fewer
    # requests than were live (what the event touched, not what is live)
    assert seen["events"] > 2000, seen
    assert seen["listed"] < seen["compared"], seen
    # 1,000 AddRequests before anything runs, a pool that holds 8: an event
    # lists what it touched (at most the step's requests and one more), never
    # the 1,000 waiting; every request ends and is forgotten
    most_listed, most_live, kept, ended = got["burst"]
    assert most_live == 1000 and most_listed <= burst.config.max_num_seqs + 1, got["burst"]
    assert kept == 0 and ended == 1000, got["burst"]
