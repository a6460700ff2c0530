"""Property 6 on the vLLM targets: at depth 1 (vLLM's sync ``Scheduler``) each
event also runs on the reference target under ``settled``, and while the two
schedule the same steps they must let go of the same blocks
(:func:`properties.invariants.compare_letgo`, properties/twin.py).

A slip that changes only what the sync path frees (scripts/mutants.py,
``sync-window-free-one-block-late``: window frees one block late, which
properties 1-5 accept) is caught as property 6; the unmodified releases are
silent and the twin compares events on them. The releases must be installed
(``make test`` does it): a missing install fails, it never skips.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from impl.target import fit_spec, make_target
from model.events import AddRequest, Finish, Process, Schedule, config_for
from properties.invariants import Checker
from properties.machine import FuzzSpec, fuzz
from properties.replay import replay
from properties.twin import Twin
from tests.vllm_targets import vllm_target

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import mutants  # noqa: E402

pytestmark = pytest.mark.vllm


def _fuzz(target, examples: int, seed: int, **kw):
    spec = FuzzSpec(target=target.name, **kw)
    fit_spec(target.name, target.capabilities, spec)
    return fuzz(spec, examples=examples, seed=seed, target=target)


def _run(target, cfg, events):
    """Feed ``events`` to ``target`` and its twin; (twin, checker, violations)."""
    checker = Checker(cfg)
    checker.feed(None, target.reset(cfg))
    twin = Twin(target, cfg)
    found = []
    for i, ev in enumerate(events):
        obs = target.apply(ev)
        checker.feed(ev, obs)
        v = twin.check(ev, obs, checker, i)
        if v is not None:
            found.append(v)
    return twin, checker, found


@pytest.mark.parametrize("version", ["0.25.1", "0.33.0"])
@pytest.mark.parametrize("kind", ["sliding", "hybrid"])
def test_unmodified_vllm_at_depth_one_is_silent_and_compared(version, kind):
    """Drafts, prefix caching, preemption and failed loads drawn; property 6
    alone judged (0.25.1's and 0.33.0's failed-load findings are property 2)."""
    res = _fuzz(vllm_target(version), 80, 5, kind=kind, depth=1, props=frozenset({6}))
    assert res.crash is None, res.crash
    assert res.violation is None, res.violation
    assert "twin_compared" in res.stats.expected and not res.vacuous, res.vacuous
    assert res.stats.witness["window_free"] > 0 and res.stats.events["Preempt"] > 0


def test_a_sync_only_slip_in_vllm_is_caught_by_property_6(tmp_path):
    m = next(x for x in mutants.MUTANTS if x.name == "sync-window-free-one-block-late")
    bad = make_target(f"vllm@{mutants.mutant_tree(m, tmp_path / 'tree')}")
    try:
        res = _fuzz(bad, 150, 1, kind="sliding", depth=1)
        assert res.violation is not None and res.violation.prop == 6, res.violation
        assert "settled reference lets go of" in res.violation.message, res.violation
        again = replay(res.trace, bad)
        assert again.first is not None and again.first.prop == 6, again.first
        # the same trace on the unmodified release: silent
        assert replay(res.trace, vllm_target("0.33.0")).first is None
        # safe: properties 1-5 and 7 accept it, and the run went where frees happen
        # (loads never fail: 0.33.0's failed-load finding 1 is property 2 at depth 1)
        safe = _fuzz(bad, 150, 1, kind="sliding", depth=1, fail_loads=False,
                     props=frozenset({1, 2, 3, 4, 5, 7}))
        assert safe.violation is None and not safe.vacuous, (safe.violation, safe.vacuous)
    finally:
        bad.close()


def test_0_25_1_connector_finish_frees_count_as_the_end():
    """0.25.1's connector finish frees an ending request's blocks below the
    window of its optimistic count as ``window`` frees (DIFFERENCES.md, 4 E);
    the reference lets go of the same blocks, in the same event, as ``finish``.
    That is no property-6 difference, and the twin stays in step."""
    cfg = config_for("sliding", window=4, block_size=4, num_blocks=23, depth=1,
                     spec_tokens=2, hazard="unordered", max_model_len=32)
    events = [AddRequest("r0", 5, 8, external_tokens=2), Schedule(), Process(), Schedule(),
              Finish("r0"), Process({"r0": 0})]
    t = vllm_target("0.25.1")
    t.reset(cfg)
    last = [t.apply(ev) for ev in events][-1]
    assert [f.reason for f in last.items if type(f).__name__ == "FreeObs"] == \
        ["window", "finish"]
    twin, checker, found = _run(t, cfg, events)
    assert not found and twin.parted is None
    assert checker.witness["twin_compared"] == len(events)


def test_the_twin_parts_where_the_schedules_differ():
    """0.25.1 pads a one-token admission to 1 + K only beside a running request
    (DIFFERENCES.md, 4 C): the steps differ, so the twin stops comparing, with
    no verdict; 0.33.0 pads as the reference does and stays compared."""
    cfg = config_for("full", block_size=16, num_blocks=12, depth=1, spec_tokens=2,
                     hazard="unordered", max_model_len=128)
    events = [AddRequest("a", 17, 4, external_tokens=16), Schedule()]
    twin, checker, found = _run(vllm_target("0.25.1"), cfg, events)
    assert not found and twin.parted and "steps differ" in twin.parted
    assert checker.witness["twin_parted"] == 1 and checker.witness["twin_compared"] == 1
    twin, checker, found = _run(vllm_target("0.33.0"), cfg, events)
    assert not found and twin.parted is None and checker.witness["twin_compared"] == 2


def test_mamba_has_no_twin_and_says_so():
    res = _fuzz(vllm_target("0.33.0"), 20, 2, kind="mamba", depth=1)
    assert res.crash is None and res.stats.examples
    assert "twin_compared" not in res.stats.expected
    assert res.stats.witness["twin_none"] > 0 and not res.stats.witness["twin_compared"]
