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
    assert replay(res.trace, "reference").first.prop == 2


@pytest.mark.parametrize("kind", KINDS)
def test_settled_holds_and_is_not_vacuous(kind):
    res = fuzz(FuzzSpec(kind=kind, policy="settled"), examples=250, seed=7)
    assert res.crash is None, res.crash
    assert res.violation is None, res.violation
    assert not res.vacuous, f"never reached: {res.vacuous}"
    assert res.stats.events["Process"] > 50 and res.stats.events["Preempt"] > 5


@pytest.mark.parametrize("kind", ["sliding", "chunked_local", "mamba"])
def test_sync_depth_one_every_policy_holds(kind):
    for policy in ("optimistic", "mamba-local"):
        res = fuzz(FuzzSpec(kind=kind, policy=policy, depth=1), examples=150, seed=11)
        assert res.violation is None, (policy, res.violation)


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
        assert res.violation is not None and res.violation.prop in (1, 2)
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
