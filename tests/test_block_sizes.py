"""Groups of different block sizes and prefix hashes finer than a block.

vLLM plans a hybrid model whose layers' pages differ by raising the smaller
page's block size (``unify_kv_cache_spec_page_size``); its scheduler block is
the LCM of the groups' sizes and, with block hashes in use, requests are
hashed at their GCD (``resolve_kv_cache_block_sizes``): a coarser group's
block is keyed by the chained hash of its last unit. The config states a
group's own block size; the checker, the reference and the vLLM target cut
positions per group."""

from __future__ import annotations

import json

import pytest

from model.events import AddRequest, Config, Group, Process, Schedule, Trace, TraceError
from model.observations import AllocObs, Observed, ReqStep, StepObs
from properties.invariants import Checker, expected_witnesses
from properties.machine import FuzzSpec, fuzz
from properties.replay import replay

MIXED = Config(groups=(Group("full", block_size=8), Group("sliding", 5)), block_size=4,
               num_blocks=40, max_model_len=32, max_num_batched_tokens=16,
               prefix_caching=True)


def test_sizes_follow_vllms_rules():
    assert MIXED.block_sizes == (8, 4)
    assert MIXED.scheduler_block_size == 8 and MIXED.hash_block_size == 4
    assert Config(groups=MIXED.groups, block_size=4).hash_block_size == 8  # no hashes used
    assert Config(groups=MIXED.groups, block_size=4, hazard="unordered").hash_block_size == 4
    uniform = Config(groups=(Group("full"), Group("sliding", 5)), block_size=4,
                     prefix_caching=True)
    assert uniform.block_sizes == (4, 4) and not uniform.mixed_block_sizes
    assert uniform.scheduler_block_size == uniform.hash_block_size == 4
    assert "full[B=8]" in MIXED.label()


def test_round_trip_and_old_traces_unchanged(tmp_path):
    t = Trace(MIXED, [AddRequest("r0", 9, 2), Schedule(), Process()])
    p = t.save(tmp_path / "t.json")
    d = json.loads(p.read_text())
    assert d["config"]["groups"] == [{"kind": "full", "block_size": 8},
                                     {"kind": "sliding", "param": 5}]
    assert Trace.load(p).config == MIXED
    plain = Config(groups=(Group("full"), Group("sliding", 5)), block_size=4)
    assert "block_size" not in json.dumps(plain.to_json()["groups"])


@pytest.mark.parametrize("group,fragment", [
    ({"kind": "full", "block_size": 6}, "multiple of the config's block_size 4"),
    ({"kind": "full", "block_size": 0}, "positive integer"),
    ({"kind": "full", "block_size": True}, "positive integer"),
    ({"kind": "mamba", "block_size": 8}, "takes the config's block_size"),
    ({"kind": "sink", "param": 4, "block_size": 8}, "takes the config's block_size"),
    ({"kind": "chunked_local", "param": 4, "block_size": 8}, "multiple of the block size 8"),
    ({"kind": "full", "blocks": 8}, "optionally 'block_size'"),
])
def test_bad_group_block_sizes_are_one_line_errors(group, fragment):
    d = MIXED.to_json()
    d["groups"] = [group, {"kind": "sliding", "param": 5}]
    with pytest.raises(TraceError) as e:
        Config.from_json(d)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def _step(ch, step, rid, a, e, tables, allocs):
    items = [AllocObs(b, g, rid, lg, cached) for g, lg, b, cached in allocs]
    items.append(StepObs(step, (ReqStep(rid, a, e, tables=tables),)))
    return ch.feed(Schedule(), Observed(items))


def _two_requests(second_prompt: int) -> list:
    """``a`` (prompt 12) writes full-attention blocks of 8 tokens (1, 2) and
    sliding blocks of 4 (3, 4, 5); ``b`` then hits full block 1, which holds
    positions [0, 8) of a's prompt, and sliding block 4 (positions [4, 8))."""
    cfg = Config(groups=(Group("full", block_size=8), Group("sliding", 5)), block_size=4,
                 num_blocks=40, max_model_len=32, prefix_caching=True)
    ch = Checker(cfg)
    ch.feed(AddRequest("a", 12, 4), Observed([]))
    ch.feed(AddRequest("b", second_prompt, 4), Observed([]))
    assert not _step(ch, 0, "a", 0, 12, ((1, 2), (3, 4, 5)),
                     [(0, 0, 1, False), (0, 1, 2, False),
                      (1, 0, 3, False), (1, 1, 4, False), (1, 2, 5, False)])
    return ch, _step(ch, 1, "b", 8, 9, ((1, 6), (0, 4, 7)),
                     [(0, 0, 1, True), (0, 1, 6, False), (1, 1, 4, True), (1, 2, 7, False)])


def test_a_hit_on_a_coarser_groups_block_is_judged_per_position():
    ch, vs = _two_requests(10)  # b shares a's first 10 tokens: the 8-token block is good
    assert not vs
    assert ch.witness["fine_grained_hit"] == 1 and ch.witness["prefix_hit"] == 2
    assert "fine_grained_hit" in expected_witnesses(MIXED)
    assert "fine_grained_hit" not in expected_witnesses(
        Config(groups=(Group("full"), Group("sliding", 5)), block_size=4, prefix_caching=True))


def test_a_coarse_block_keyed_by_a_hash_short_of_its_end_reads_another_prefix():
    # b's prompt is 7 tokens: position 7 of a's block 1 is a's prompt token, b's
    # first output; a hash that stopped one unit short of the block's end
    # ([0, 4)) would match it
    _, vs = _two_requests(7)
    assert [v.prop for v in vs] == [2], vs
    msg = vs[0].message
    assert "full[B=8]" in msg and "block 1 (logical 0)" in msg and "at position 7" in msg
    assert "7-token prompt" in msg


def test_the_reference_lands_hits_on_the_scheduler_block():
    """A 14-token prompt hit by its twin: with blocks of 4 alone the hit would
    be 12 tokens; with an 8-token group beside them it ends at 8."""
    evs = [AddRequest("a", 14, 2), Schedule(), Process(), AddRequest("b", 14, 2), Schedule()]
    res = replay(Trace(MIXED, evs), "reference")
    assert not res.violations, res.violations
    cached = [it for it in res.rows[-1].obs.items if isinstance(it, AllocObs) and it.cached]
    assert sorted((it.group, it.logical) for it in cached) == [(0, 0), (1, 1)]
    step = next(it for it in res.rows[-1].obs.items if isinstance(it, StepObs))
    assert next(rs for rs in step.reqs if rs.rid == "b").start == 8


def test_fuzzing_mixed_sizes_on_the_reference_reaches_fine_grained_hits():
    res = fuzz(FuzzSpec(kind="hybrid", block_sizes="mixed", prefix_caching=True), 200, seed=3)
    assert res.violation is None and res.crash is None, res.violation or res.crash
    assert not res.vacuous, res.vacuous
    assert res.stats.witness["fine_grained_hit"] > 0


@pytest.mark.vllm
def test_vllm_plans_the_stated_block_sizes_and_refuses_what_it_cannot_run():
    from impl.target import Unsupported
    from tests.vllm_targets import vllm_target

    t = vllm_target("0.33.0")
    evs = [AddRequest("a", 14, 2), Schedule(), Process(), AddRequest("b", 14, 2), Schedule()]
    res = replay(Trace(MIXED, evs), t)
    assert not res.violations and res.crash is None, res.violations or res.crash
    cached = [it for it in res.rows[-1].obs.items if isinstance(it, AllocObs) and it.cached]
    assert sorted((it.group, it.logical) for it in cached) == [(0, 0), (1, 1)]
    chunked = Config(groups=(Group("full", block_size=8), Group("chunked_local", 4)),
                     block_size=4, num_blocks=40, max_model_len=32, prefix_caching=True)
    with pytest.raises(Unsupported, match="chunked-local manager asserts"):
        t.reset(chunked)
    # every group above the cache's block size: vLLM's planner keeps B for the largest page
    above = Config(groups=(Group("full", block_size=8), Group("sliding", 5, 8)), block_size=4,
                   num_blocks=40, max_model_len=32, prefix_caching=True)
    with pytest.raises(Unsupported, match="plans group block sizes"):
        t.reset(above)
