"""The Z3 proofs: settled is proved for every kind, the earlier policies are
refuted with short traces that replay on the reference target, a broken rule
is caught, and the admission bound is proved and compared."""

from __future__ import annotations

import json

import pytest

from model import windows
from model.events import KINDS, AddRequest, Group, Process, Schedule, Trace
from model.observations import FreeObs, ProcessObs, StepObs
from model.policy import REGISTRY
from prove.proof import (
    BoundResult,
    ProofResult,
    admission_bound,
    bound_examples,
    check_bound,
    format_results,
    prove,
    prove_all,
)
from prove.z3_arith import prove_lemmas
from prove.z3model import Z3_KINDS, exact_bound, policy_rule

# ------------------------------------------------------------------ helpers


def _reference():
    from impl.target import make_target

    return make_target("reference")


def _freed_while_read(trace: Trace) -> list[tuple[int, FreeObs, int]]:
    """Replay ``trace`` on the reference target; every (event index, window
    FreeObs, step) where the freed physical block is in the read set of a step
    not yet processed (its positions as scheduled, through its table)."""
    tgt = _reference()
    tgt.reset(trace.config)
    B = trace.config.block_size
    pending: dict[int, StepObs] = {}
    prompt = {e.id: e.prompt_len for e in trace.events if isinstance(e, AddRequest)}
    hits = []
    for i, ev in enumerate(trace.events):
        for item in tgt.apply(ev).items:
            if isinstance(item, FreeObs) and item.reason == "window":
                g = trace.config.groups[item.group]
                for idx, so in pending.items():
                    for rs in so.reqs:
                        if rs.rid != item.rid:
                            continue
                        table = rs.tables[item.group]
                        read = {table[b] for b in windows.read_blocks(g, rs.start, rs.end, B,
                                                                      prompt[rs.rid])
                                if b < len(table)}
                        if item.block in read:
                            hits.append((i, item, idx))
            elif isinstance(item, StepObs):
                pending[item.step] = item
            elif isinstance(item, ProcessObs):
                pending.pop(item.step, None)
    return hits


@pytest.fixture(scope="module")
def refutations() -> dict[tuple[str, str], ProofResult]:
    cases = [("sliding", "optimistic"), ("chunked_local", "optimistic"),
             ("sliding", "mamba-local")]
    return {c: prove(*c) for c in cases}


# ------------------------------------------------------------------- proofs


@pytest.mark.parametrize("kind", KINDS)
def test_settled_is_proved_for_every_kind(kind):
    r = prove(kind, "settled")
    assert r.status == "proved", r.detail
    assert r.trace is None and r.prop is None
    names = [c.transition for c in r.checks]
    if kind == "rswa":  # the gap lemma, over the one-request model's invariant
        assert names == ["gap lemma"] and r.checks[0].status == "proved"
        assert "settled count" in r.covers
        return
    if kind == "sink":
        assert "reserved blocks" in r.covers
    assert names[0] == "init" and {"schedule", "free-only", "process", "process-failed-load",
                                   "preempt", "finish", "process-discarded"} <= set(names)
    assert all(c.status == "proved" for c in r.checks)
    # every lemma the proof says it rests on is one Z3 proves for all integers
    named = r.covers.rsplit("lemmas (each proved for all integers): ", 1)[1].split(", ")
    proved = {lm.name for lm in prove_lemmas() if lm.status == "proved"}
    assert named and set(named) <= proved, set(named) - proved


def test_retained_tokens_reduce_to_a_wider_window():
    """sliding(W, R) frees as sliding(W+R) and a re-prefilling chunk reads
    inside its windows (both valid for all W, R); forgetting R is refuted
    with values."""
    from prove.proof import retained_checks

    same, inside, slip = retained_checks()
    assert same.status == inside.status == "proved"
    assert slip.status == "proved" and "R=" in slip.cti
    r = prove("sliding", "settled")
    assert [c.transition for c in r.checks][-3:] == [same.transition, inside.transition,
                                                     slip.transition]
    assert "retained tokens" in r.covers


def test_the_invariant_states_both_properties():
    from prove.z3model import make_params, safety_invariant

    prm = make_params("sliding")
    names = safety_invariant(prm, prm.arith(abstract=True)).names()
    assert {"P1-future", "P1-in-flight", "P2-future", "P2-in-flight"} <= set(names)


@pytest.mark.parametrize("policy", ["optimistic", "mamba-local"])
def test_rswa_on_the_optimistic_count_is_refuted_with_a_trace_the_reference_replays(policy):
    r = prove("rswa", policy)
    assert r.status == "refuted" and r.prop == 1, r.detail
    assert "gap lemma fails" in r.detail
    assert r.trace.config.groups[0].kind == "rswa" and r.trace.config.policy == policy
    hits = _freed_while_read(Trace.from_json(r.trace.to_json()))
    assert hits, r.trace.dumps()
    settled = Trace.from_json({**r.trace.to_json(),
                               "config": {**r.trace.config.to_json(), "policy": "settled"}})
    assert not _freed_while_read(settled)


def test_full_attention_frees_nothing_under_any_policy():
    for policy in ("optimistic", "mamba-local"):
        assert prove("full", policy).status == "proved"


# -------------------------------------------------------------- refutations


@pytest.mark.parametrize("case", [("sliding", "optimistic"), ("chunked_local", "optimistic"),
                                  ("sliding", "mamba-local")])
def test_refutation_is_a_short_loadable_trace(refutations, case):
    r = refutations[case]
    assert r.status == "refuted", r.detail
    assert r.trace is not None
    assert len(r.trace.events) <= 6
    assert r.trace.config.policy == case[1]
    assert r.trace.config.groups[0].kind == case[0]
    # the shared JSON format: it round-trips and validates
    again = Trace.from_json(json.loads(r.trace.dumps()))
    assert again.events == r.trace.events
    assert again.config == r.trace.config
    # the timeline names the freed block and the reading step
    assert "property 1" in r.detail and "freed while step" in r.detail
    # the induction itself fails where the rule frees, and only there
    broken = [c for c in r.checks if c.status != "proved"]
    assert [c.transition for c in broken] == ["schedule", "free-only"]


def test_mamba_local_is_refuted_by_a_rejection(refutations):
    r = refutations[("sliding", "mamba-local")]
    assert r.prop == 2
    assert r.trace.config.spec_tokens >= 1
    assert any(isinstance(e, Process) and any(v < r.trace.config.spec_tokens
                                              for v in e.accepted.values())
               for e in r.trace.events)
    assert "property 2" in r.detail and "NULL in its table" in r.detail


@pytest.mark.parametrize("case", [("sliding", "optimistic"), ("chunked_local", "optimistic"),
                                  ("sliding", "mamba-local")])
def test_refutation_replays_on_the_reference(refutations, case):
    trace = refutations[case].trace
    hits = _freed_while_read(Trace.from_json(trace.to_json()))
    assert hits, f"no window free of a block an unprocessed step reads:\n{trace.dumps()}"


def test_refutation_replays_under_the_checker(refutations):
    from properties.replay import replay

    for (kind, policy), r in refutations.items():
        res = replay(r.trace, "reference", stop_at_first=False)
        props = {v.prop for v in res.violations}
        assert 1 in props, (kind, policy)
        if r.prop == 2:
            assert 2 in props


def test_a_broken_rule_is_caught_with_a_counterexample():
    """Settled basis, but one block more: the induction fails at schedule, and
    a run from the initial state frees a block an unprocessed step reads."""
    settled = policy_rule("settled")

    def one_more(kind, counts, prm, ar):
        return settled(kind, counts, prm, ar) + prm.B

    for kind in ("sliding", "mamba", "full", "chunked_local"):
        r = prove(kind, "settled+1block", rule=one_more)
        assert r.status == "refuted", (kind, r.detail)
        cti = [c for c in r.checks if c.status == "cti"]
        assert [c.transition for c in cti] == ["schedule", "free-only"]
        assert any(n.startswith("P1") for n in cti[0].failed)
        assert "before st=" in cti[0].cti  # the counterexample to induction, in values
        assert "property 1" in r.detail
        assert r.trace is None  # not a registered policy: no replayable config


def test_the_counterexample_search_alone_finds_the_broken_rule():
    from prove.proof import search_counterexample

    settled = policy_rule("settled")
    found = search_counterexample(
        "sliding", "settled", lambda k, c, p, a: settled(k, c, p, a) + p.B, prop=1)
    assert found is not None and found.prop == 1
    # registered policy name: the trace comes back, two schedules suffice
    assert sum(isinstance(e, Schedule) for e in found.trace.events) >= 2


# ---------------------------------------------------------------------- API


def test_prove_all_filters_and_formats():
    rs = prove_all(kinds=["sliding"], policies=["settled", "optimistic"])
    assert [(r.kind, r.policy, r.status) for r in rs] == [
        ("sliding", "settled", "proved"), ("sliding", "optimistic", "refuted")]
    text = format_results(rs)
    assert "sliding" in text and "proved" in text and "refuted" in text
    assert "property 1" in text
    with pytest.raises(ValueError):
        prove_all(kinds=["bogus"])
    with pytest.raises(ValueError):
        prove_all(policies=["bogus"])


def test_prove_all_default_matrix():
    rs = prove_all()
    assert {(r.kind, r.policy) for r in rs} == {(k, p) for k in KINDS for p in REGISTRY}
    verdict = {(r.kind, r.policy): r.status for r in rs}
    for k in KINDS:
        assert verdict[(k, "settled")] == "proved"
    assert verdict[("full", "optimistic")] == "proved"
    for k in ("sink", "ring", "cross"):  # nothing is freed before the request ends
        assert verdict[(k, "optimistic")] == "proved"
    for k in ("sliding", "chunked_local", "mamba", "rswa"):
        assert verdict[(k, "optimistic")] == "refuted"
        assert verdict[(k, "mamba-local")] == "refuted"


def test_a_policy_that_is_not_symbolic_is_unknown(monkeypatch):
    def branching(group, counts):
        return counts.computed if counts.in_flight > 0 else 0  # Python branch on a Z3 term

    monkeypatch.setitem(REGISTRY, "branching", branching)
    r = prove("sliding", "branching")
    assert r.status == "unknown" and "symbolic" in r.detail


# ------------------------------------------------------------ admission bound


@pytest.mark.parametrize("kind", ["sliding", "chunked_local"])
def test_admission_bound_is_sufficient_and_tight(kind):
    b = admission_bound(kind)
    assert isinstance(b, BoundResult)
    assert b.status == "proved", [(c.transition, c.status) for c in b.checks]
    assert b.sufficient == b.exact_sufficient == b.tight == "proved"
    assert "T = D*M" in b.formula
    assert b.examples and all(e.kind == kind for e in b.examples)
    text = format_results([b], verbose=True)
    assert "pre-fix" in text and "exact" in text


def test_pre_fix_sizing_is_not_an_invariant():
    for kind in ("sliding", "chunked_local", "mamba"):
        cs = check_bound(kind, "code", pre_fix=True)
        assert [c.transition for c in cs if c.status == "cti"] == ["code pre-fix: schedule"]
        assert all(c.status == "proved" for c in cs if c.transition != "code pre-fix: schedule")
    assert all(c.status == "proved" for c in check_bound("full", "code", pre_fix=True))


def test_bound_examples():
    ex = bound_examples()
    assert {e.kind for e in ex} == set(Z3_KINDS)  # R-SWA and sink are sized as full
    for e in ex:
        g = Group(e.kind, e.param)
        assert e.pre_fix == windows.live_bound(g, e.block_size, e.max_model_len, e.budget)
        assert e.post_fix == windows.live_bound(g, e.block_size, e.max_model_len,
                                                e.depth * e.budget)
        assert e.exact <= e.post_fix <= e.exact + 1
        if e.kind != "full" and e.depth >= 2:
            assert e.exact > e.pre_fix  # the pre-fix pool is too small under settled
    gemma = next(e for e in ex if e.param == 4096)
    assert (gemma.pre_fix, gemma.post_fix, gemma.diff) == (769, 1281, 512)


def test_exact_bound_numbers():
    assert exact_bound("sliding", 16, 10 ** 6, 128, 16) == 10  # span 143: 9 blocks + 1
    assert exact_bound("sliding", 1, 10 ** 6, 3, 2) == 4  # B = 1: span blocks exactly
    assert windows.live_bound(Group("sliding", 2), 1, 10 ** 6, 3) == 5
    assert exact_bound("chunked_local", 16, 10 ** 6, 128, 32) == 10
    assert exact_bound("full", 16, 512, 0) == 32
    assert exact_bound("full", 16, 513, 0) == 32  # the last position is never computed
