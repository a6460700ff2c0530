"""The checker's own power: it finds the known bugs, with short
counterexamples, and stays silent (and not vacuous) on correct code."""

import pytest

from impl.target import make_target
from properties.machine import FuzzSpec, fuzz
from properties.replay import replay

KINDS = ("full", "sliding", "chunked_local", "mamba", "hybrid")


@pytest.mark.parametrize("kind", ["sliding", "chunked_local"])
def test_optimistic_freed_while_read_found_short(kind):
    res = fuzz(FuzzSpec(kind=kind, policy="optimistic", depth=2), examples=300, seed=1)
    assert res.violation is not None, "the optimistic policy's bug was not found"
    assert res.violation.prop == 1, res.violation
    assert len(res.trace.events) <= 6, res.trace.events
    again = replay(res.trace, "reference")
    assert again.first is not None and again.first.prop == 1


@pytest.mark.parametrize("policy", ["optimistic", "mamba-local"])
def test_null_read_after_rejection_found(policy):
    spec = FuzzSpec(kind="sliding", policy=policy, depth=2, spec_tokens=2,
                    props=frozenset({2}))
    res = fuzz(spec, examples=400, seed=3)
    assert res.violation is not None and res.violation.prop == 2, res.violation
    assert "NULL" in res.violation.message
    # a trace never narrows a replay: the property it was found checking is asked for
    assert replay(res.trace, "reference", props=frozenset({2})).first.prop == 2


@pytest.mark.parametrize("kind", KINDS)
def test_settled_holds_and_is_not_vacuous(kind):
    res = fuzz(FuzzSpec(kind=kind, policy="settled"), examples=250, seed=7)
    assert res.crash is None, res.crash
    assert res.violation is None, res.violation
    assert not res.vacuous, f"never reached: {res.vacuous}"
    assert res.stats.events["Process"] > 50
    # preemption on the engine's paths (pool pressure, the client's reset) only
    assert res.stats.witness["preempt_in_flight"] + res.stats.witness["preempt_in_schedule"] > 0
    assert not res.stats.events["Preempt"]  # the reference has no call preempting one request


@pytest.mark.parametrize("kind", ["sliding", "chunked_local", "mamba"])
def test_sync_depth_one_every_policy_holds(kind):
    for policy in ("optimistic", "mamba-local"):
        res = fuzz(FuzzSpec(kind=kind, policy=policy, depth=1), examples=150, seed=11)
        assert res.violation is None, (policy, res.violation)
        # property 6 was checked: every event also ran on the settled twin
        assert "twin_compared" in res.stats.expected and not res.vacuous, res.vacuous


def test_a_policy_that_changes_sync_behaviour_is_caught_by_property_6():
    """Lazier than settled is safe (properties 1-5 hold) but not the same at
    depth 1: only the settled twin sees it."""
    from model.policy import REGISTRY, register

    @register("settled-lazy")
    def lazy(group, counts):
        return counts.computed - counts.in_flight - counts.loading - 1

    try:
        res = fuzz(FuzzSpec(kind="sliding", policy="settled-lazy", depth=1), examples=200,
                   seed=3)
        assert res.violation is not None and res.violation.prop == 6, res.violation
        assert "settled-lazy and settled part" in res.violation.message
        assert replay(res.trace, make_target("reference")).first.prop == 6
        safe = fuzz(FuzzSpec(kind="sliding", policy="settled-lazy", depth=1,
                             props=frozenset({1, 2, 3, 4, 5, 7})), examples=200, seed=3)
        assert safe.violation is None and not safe.vacuous, (safe.violation, safe.vacuous)
    finally:
        REGISTRY.pop("settled-lazy")


def test_an_unseen_broken_policy_is_caught():
    """A policy the checker was never told about: frees one block too many."""
    from model.policy import REGISTRY, register

    @register("settled-plus-one-block")
    def plus_one(group, counts):
        return counts.computed - counts.in_flight - counts.loading + 16

    try:
        res = fuzz(FuzzSpec(kind="sliding", policy="settled-plus-one-block", block_size=16),
                   examples=300, seed=2)
        # a free that reads, or (property 6) one earlier than the settled rule's
        assert res.violation is not None and res.violation.prop in (1, 2, 6)
    finally:
        REGISTRY.pop("settled-plus-one-block")


def test_forgetting_a_rollback_is_caught():
    """A policy that ignores drafts in flight (but not other tokens)."""
    from model.policy import REGISTRY, register

    @register("ignores-drafts")
    def ignores(group, counts):
        return counts.computed - counts.in_flight - counts.loading + counts.spec

    try:
        res = fuzz(FuzzSpec(kind="sliding", policy="ignores-drafts", depth=2, spec_tokens=2),
                   examples=400, seed=4)
        assert res.violation is not None and res.violation.prop in (1, 2)
    finally:
        REGISTRY.pop("ignores-drafts")


def test_target_is_deterministic_on_replay():
    res = fuzz(FuzzSpec(kind="sliding", policy="optimistic", depth=2), examples=100, seed=1)
    a = replay(res.trace, make_target("reference"))
    b = replay(res.trace, make_target("reference"))
    assert [str(v) for v in a.violations] == [str(v) for v in b.violations]


# ------------------------------------------------- the state machine itself


class _Skewed:
    """The reference target with one counter reported wrong after the first
    processed output: a pool total (property 3) or an in-flight count (4)."""

    def __init__(self, what: str):
        from impl.reference import ReferenceTarget

        self.inner, self.what, self.processed = ReferenceTarget(), what, False
        self.name, self.capabilities = self.inner.name, self.inner.capabilities

    def reset(self, cfg):
        self.processed = False
        return self.inner.reset(cfg)

    def can_apply(self, ev):
        return self.inner.can_apply(ev)

    def apply(self, ev):
        from dataclasses import replace as copy

        from model.events import Process

        obs = self.inner.apply(ev)
        self.processed |= isinstance(ev, Process)
        c = obs.counters
        if not self.processed or c is None:
            return obs
        if self.what == "pool":
            obs.counters = copy(c, free_blocks=c.free_blocks - 1)
        else:
            obs.counters = copy(c, reqs={r: copy(rc, in_flight=(rc.in_flight or 0) + 1)
                                         if rc.status == "running" else rc
                                         for r, rc in c.reqs.items()})
        return obs


@pytest.mark.parametrize("what,prop", [("pool", 3), ("in_flight", 4)])
def test_accounting_invariants_catch_a_wrong_counter(what, prop):
    res = fuzz(FuzzSpec(kind="full", policy="settled"), examples=100, seed=5,
               target=_Skewed(what))
    assert res.violation is not None and res.violation.prop == prop, res.violation
    assert replay(res.trace, _Skewed(what)).first.prop == prop
    assert replay(res.trace, "reference").first is None  # the target's slip, not the trace's


def test_same_seed_same_trace_and_the_database_replays_a_failure_first():
    from hypothesis.database import InMemoryExampleDatabase

    class Recording(InMemoryExampleDatabase):
        def __init__(self):
            super().__init__()
            self.fetched = set()

        def fetch(self, key):
            self.fetched.add(key)
            yield from super().fetch(key)

    spec = FuzzSpec(kind="sliding", policy="optimistic", depth=2)
    a = fuzz(spec, examples=100, seed=1)
    b = fuzz(spec, examples=100, seed=1)
    assert a.trace is not None and a.trace.events == b.trace.events
    assert a.trace.config == b.trace.config

    db = Recording()
    first = fuzz(spec, examples=100, seed=2, database=db)
    saved = {k for k, v in db.data.items() if v}
    assert first.violation is not None and saved, "the failure was not saved"
    failed = []  # per example run: whether it failed
    again = fuzz(spec, examples=100, seed=3, database=db, on_example=lambda phase, m:
                 failed.append(m.violation is not None) if phase == "teardown" else None)
    # the saved example comes first and fails (then is shrunk, as any failure)
    assert again.violation is not None and failed[0], failed[:5]
    assert again.trace.events == first.trace.events
    # another setting has its own key: it never looks up this one's failure
    db.fetched.clear()
    fuzz(FuzzSpec(kind="sliding", policy="settled", depth=2), examples=5, seed=1, database=db)
    assert db.fetched and not db.fetched & saved
