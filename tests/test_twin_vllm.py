"""Property 6 on the vLLM targets: at depth 1 (vLLM's sync ``Scheduler``) each
event also runs on the reference target under ``settled``, and while the two
schedule the same steps they must let go of the same blocks
(:func:`properties.invariants.compare_letgo`, properties/twin.py).

A slip that changes only what the sync path frees (scripts/mutants.py,
``sync-window-free-one-block-late``: window frees one block late, which
properties 1-5 accept) is caught as property 6; the unmodified releases are
silent and the twin compares events on them. Where no reference twin runs
(Mamba's align mode, an EAGLE or MTP drafter) the settled rule over vLLM's
own steps judges every event (``SettledRule``): silent on the release, and
the same slip is caught on Mamba (``sync-mamba-free-one-block-late``). The
releases must be installed (``make test`` does it): a missing install fails,
it never skips.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from impl.target import fit_spec, make_target
from model.events import AddRequest, Finish, Process, Schedule, Trace, config_for
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
    """Drafts, prefix caching, preemption (the client's reset between two
    steps) and failed loads drawn; property 6 alone judged (0.25.1's and
    0.33.0's failed-load findings are property 2)."""
    res = _fuzz(vllm_target(version), 80, 5, kind=kind, depth=1, props=frozenset({6}))
    assert res.crash is None, res.crash
    assert res.violation is None, res.violation
    assert "twin_compared" in res.stats.expected and not res.vacuous, res.vacuous
    assert res.stats.witness["window_free"] > 0
    assert res.stats.events["ResetPrefixCache"] > 0


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


def test_after_the_twin_parts_the_settled_rule_judges_the_rest(tmp_path):
    """0.33.0 keeps sliding-window blocks cached at its retention checkpoints
    only, so with prefix caching its hits differ from the reference's and the
    twin parts (here at event 10, a hit of other length); the settled rule,
    run beside the twin from the first event, judges the rest. A slip that
    frees one block late with prefix caching on only
    (``sync-cached-window-free-one-block-late``) is caught there, after the
    part; the unmodified release is silent."""
    trace = Trace.load(ROOT / "traces" / "vllm" / "twin-parts-then-rule-judges-0.33.0.json")
    good = replay(trace, vllm_target("0.33.0"))
    assert good.crash is None and good.first is None, good.crash or good.first
    assert good.witness["twin_parted"] == 1 and good.witness["twin_rule_after_part"] == 1
    m = next(x for x in mutants.MUTANTS if x.name == "sync-cached-window-free-one-block-late")
    bad = make_target(f"vllm@{mutants.mutant_tree(m, tmp_path / 'tree')}")
    try:
        twin, checker, found = _run(bad, trace.config, trace.events)
        assert twin.parted and "steps differ" in twin.parted, twin.parted
        assert found and found[0].prop == 6, found
        assert "the settled rule lets go of" in found[0].message, found[0]
        # the twin had parted before: only the rule could judge this event
        assert found[0].event_index > checker.witness["twin_compared"] - 1, found[0]
        again = replay(trace, bad)
        assert again.first is not None and again.first.prop == 6, again.first
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


@pytest.mark.parametrize("kind, kw", [
    # align mode; no connector loads (finding 5 stops a Mamba align run that draws them)
    ("mamba", {"prefix_caching": True, "external": False}),
    ("sliding", {"drafter": "eagle", "spec_tokens": 2}),
    ("hybrid", {"drafter": "mtp", "spec_tokens": 2, "prefix_caching": True, "external": False}),
])
def test_mamba_and_model_drafters_are_judged_by_the_settled_rule(kind, kw):
    """No reference twin runs these (align mode schedules other steps; the
    reference drafts by n-gram only): the settled rule over vLLM's own steps
    judges every event, and the unmodified release is silent."""
    res = _fuzz(vllm_target("0.33.0"), 40, 2, kind=kind, depth=1, props=frozenset({6}), **kw)
    assert res.crash is None, res.crash
    assert res.violation is None, res.violation
    # property 6's witness reached (a short run may miss others, e.g. reprefill_reach)
    assert "twin_rule" in res.stats.expected and "twin_rule" not in res.vacuous, res.vacuous
    w = res.stats.witness
    assert w["twin_rule"] > 0 and w["window_free"] > 0 and not w["twin_compared"], w


def test_a_sync_only_slip_in_mamba_align_mode_is_caught_by_property_6(tmp_path):
    m = next(x for x in mutants.MUTANTS if x.name == "sync-mamba-free-one-block-late")
    bad = make_target(f"vllm@{mutants.mutant_tree(m, tmp_path / 'tree')}")
    try:
        res = _fuzz(bad, 100, 1, kind="mamba", depth=1, prefix_caching=True, external=False)
        assert res.violation is not None and res.violation.prop == 6, res.violation
        assert "the settled rule lets go of" in res.violation.message, res.violation
        # the same trace on the unmodified release: silent
        assert replay(res.trace, vllm_target("0.33.0")).first is None
    finally:
        bad.close()


def _obs(*items):
    from model.observations import Observed

    return Observed(list(items))


def test_the_settled_rule_judges_both_directions():
    """The rule over observations alone: a free of a slot some position at or
    past the count still reads (early), and a step scheduled holding a slot
    none does (late), are property 6; the exact free is silent."""
    from model.observations import AllocObs, FreeObs, ReqStep, StepObs
    from properties.twin import SettledRule

    cfg = config_for("sliding", window=4, block_size=4, num_blocks=12, depth=1)

    def run(free_at_9: list[int]):
        rule, checker = SettledRule(cfg, "settled"), Checker(cfg)
        evs = [(AddRequest("a", 12, 2), _obs()),
               (Schedule(), _obs(*(AllocObs(i + 1, 0, "a", i) for i in range(3)),
                                 StepObs(0, (ReqStep("a", 0, 9, tables=((1, 2, 3),)),)))),
               (Process(), _obs()),
               # at count 9 settled lets go of block 0 only: positions >= 9 read [6, ...)
               (Schedule(), _obs(*(FreeObs(i + 1, 0, "a", i, "window") for i in free_at_9),
                                 StepObs(1, (ReqStep("a", 9, 12, tables=((1, 2, 3),)),))))]
        return [rule.check(ev, o, checker, k) for k, (ev, o) in enumerate(evs)]

    assert run([0]) == [None] * 4
    late = run([])[-1]
    assert late is not None and late.prop == 6 and "still holding its logical block 0" in \
        late.message, late
    early = run([0, 1])[-1]
    assert early is not None and early.prop == 6 and "lets go of its logical block 1" in \
        early.message, early


def test_rswa_resumption_hit_holds_its_gap_until_the_next_step(monkeypatch):
    """R-SWA's manager takes a prefix hit's blocks whole (FullAttentionManager's
    lookup) after it let go of the request's skipped blocks for that step, so a
    preempted request resuming through a hit holds the gap block the hit
    brought back for one step. The settled rule judges such a slot from the
    request's next step (``Kind.vllm_hit_keeps_gap``): silent on 0.33.0, and
    judged at once the same step is a property-6 violation."""
    from model.kinds import RSWA

    trace = Trace.load(ROOT / "traces" / "vllm" / "rswa-resume-hit-brings-back-gap-0.33.0.json")
    t = vllm_target("0.33.0")
    good = replay(trace, t)
    assert good.crash is None and good.first is None, good.crash or good.first
    assert good.witness["twin_rule"] > 0
    monkeypatch.setattr(RSWA, "vllm_hit_keeps_gap", False)
    bad = replay(trace, t)
    assert bad.first is not None and bad.first.prop == 6, bad.first
    assert "still holding its logical block 1" in bad.first.message, bad.first
    assert bad.first.step == 16 and bad.first.rid == "r0", bad.first


def test_a_failed_load_of_an_ending_request_spoils_its_sharers():
    """A request finished while its step loads a block fails that load; another
    request read the block through a prefix hit. The reference recomputes the
    sharer as vLLM does (its output read KV that never arrived), so the twin
    stays in step on 0.33.0 at depth 1."""
    trace = Trace.load(ROOT / "traces" / "vllm" /
                       "failed-load-of-ending-request-spoils-sharer-0.33.0.json")
    ref = replay(trace, "reference")
    assert ref.first is None, ref.first
    last = ref.rows[-1].obs.items
    procs = [it for it in last if type(it).__name__ == "ProcessObs"]
    assert procs and procs[0].failed and procs[0].failed[0][0] == "r1", procs
    assert "r1" in procs[0].discarded and not procs[0].accepted, procs
    got = replay(trace, vllm_target("0.33.0"))
    assert got.crash is None and got.first is None, got.crash or got.first
    assert got.witness["twin_compared"] == len(trace.events), got.witness
