"""The checker on hand-made observations: property 2's content rule.

Every slot of a block holds the KV some step (or a connector load) wrote
there for one token prefix (model.tokens). A step may read, below its start,
only slots written for its own prefix: a block handed out afresh holds
nothing, a prefix hit keeps what the block holds, a rejected draft's KV is
no one's."""

from __future__ import annotations

from model.events import AddRequest, Finish, Preempt, Process, Schedule, config_for
from model.observations import (
    AllocObs,
    FinishObs,
    FreeObs,
    Observed,
    ProcessObs,
    ReqStep,
    StepObs,
)
from model.tokens import OUTPUT_TOKEN, describe_key, prefix_key, prompt_token
from properties.invariants import Checker

B = 4


def checker(kind="full", **kw):
    return Checker(config_for(kind, block_size=B, depth=2, **kw))


def add(ch, rid, prompt, variant=0):
    return ch.feed(AddRequest(rid, prompt, 8, variant=variant), Observed([]))


def schedule(ch, step, parts, allocs=()):
    """parts: (rid, start, end, table[, spec[, loaded]]) per request."""
    items = [AllocObs(b, 0, rid, lg, cached) for rid, lg, b, cached in allocs]
    reqs = tuple(ReqStep(p[0], p[1], p[2], *(p[4:] or ()), tables=(tuple(p[3]),)) for p in parts)
    items.append(StepObs(step, reqs))
    return ch.feed(Schedule(), Observed(items))


def process(ch, step, accepted=()):
    return ch.feed(Process(dict(accepted)), Observed([ProcessObs(step, tuple(accepted))]))


def only_prop2(vs):
    assert [v.prop for v in vs] == [2], vs
    return vs[0].message


def test_the_token_model_names_prefixes():
    assert prefix_key(5, 3) == prefix_key(9, 3)  # both still in their prompts
    assert prefix_key(5, 6) != prefix_key(9, 6)  # one generated, one in its prompt
    assert prefix_key(5, 6) == prefix_key(5, 6)
    assert all(prompt_token(t) != OUTPUT_TOKEN for t in range(5000))
    assert "5-token prompt" in describe_key(prefix_key(5, 6))


def test_prompt_variants_share_tokens_past_one_position_but_not_the_prefix():
    # variant 2 differs from variant 0 at position 1 only
    assert prompt_token(1, 2) != prompt_token(1, 0)
    assert [prompt_token(t, 2) for t in range(2, 40)] == [prompt_token(t) for t in range(2, 40)]
    assert prompt_token(1, 2) != OUTPUT_TOKEN
    assert prefix_key(9, 0, 2) == prefix_key(9, 0)  # before the differing token
    assert prefix_key(9, 1, 2) != prefix_key(9, 1)
    assert prefix_key(9, 5, 2) != prefix_key(9, 5)  # same token, another prefix
    assert prefix_key(9, 12, 2) != prefix_key(9, 12)
    assert prefix_key(9, 5, 2) != prefix_key(9, 5, 3)
    assert prefix_key(2, 5, 4) == prefix_key(2, 5)  # a 2-token prompt never reaches position 3
    assert "variant 2" in describe_key(prefix_key(9, 5, 2))


def test_a_hit_on_another_variants_block_reads_stale_kv():
    """b's prompt differs from a's at position 0 only: block 1 holds the same
    tokens for both, but a's KV there was computed under another prefix."""
    ch = checker("sliding", window=2)
    add(ch, "a", 8)
    add(ch, "b", 8, variant=1)
    assert not schedule(ch, 0, [("a", 0, 8, (1, 2))],
                        [("a", 0, 1, False), ("a", 1, 2, False)])
    msg = only_prop2(schedule(ch, 1, [("b", 7, 9, (0, 2, 3))],
                              [("b", 1, 2, True), ("b", 2, 3, False)]))
    assert "block 2" in msg and "variant 1" in msg


def test_a_hit_on_a_block_written_in_an_earlier_step_or_the_same_step_is_good():
    ch = checker()
    add(ch, "a", 8)
    add(ch, "b", 8)
    assert not schedule(ch, 0, [("a", 0, 8, (1, 2))],
                        [("a", 0, 1, False), ("a", 1, 2, False)])
    # b hits both blocks (same prompt) and computes position 8 in the next step
    assert not schedule(ch, 1, [("b", 7, 9, (1, 2, 3))],
                        [("b", 0, 1, True), ("b", 1, 2, True), ("b", 2, 3, False)])
    ch2 = checker()
    add(ch2, "a", 8)
    add(ch2, "b", 8)
    # same step: a writes block 1 while b, which hit it, reads it (per layer,
    # every write of a step lands before any read)
    assert not schedule(ch2, 0, [("a", 0, 4, (1,)), ("b", 4, 6, (1, 2))],
                        [("a", 0, 1, False), ("b", 0, 1, True), ("b", 1, 2, False)])


def test_a_hit_on_a_block_no_step_wrote_is_caught():
    ch = checker()
    add(ch, "a", 16)
    add(ch, "b", 16)
    schedule(ch, 0, [("a", 0, 4, (1,))], [("a", 0, 1, False)])
    # block 2 was handed to a (cached ahead of its chunk): b hits it before
    # any step of a wrote positions [4, 8)
    schedule(ch, 1, [("a", 4, 6, (1, 2))], [("a", 1, 2, False)])
    msg = only_prop2(schedule(ch, 2, [("b", 8, 9, (1, 2, 3))],
                              [("b", 0, 1, True), ("b", 1, 2, True), ("b", 2, 3, False)]))
    assert "block 2 (logical 1)" in msg and "position 6" in msg and "no KV" in msg


def test_a_hit_on_a_block_written_for_another_prefix_is_caught():
    ch = checker()
    add(ch, "a", 5)  # a generates from position 5 on
    add(ch, "b", 9)  # b's positions 5..8 are prompt tokens
    schedule(ch, 0, [("a", 0, 5, (1, 2))], [("a", 0, 1, False), ("a", 1, 2, False)])
    process(ch, 0)
    schedule(ch, 1, [("a", 5, 8, (1, 2))])
    msg = only_prop2(schedule(ch, 2, [("b", 8, 9, (1, 2, 3))],
                              [("b", 0, 1, True), ("b", 1, 2, True), ("b", 2, 3, False)]))
    assert "position 5" in msg and "5-token prompt" in msg and "not b's" in msg


def test_a_block_handed_out_afresh_holds_nothing():
    ch = checker()
    add(ch, "a", 8)
    add(ch, "b", 8)
    schedule(ch, 0, [("a", 0, 8, (1, 2))], [("a", 0, 1, False), ("a", 1, 2, False)])
    process(ch, 0)
    ch.feed(Finish("a"), Observed([FinishObs("a", "finish"), FreeObs(2, 0, "a", 1, "finish"),
                                   FreeObs(1, 0, "a", 0, "finish")]))
    # block 1 handed to b afresh (not a hit): what a wrote there is not b's
    msg = only_prop2(schedule(ch, 1, [("b", 4, 5, (1, 2))],
                              [("b", 0, 1, False), ("b", 1, 2, True)]))
    assert "block 1 (logical 0)" in msg and "no KV" in msg


def _decoding(ch):
    add(ch, "a", 8)
    schedule(ch, 0, [("a", 0, 8, (1, 2))], [("a", 0, 1, False), ("a", 1, 2, False)])
    process(ch, 0)
    # decode at 8 with two drafts (9, 10)
    schedule(ch, 1, [("a", 8, 11, (1, 2, 3), 2)], [("a", 2, 3, False)])


def test_a_rejected_draft_holds_no_ones_kv():
    ch = checker()
    _decoding(ch)
    assert not process(ch, 1, [("a", 0)])  # both drafts rejected: a is back at 9
    assert not schedule(ch, 2, [("a", 9, 12, (1, 2, 3), 2)])  # recomputes from 9: good
    ch = checker()
    _decoding(ch)
    process(ch, 1, [("a", 0)])
    # a step that reads past the rollback reads the rejected drafts' KV
    msg = only_prop2(schedule(ch, 2, [("a", 11, 12, (1, 2, 3))]))
    assert "position 9" in msg and "rejected" in msg


def test_a_step_shifted_by_a_rejection_writes_its_new_positions():
    ch = checker()
    _decoding(ch)
    # scheduled as if both drafts were accepted: [11, 14)
    schedule(ch, 2, [("a", 11, 14, (1, 2, 3, 4), 2)], [("a", 3, 4, False)])
    # both rejected: step 2 runs at [9, 12) and writes 9 and 10 again
    assert not process(ch, 1, [("a", 0)])
    assert not process(ch, 2, [("a", 2)])
    assert not schedule(ch, 3, [("a", 12, 13, (1, 2, 3, 4))])
    ch = checker()
    _decoding(ch)
    schedule(ch, 2, [("a", 11, 14, (1, 2, 3, 4), 2)], [("a", 3, 4, False)])
    process(ch, 1, [("a", 0)])
    process(ch, 2, [("a", 2)])
    # a step that starts where step 2 was first placed reads what it never wrote
    msg = only_prop2(schedule(ch, 3, [("a", 14, 15, (1, 2, 3, 4))]))
    assert "position 12" in msg and "shifted" in msg


def test_a_block_found_good_at_one_slot_is_checked_again_at_another():
    """The verified-range memo is per slot: after a preemption a (broken) hit
    puts a's blocks 1 and 2 back swapped; block 2 holds positions 4..7, so at
    slot 0 it does not hold what a reads there, though a read it before."""
    ch = checker()
    add(ch, "a", 8)
    assert not schedule(ch, 0, [("a", 0, 8, (1, 2))],
                        [("a", 0, 1, False), ("a", 1, 2, False)])
    assert not process(ch, 0)
    assert not schedule(ch, 1, [("a", 8, 9, (1, 2, 3))], [("a", 2, 3, False)])
    assert not process(ch, 1)
    assert not ch.feed(Preempt("a"), Observed([FreeObs(3, 0, "a", 2, "preempt"),
                                              FreeObs(2, 0, "a", 1, "preempt"),
                                              FreeObs(1, 0, "a", 0, "preempt")]))
    msg = only_prop2(schedule(ch, 2, [("a", 8, 9, (2, 1, 4))],
                              [("a", 0, 2, True), ("a", 1, 1, True), ("a", 2, 4, False)]))
    assert "block 2 (logical 0)" in msg


def test_stream_ordered_frees_are_judged_by_the_hazard():
    """Config.stream_ordered (SGLang's one forward stream): the optimistic
    free of slots 0-4 under the in-flight chunk [0, 8) is property 1 as vLLM's
    rule judges it, the free_read_in_flight witness when stream-ordered with
    no unordered writer, and property 1 again under hazard unordered."""
    from dataclasses import replace

    from model.events import AddRequest, Config, Group, Schedule, Trace
    from properties.replay import replay

    cfg = Config(groups=(Group("sliding", 4),), block_size=1, num_blocks=64,
                 max_num_batched_tokens=8, max_model_len=32, depth=2, policy="optimistic")
    events = [AddRequest("r0", 16, 2), Schedule(), Schedule()]
    got = {}
    for c in (cfg, replace(cfg, stream_ordered=True),
              replace(cfg, stream_ordered=True, hazard="unordered")):
        r = replay(Trace(c, events), "reference", stop_at_first=False)
        got[(c.stream_ordered, c.hazard)] = (sorted({v.prop for v in r.violations}),
                                            r.witness.get("free_read_in_flight", 0))
    assert got == {(False, "ordered"): ([1], 0), (True, "ordered"): ([], 5),
                   (True, "unordered"): ([1], 5)}, got


def test_stream_ordered_frees_with_drafts_are_judged_at_the_rollback_floor():
    """Stream-ordered with drafts: a window free must lie outside the window
    of the lowest count a rejection can roll back to (the settled count plus
    the in-flight tokens that are not drafts). A prefill chunk in flight
    cannot be rejected, so the optimistic free under chunk [0, 8) holds; two
    decodes with drafts in flight can be, so the free of [6, 8) is property 1
    (a rollback to 9 reads [6, 9])."""
    from model.events import AddRequest, Config, Group, Process, Schedule, Trace
    from properties.replay import replay

    cfg = Config(groups=(Group("sliding", 4),), block_size=1, num_blocks=64,
                 max_num_batched_tokens=8, max_model_len=32, depth=2, policy="optimistic",
                 spec_tokens=2, stream_ordered=True)
    chunk = replay(Trace(cfg, [AddRequest("r0", 16, 2), Schedule(), Schedule()]),
                   "reference", stop_at_first=False)
    assert not chunk.violations and chunk.witness["free_read_in_flight"] == 5
    drafts = replay(Trace(cfg, [AddRequest("r0", 8, 8), Schedule(), Process(), Schedule(),
                                Schedule()]), "reference", stop_at_first=False)
    assert {v.prop for v in drafts.violations} == {1}
    assert any("rollback to count 9 (settled 8" in v.message and "logical 6 of r0" in v.message
               for v in drafts.violations), [v.message for v in drafts.violations]
