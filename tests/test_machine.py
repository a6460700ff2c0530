"""The state machine itself: the ids its rules name, and the rules it has."""

from impl.target import make_target
from model.events import Abort, AddRequest, FailLoad, Finish, Preempt, ResetPrefixCache
from properties.machine import FailingLoads, FuzzSpec, KVMachine, fuzz, make_machine


def test_finish_abort_name_requests_still_in_the_system_and_preemption_is_the_engines():
    """Ids come from the ``requests`` Bundle, filtered on the request still
    running: no Finish or Abort names a request never added, one an earlier
    event ended, or one that ended on its own (the machine's view of the
    target, asked just before the event), and both do occur. Preemption
    comes only as the engine's: the reference has no call that preempts one
    chosen request (no Preempt), and the utility call that preempts every
    running request (ResetPrefixCache) does occur."""
    seen = {"ended_events": 0, "preempt": 0, "reset": 0}

    def check(phase, machine):
        if phase != "setup":
            return
        apply = machine._apply

        def checked(ev, record=True):
            if record and isinstance(ev, (Finish, Abort)):
                added = {e.id for e in machine.events if isinstance(e, AddRequest)}
                assert ev.id in added and ev.id in machine._live(), (ev, machine.events)
                seen["ended_events"] += 1
            seen["preempt"] += isinstance(ev, Preempt)
            seen["reset"] += isinstance(ev, ResetPrefixCache)
            return apply(ev, record)

        machine._apply = checked

    res = fuzz(FuzzSpec(kind="sliding", policy="settled"), examples=120, seed=5,
               on_example=check)
    assert res.violation is None and res.crash is None, res.violation or res.crash
    assert seen["ended_events"] > 20 and seen["reset"] > 0 and not seen["preempt"], seen


def test_fail_load_rule_only_where_loads_can_fail():
    target = make_target("reference")
    with_loads = make_machine(FuzzSpec(kind="full"), target)
    assert issubclass(with_loads, FailingLoads)
    for spec in (FuzzSpec(kind="full", fail_loads=False), FuzzSpec(kind="full", external=False)):
        cls = make_machine(spec, target)
        assert issubclass(cls, KVMachine) and not issubclass(cls, FailingLoads), spec
        assert not hasattr(cls, "fail_load")
    res = fuzz(FuzzSpec(kind="full", hazard="unordered", depth=2), examples=150, seed=2)
    assert res.stats.events[FailLoad.__name__] > 0, res.stats.events


def test_shrinking_cut_short_keeps_the_shortest_failing_example():
    """``fuzz(shrink_seconds=0)`` stops Hypothesis at the first example after
    the first failure: the result is the shortest example failing the same way
    it ran by then (no longer than the unshrunk run's), flagged ``shrink_cut``,
    and its trace replays to that violation; without the cut it is not flagged."""
    from properties.replay import replay

    spec = FuzzSpec(kind="sliding", policy="optimistic", hazard="unordered", depth=2)
    cut = fuzz(spec, examples=200, seed=1, shrink_seconds=0.0, minimize_trace=False)
    full = fuzz(spec, examples=200, seed=1, minimize_trace=False)
    assert cut.violation is not None and full.violation is not None
    assert cut.shrink_cut and not full.shrink_cut and not cut.stopped
    assert cut.violation.prop == full.violation.prop
    assert len(full.trace.events) <= len(cut.trace.events)
    rr = replay(cut.trace, "reference")
    assert rr.first is not None and rr.first.prop == cut.violation.prop
    assert cut.to_json()["shrink_cut"] is True
