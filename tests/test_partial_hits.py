"""Prefix hits that end inside a block (vLLM's partial hash hits).

vLLM serves them only with ``cache_config.prefix_match_unit`` below a Mamba
``"align"`` group's block, beside full attention (``partial_hash_hits_enabled``):
full attention keys the block holding a prompt's last hash boundary there,
Mamba keeps a chunk's state there, and a request whose hit ends inside a block
takes a private copy of it (copy-on-write). The copies run with the next step,
all at once (``copy_kv_cache_blocks_inplace``); the content rule follows them."""

from __future__ import annotations

import pytest

from cli.main import main
from model.events import AddRequest, Config, Group, Process, Schedule, Trace, TraceError
from model.observations import AllocObs, CopyObs, FreeObs, Observed, ReqStep, StepObs
from properties.invariants import Checker, expected_witnesses
from properties.machine import FuzzSpec, fuzz
from properties.replay import replay

EVENTS = [AddRequest("r0", 14, 1), Schedule(), Process(), Schedule(), Process(),
          AddRequest("r1", 20, 1), Schedule(), Process()]
PARTIAL = Config(groups=(Group("full"), Group("mamba")), block_size=8, num_blocks=40,
                 max_model_len=64, max_num_batched_tokens=32, prefix_caching=True,
                 prefix_match_unit=4)


def test_the_unit_sets_hashes_and_alignment_as_vllm_resolves_them():
    assert PARTIAL.hash_block_size == 4 and PARTIAL.partial_hits
    assert PARTIAL.hit_alignment == 4 and PARTIAL.scheduler_block_size == 8
    assert "partial_hit" in expected_witnesses(PARTIAL)
    unset = Config(groups=PARTIAL.groups, block_size=8, prefix_caching=True)
    assert unset.hash_block_size == 8 and not unset.partial_hits and unset.hit_alignment == 8
    assert "partial_hit" not in expected_witnesses(unset)
    d = PARTIAL.to_json()
    assert d["prefix_match_unit"] == 4 and "prefix_match_unit" not in unset.to_json()
    assert Config.from_json(d) == PARTIAL and "prefix-match-unit=4" in PARTIAL.label()


@pytest.mark.parametrize("kw,fragment", [
    (dict(groups=(Group("full"),)), "one KV-cache group: vLLM lands prefix hits on the block"),
    (dict(prefix_match_unit=3), "does not divide every group's block size [8, 8]"),
    (dict(prefix_caching=False), "needs prefix caching on"),
    (dict(groups=(Group("full"), Group("sliding", 4), Group("mamba"))),
     "enables sub-block hits"),
    (dict(groups=(Group("full"), Group("sliding", 4))), "enables sub-block hits"),
    (dict(prefix_match_unit=-2), "positive integer"),
])
def test_what_vllm_refuses_or_the_model_does_not_follow_is_one_line(kw, fragment):
    d = {**PARTIAL.to_json(), **{k: v for k, v in kw.items() if k != "groups"}}
    if "groups" in kw:
        d["groups"] = [{"kind": g.kind, **({"param": g.param} if g.param else {})}
                       for g in kw["groups"]]
    with pytest.raises(TraceError) as e:
        Config.from_json(d)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_the_cli_takes_fine_units_for_hybrids_only(capsys):
    assert main(["fuzz", "--kind", "full", "--prefix-match-unit", "fine"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kind hybrid" in err[0]


# ------------------------------------------------------------------ checker

def _feed(ch: Checker, ev, *items) -> list:
    return ch.feed(ev, Observed(items=list(items)))


def _producer(ch: Checker) -> None:
    """r0 (10 tokens) computes [0, 8) into full block 1 and Mamba block 2;
    then [8, 10) into full block 3."""
    _feed(ch, AddRequest("r0", 10, 2))
    _feed(ch, Schedule(), AllocObs(1, 0, "r0", 0), AllocObs(2, 1, "r0", 0),
          StepObs(0, (ReqStep("r0", 0, 8, tables=((1,), (2,))),)))
    _feed(ch, Process(), )


def _consumer(ch: Checker, copies: tuple) -> list:
    """r1 (12 tokens, same prefix) hits 4 tokens: inside r0's full block 1 and
    Mamba block 2; both are copied (5 and 6) and r1 computes [4, 12)."""
    _feed(ch, AddRequest("r1", 12, 1))
    return _feed(ch, Schedule(), AllocObs(1, 0, "r1", 0, cached=True),
                 AllocObs(2, 1, "r1", 0, cached=True),
                 CopyObs(1, 5, 0, "r1", 0), CopyObs(2, 6, 1, "r1", 0),
                 AllocObs(7, 0, "r1", 1), AllocObs(9, 1, "r1", 1),
                 FreeObs(1, 0, "r1", 0, "copy"),
                 FreeObs(5, 0, "r1", 0, "copy"), FreeObs(2, 1, "r1", 0, "copy"),
                 FreeObs(6, 1, "r1", 0, "copy"),
                 StepObs(1, (ReqStep("r1", 4, 12, tables=((5, 7), (6, 9))),), copies))


def test_a_hit_inside_a_block_reads_its_private_copy():
    ch = Checker(PARTIAL)
    _producer(ch)
    vs = _consumer(ch, ((1, 5), (2, 6)))
    assert not vs, vs
    assert ch.witness["partial_hit"] == 2
    assert ch.refs[5] == 1 and ch.refs[1] == 1 and ch.holder[("r1", 0, 0)] == 5


def test_a_copy_the_worker_never_ran_leaves_the_hit_unwritten():
    ch = Checker(PARTIAL)
    _producer(ch)
    vs = _consumer(ch, ((2, 6),))  # the full-attention copy is not handed over
    assert [v.prop for v in vs] == [2], vs
    assert "block 5 (logical 0) holds, at position 0, no KV" in vs[0].message


def test_copies_of_one_step_run_at_once():
    """A copy whose source another copy of the same step fills reads it empty."""
    ch = Checker(PARTIAL)
    _producer(ch)
    _feed(ch, AddRequest("r1", 12, 1))
    _feed(ch, AddRequest("r2", 12, 1))
    vs = _feed(ch, Schedule(), AllocObs(1, 0, "r1", 0, cached=True),
               AllocObs(2, 1, "r1", 0, cached=True), AllocObs(2, 1, "r2", 0, cached=True),
               CopyObs(1, 5, 0, "r1", 0), AllocObs(5, 0, "r2", 0, cached=True),
               CopyObs(5, 8, 0, "r2", 0),
               StepObs(1, (ReqStep("r1", 4, 8, tables=((5,), (2,))),
                           ReqStep("r2", 4, 8, tables=((8,), (2,)))), ((1, 5), (5, 8))))
    assert [v.prop for v in vs] == [2], vs
    assert "it is a copy of block 5, which held nothing" in vs[0].message


def test_a_copy_returned_early_is_judged_when_another_step_could_load_into_it():
    """r0's Mamba state at 8 is copied out (2 -> 10) with its next step, and
    the copy's references are dropped at once: block 10 is in the pool before
    the copy ran. Harmless until another step is scheduled meanwhile, when an
    unordered writer's load into it races the copy."""
    for hazard, want in (("unordered", [1]), ("ordered", [])):
        ch = Checker(Config(**{**PARTIAL.__dict__, "hazard": hazard}))
        _producer(ch)
        vs = _feed(ch, Schedule(), CopyObs(2, 10, 1, "r0", -1),
                   FreeObs(2, 1, "r0", -1, "copy"), FreeObs(10, 1, "r0", -1, "copy"),
                   AllocObs(3, 0, "r0", 1), AllocObs(4, 1, "r0", 1),
                   StepObs(1, (ReqStep("r0", 8, 10, tables=((1, 3), (2, 4))),), ((2, 10),)))
        assert not vs, vs
        assert ch.witness["partial_tail_copied"] == 1 and ch.refs[10] == 0
        vs = _feed(ch, Schedule(), StepObs(2, ()))
        assert [v.prop for v in vs] == want, vs
        if want:
            assert "block 10 returned to the pool" in vs[0].message
            assert "step 1, which runs the copy, is unprocessed" in vs[0].message


# ---------------------------------------------------------------- reference

def test_the_reference_serves_a_hit_inside_a_block_from_a_copy():
    """r0's 14-token prompt: its last hash boundary is 12, inside block 1; its
    first chunk stops there, its state is copied out before its next step;
    r1 (20 tokens) resumes at 12 from private copies of both blocks."""
    res = replay(Trace(PARTIAL, EVENTS), "reference")
    assert not res.violations, res.violations
    first = next(it for it in res.rows[1].obs.items if isinstance(it, StepObs))
    assert (first.reqs[0].start, first.reqs[0].end) == (0, 12)
    assert [(c.group, c.logical) for c in res.rows[3].obs.items
            if isinstance(c, CopyObs)] == [(1, -1)]
    items = res.rows[6].obs.items
    copies = [it for it in items if isinstance(it, CopyObs)]
    assert {(c.group, c.logical) for c in copies} == {(0, 1), (1, 1)}, copies
    step = next(it for it in items if isinstance(it, StepObs))
    assert step.reqs[-1].start == 12
    assert set(step.copies) == {(c.src, c.dst) for c in copies}


def test_fuzzing_the_reference_reaches_hits_inside_a_block():
    res = fuzz(FuzzSpec(kind="hybrid", match_unit="fine"), 80, seed=2)
    assert res.violation is None and res.crash is None, res.violation or res.crash
    assert not res.vacuous, res.vacuous
    assert res.stats.witness["partial_hit"] > 0 and res.stats.witness["partial_tail_copied"] > 0


# --------------------------------------------------------------------- vLLM

@pytest.mark.vllm
def test_vllm_copies_a_hit_inside_a_block_and_plans_the_unit():
    from impl.target import Unsupported
    from tests.vllm_targets import vllm_target

    t = vllm_target("0.33.0")
    # vLLM splits r0's prefill at block edges too ([0, 8), [8, 12)) and defers
    # a hit on a state copied out in the same step: r1 comes after r0 ended
    evs = [AddRequest("r0", 14, 1), *[Schedule(), Process()] * 3,
           AddRequest("r1", 20, 1), Schedule(), Process()]
    res = replay(Trace(PARTIAL, evs), t)
    assert not res.violations and res.crash is None, res.violations or res.crash
    copies = [it for row in res.rows for it in row.obs.items if isinstance(it, CopyObs)]
    assert any(c.rid == "r1" and c.group == 0 and c.logical >= 0 for c in copies), copies
    assert any(c.logical == -1 for c in copies), copies  # r0's state copied out
    with pytest.raises(Unsupported, match="no prefix_match_unit"):
        vllm_target("0.25.1").reset(PARTIAL)
