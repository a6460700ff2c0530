"""Tests of the reference manager (impl/reference).

Besides the named scenarios, the random driver (model/streams.py) feeds valid
events and a tiny observation-only checker verifies what the reference
must guarantee under the settled policy: no window free inside the window of
the settled count, no step (shifted by rejections) reading a NULL slot, no
request-level free read by an unprocessed step under hazard=unordered, pool
accounting, in-flight accounting, the live-block bound.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from impl.reference import ReferenceTarget
from impl.reference.block_pool import BlockPool
from impl.reference.managers import MANAGERS
from impl.target import Unsupported
from model.events import (
    Abort,
    AddRequest,
    Config,
    FailLoad,
    Finish,
    Group,
    Preempt,
    Process,
    ResetPrefixCache,
    Schedule,
    Trace,
    TraceError,
    config_for,
)
from model.observations import (
    NULL,
    AllocObs,
    FinishObs,
    FreeObs,
    LiveCounters,
    ProcessObs,
    StepObs,
)
from model.streams import Driver
from model.windows import read_blocks, skipped

KINDS = ("full", "sliding", "chunked_local", "mamba", "hybrid")


def run(cfg: Config, events):
    t = ReferenceTarget()
    obs = [t.reset(cfg)]
    for ev in events:
        obs.append(t.apply(ev))
    return t, obs


def items(obs, cls=None):
    out = [i for o in obs for i in o.items]
    return [i for i in out if cls is None or isinstance(i, cls)]


# ------------------------------------------------------------------ managers


@pytest.mark.parametrize("group", [Group("full"), Group("sliding", 1), Group("sliding", 16),
                                   Group("sliding", 37), Group("chunked_local", 32),
                                   Group("chunked_local", 16), Group("mamba")])
def test_skipped_tokens_match_model_windows(group):
    m = MANAGERS[group.kind](group, 0, BlockPool(4, False), 16)
    for n in range(0, 300):
        assert m.get_num_skipped_tokens(n) == skipped(group, n), n


def test_a_prompt_variant_hits_only_the_blocks_before_its_differing_token():
    """Every request's prompt is the shared token stream: a second request of
    variant 0 hits every full block of a's prompt; variant 4 (differing at
    position 3, in block 1) hits block 0 only."""
    cfg = config_for("full", block_size=2, depth=1, prefix_caching=True)
    for variant, hits in ((0, {0, 1, 2, 3, 4}), (4, {0})):
        t, obs = run(cfg, [AddRequest("a", 10, 2), Schedule(), Process(), Finish("a"),
                           AddRequest("b", 12, 2, variant=variant), Schedule()])
        got = {a.logical for a in items(obs[-1:], AllocObs) if a.cached}
        assert got == hits, (variant, got)
        assert obs[-1].items[-1].reqs[0].start == 2 * len(hits)


# ------------------------------------------------- the optimistic free hazard


@pytest.mark.parametrize("kind", ["sliding", "chunked_local"])
def test_optimistic_frees_blocks_an_in_flight_step_reads(kind):
    """Step 0 computes [0, 64); the next Schedule frees on c = 64 under
    optimistic, i.e. blocks step 0 still reads; settled frees nothing."""
    evs = [AddRequest("r0", 100, 8), Schedule(), Schedule()]
    for policy in ("optimistic", "settled"):
        cfg = config_for(kind, window=16, chunk=32, block_size=16, depth=2, policy=policy,
                         max_num_batched_tokens=64)
        _, obs = run(cfg, evs)
        step0 = obs[2].items[-1]
        assert isinstance(step0, StepObs) and step0.reqs[0].start == 0
        assert step0.reqs[0].end == 64
        g = cfg.groups[0]
        read = {step0.reqs[0].tables[0][s] for s in read_blocks(g, 0, 64, 16)}
        frees = [i for i in obs[3].items if isinstance(i, FreeObs)]
        if policy == "optimistic":
            assert frees and all(f.reason == "window" for f in frees)
            assert {f.block for f in frees} <= read
            # the frees come before the step they were made for
            kinds = [type(i) for i in obs[3].items]
            assert kinds.index(StepObs) > max(i for i, k in enumerate(kinds) if k is FreeObs)
        else:
            assert frees == []


def test_rejection_shifts_a_later_step_onto_a_null_slot_under_optimistic():
    """spec=2, depth 2, sliding(W=16), B=16. After the prompt, step 1 decodes
    [28, 31) (2 drafts); step 2 is scheduled on c = 31 and, optimistic, frees
    slot 0 (positions < 16). Step 1's drafts are rejected: step 2 shifts down
    by 2 to [29, 32), and position 29 reads [14, 29]: slot 0, now NULL."""
    events = [AddRequest("r0", 28, 20), Schedule(), Process(), Schedule(), Schedule(),
              Process({"r0": 0})]
    B = 16
    for policy, expect in (("optimistic", True), ("settled", False)):
        cfg = config_for("sliding", window=16, block_size=B, depth=2, spec_tokens=2,
                         policy=policy)
        _, obs = run(cfg, events)
        step2 = obs[5].items[-1]
        assert isinstance(step2, StepObs) and step2.step == 2
        req = step2.reqs[0]
        assert (req.start, req.end, req.spec) == (31, 34, 2)
        proc = obs[6].items[0]
        assert isinstance(proc, ProcessObs) and proc.accepted == (("r0", 0),)
        shift = 2
        table = req.tables[0]
        slots = read_blocks(cfg.groups[0], req.start - shift, req.end - shift, B)
        reads_null = any(s >= len(table) or table[s] == NULL for s in slots)
        assert reads_null is expect, (policy, table, list(slots))
        assert obs[6].counters.reqs["r0"].computed == 32


# ------------------------------------------------------------- random driver


def random_config(rng: random.Random, **over) -> Config:
    kind = rng.choice(KINDS + ("sliding+mamba",))
    kw = dict(
        block_size=rng.choice([4, 8, 16]),
        num_blocks=rng.choice([12, 24, 64]),
        max_num_batched_tokens=rng.choice([8, 24, 64]),
        max_num_seqs=rng.choice([2, 4]),
        max_model_len=128,
        spec_tokens=rng.choice([0, 0, 1, 2]),
        depth=rng.choice([1, 2, 3, 4]),
        policy=rng.choice(["settled", "optimistic", "mamba-local"]),
        hazard=rng.choice(["ordered", "unordered"]),
        prefix_caching=rng.random() < 0.5,
    )
    kw.update(over)
    B = kw["block_size"]
    if kind == "sliding+mamba":
        return Config(groups=(Group("sliding", rng.choice([B, 2 * B + 3])), Group("mamba")), **kw)
    return config_for(kind, window=rng.choice([B, B + 1, 3 * B - 2]), chunk=2 * B, **kw)


def driver(cfg: Config, rng: random.Random | int = 0) -> Driver:
    """The random driver (model/streams.py) on one reference target."""
    return Driver(cfg, [ReferenceTarget()], rng, prompt=70, new=40)


def random_run(seed: int, n_events: int = 120, **over) -> Driver:
    rng = random.Random(seed)
    d = driver(random_config(rng, **over), rng)
    d.run(n_events)
    return d


def test_the_engine_order_allows_every_event_the_reference_takes():
    """model/streams.EngineState (read from observations) refuses no event the
    reference's own guard takes, so the driver misses none; it refuses some
    (a Schedule with depth steps in flight, an event of an ended request)."""
    refused = Counter()
    for seed in range(60):
        rng = random.Random(seed)
        d = driver(random_config(rng), rng)
        ref = d.targets[0]
        for _ in range(80):
            for _, ev in d.candidates():
                why = d.state.why_not(ev)
                if ref.can_apply(ev):
                    assert why is None, f"seed {seed}: {ev}: {why}"
                elif why is not None:
                    refused[type(ev).__name__] += 1
            if d.step() is None:
                break
    assert refused["Schedule"] and refused["Preempt"], refused


# ------------------------------------------------------------- sync unchanged


@pytest.mark.parametrize("chunk", range(4))
def test_depth1_every_policy_observes_the_same(chunk):
    for seed in range(chunk * 50, chunk * 50 + 50):
        d = random_run(seed, depth=1, policy="optimistic")
        for policy in ("settled", "mamba-local"):
            cfg = Config(**{**d.cfg.__dict__, "policy": policy})
            _, obs = run(cfg, d.events)
            assert obs == d.obs[0], f"seed {seed}: {policy} differs from optimistic at depth 1"


# ----------------------------------------------------------- the checker


class Checker:
    """What the reference guarantees, read from observations only (the
    properties layer does this for real; this is the reference's own guard)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.B = cfg.block_size
        self.steps: dict[int, list] = {}  # unprocessed step -> [[ReqStep, shift], ...]
        self.refs: Counter = Counter()  # block -> references handed out, not dropped
        self.live = LiveCounters()  # every live request's counters, before this event

    def lowest_shift(self, rid, step):
        """How much further ``rid``'s share of ``step`` may still shift down: the
        drafts of its earlier unprocessed steps, all rejected."""
        return sum(e[0].spec for s, es in self.steps.items() if s < step
                   for e in es if e[0].rid == rid)

    def null_reads(self, req, shift):
        out = []
        for g, table in zip(self.cfg.groups, req.tables, strict=True):
            for s in read_blocks(g, req.start - shift, req.end - shift, self.B):
                if s >= len(table) or table[s] == NULL:
                    out.append((g.kind, s))
        return out

    def check(self, o, strict: bool) -> list[str]:
        bad: list[str] = []
        cfg, B = self.cfg, self.B
        prev = self.live
        for i in o.items:
            if isinstance(i, AllocObs):
                assert i.block != NULL
                self.refs[i.block] += 1
            elif isinstance(i, FreeObs):
                self.refs[i.block] -= 1
                assert self.refs[i.block] >= 0, f"double free of block {i.block}"
                g = cfg.groups[i.group]
                if i.reason == "window":
                    c = prev[i.rid]
                    loading = sum(e[0].loaded for es in self.steps.values() for e in es
                                  if e[0].rid == i.rid)
                    p = c.computed - c.in_flight - loading
                    if (i.logical + 1) * B > skipped(g, p):
                        bad.append(f"window free of {i.rid} slot {i.logical} ({g.kind}) "
                                   f"above skipped(p={p})")
                elif cfg.hazard == "unordered" and self.refs[i.block] == 0:
                    for s, es in self.steps.items():
                        for req, shift in es:
                            low = max(0, req.start - shift - self.lowest_shift(req.rid, s))
                            slots = read_blocks(g, low, req.end - shift, B)
                            if any(req.tables[i.group][x] == i.block for x in slots
                                   if x < len(req.tables[i.group])):
                                bad.append(f"{i.reason} free of block {i.block} "
                                           f"read by step {s}")
            elif isinstance(i, StepObs):
                self.steps[i.step] = [[r, 0] for r in i.reqs]
                for r in i.reqs:
                    if self.null_reads(r, 0):
                        bad.append(f"step {i.step} {r.rid} reads NULL {self.null_reads(r, 0)}")
            elif isinstance(i, ProcessObs):
                # A window free after an output (a connector's finish path of
                # a request that ended there) counts on the request's final
                # counts (properties/invariants.py tracks them exactly).
                prev = {**self.live, **o.counters.reqs}
                drafts = {e[0].rid: e[0].spec for e in self.steps.pop(i.step)}
                for rid, a in i.accepted:
                    rej = drafts[rid] - a
                    if not rej:
                        continue
                    for s, es in self.steps.items():
                        for e in es:
                            if e[0].rid == rid:
                                e[1] += rej
                                if self.null_reads(e[0], e[1]):
                                    bad.append(f"step {s} {rid} shifted by {e[1]} reads NULL")
        c = o.counters
        owned = sum(1 for n in self.refs.values() if n > 0)
        assert c.free_blocks + owned + 1 == c.total_blocks, (c.free_blocks, owned)
        self.live.update(c)
        for rid, rc in self.live.items():
            assert rc.in_flight >= 0 and all(x >= 0 for x in rc.live)
            if strict:
                for g, (n, bound) in enumerate(zip(rc.live, c.bound, strict=True)):
                    if n > bound:
                        bad.append(f"{rid} holds {n} blocks in group {g}, bound {bound}")
        if not self.steps:
            assert all(rc.in_flight == 0 for rc in self.live.values())
        if strict:
            assert not bad, bad
        return bad


def checked_run(seed: int, n_events: int, strict: bool, **over):
    rng = random.Random(seed)
    cfg = random_config(rng, **over)
    d = driver(cfg, rng)
    ch = Checker(cfg)
    ch.live.update(d.obs[0][0].counters)
    bad = []
    for _ in range(n_events):
        if d.step() is None:
            break
        bad += ch.check(d.obs[0][-1], strict)
    return d, ch, bad


def test_settled_reference_keeps_the_invariants():
    """Random runs under settled: nothing the checker can see goes wrong, and
    every block is back once every request ended."""
    for seed in range(300):
        d, ch, _ = checked_run(seed, 150, strict=True, policy="settled")
        n = len(d.obs[0])
        d.end_all()
        for o in d.obs[0][n:]:
            ch.check(o, strict=True)
        c = d.obs[0][-1].counters
        assert c.free_blocks == c.total_blocks - 1, f"seed {seed}: leak"
        assert not ch.live.live() and all(not any(r.live) for r in ch.live.values())


def test_hybrids_with_mamba_take_ngram_drafts():
    """With prefix caching on and no connector loads, --kind hybrid draws full
    + Mamba and full + sliding + Mamba with drafts too; the reference holds
    and a rejection rolls a Mamba request back below the block edge whose
    state its step wrote."""
    from properties.machine import FuzzSpec, fuzz

    res = fuzz(FuzzSpec(kind="hybrid", prefix_caching=True, spec_tokens=2, external=False,
                        depth=2), 150, seed=2)
    assert res.violation is None and res.crash is None, res.violation or res.crash
    assert not res.vacuous, res.vacuous
    assert res.stats.layouts["full+mamba"] and res.stats.layouts["full+sliding+mamba"]
    assert res.stats.witness["checkpoint_near_rejection"] > 0


def test_optimistic_is_caught_by_the_same_checker():
    """The checker is not vacuous: it finds the optimistic policy's hazards."""
    found = Counter()
    for seed in range(300):
        rng = random.Random(seed)
        _, _, bad = checked_run(seed, 150, strict=False, policy="optimistic",
                                depth=rng.choice([2, 3]))
        for msg in bad:
            found[" ".join(msg.split()[:2])] += 1
    assert found["window free"] > 0, found
    assert any(k.startswith("step") for k in found), found  # a (shifted) step reads NULL


# ----------------------------------------------------------- named scenarios


def test_pool_accounting_after_every_event_and_no_leak():
    for seed in range(200):
        d = random_run(seed, 100)
        obs = d.obs[0]
        ch = Checker(d.cfg)
        ch.live.update(obs[0].counters)
        for o in obs[1:]:
            ch.check(o, strict=False)
        n = len(obs)
        d.end_all()
        for o in obs[n:]:
            ch.check(o, strict=False)
        c = obs[-1].counters
        assert c.free_blocks == c.total_blocks - 1
        assert all(v == 0 for v in ch.refs.values())


def test_preemption_under_pool_pressure():
    """Two requests and a pool too small for both: the later one is preempted,
    recomputes, and both finish with every block back."""
    cfg = config_for("full", block_size=4, num_blocks=10, max_num_batched_tokens=64, depth=2,
                     policy="settled")
    d = driver(cfg)
    d.apply(AddRequest("a", 12, 8))
    d.apply(AddRequest("b", 12, 8))
    for _ in range(200):  # the engine's loop, every draft accepted
        if not d.tick(draw=False):
            break
    obs = d.obs[0]
    frees = items(obs, FreeObs)
    assert any(f.reason == "preempt" and f.rid == "b" for f in frees)
    assert [f.reason for f in items(obs, FinishObs)] == ["length", "length"]
    # b was scheduled from 0 again after its preemption
    starts = [r.start for s in items(obs, StepObs) for r in s.reqs if r.rid == "b"]
    assert starts.count(0) >= 2
    assert obs[-1].counters.free_blocks == cfg.num_blocks - 1


def test_a_reset_preempts_every_running_request_and_drops_their_output():
    """vLLM's reset_prefix_cache(reset_running_requests=True): the running
    request is preempted, its in-flight output dropped, so it may resume in
    the next step while the old steps still run."""
    cfg = config_for("sliding", window=8, block_size=4, depth=3, policy="settled",
                     max_num_batched_tokens=8)
    evs = [AddRequest("a", 20, 4), Schedule(), Schedule(), ResetPrefixCache(), Schedule()]
    t, obs = run(cfg, evs)
    assert obs[4].items and all(f.reason == "preempt" for f in obs[4].items)
    assert obs[4].counters.reqs["a"] == obs[4].counters.reqs["a"].__class__(
        0, 0, (0,), "preempted")
    (resumed,) = obs[5].items[-1].reqs
    assert resumed.start == 0 and obs[5].counters.reqs["a"].status == "running"
    assert [t.apply(Process()).items[0].discarded for _ in range(2)] == [("a",), ("a",)]
    o = t.apply(Process())
    assert o.items[0].discarded == () and "a" in dict(o.items[0].accepted)  # counts


def test_a_reset_waits_for_room_in_the_batch_queue():
    """The engine takes a utility call between two steps of its loop: never
    with depth steps in flight (its loop takes the oldest output first)."""
    cfg = config_for("sliding", window=8, block_size=4, depth=2, policy="settled",
                     max_num_batched_tokens=8)
    t, obs = run(cfg, [AddRequest("a", 20, 4), Schedule(), Schedule()])
    assert not t.can_apply(ResetPrefixCache())
    t.apply(Process())
    o = t.apply(ResetPrefixCache())
    assert {f.reason for f in items([o], FreeObs)} == {"preempt"}
    assert o.counters.reqs["a"].status == "preempted"


def test_a_step_that_schedules_nothing_is_queued():
    """The engine queues an empty batch like any other: it takes a slot of
    the batch queue until its (empty) output is processed, and the engine
    calls schedule() only while it has requests (an ended one not yet told
    to the workers included)."""
    cfg = config_for("full", block_size=16, depth=2, max_num_batched_tokens=16)
    # a's one output token is in flight after the first step: nothing to schedule
    t, obs = run(cfg, [AddRequest("a", 16, 1), Schedule(), Schedule()])
    (empty,) = items(obs[-1:], StepObs)
    assert empty.step == 1 and empty.reqs == ()
    assert not t.can_apply(Schedule())  # two steps in flight, one of them empty
    t.apply(Process())  # a's output: it finishes
    (po,) = items([t.apply(Process())], ProcessObs)
    assert (po.step, po.accepted, po.discarded) == (1, (), ())
    assert t.can_apply(Schedule())  # once more: the workers learn that a ended
    t.apply(Schedule())
    t.apply(Process())
    assert not t.can_apply(Schedule())


def test_failed_load_recomputes_from_the_first_bad_block():
    """Into the blocks the request holds, as vLLM does: nothing is let go."""
    cfg = config_for("full", block_size=16, depth=2, policy="settled",
                     max_num_batched_tokens=64)
    evs = [AddRequest("a", 100, 4, external_tokens=64), Schedule()]
    t, obs = run(cfg, evs)
    req = obs[2].items[-1].reqs[0]
    assert (req.start, req.end, req.loaded) == (64, 100, 64)
    assert not t.can_apply(FailLoad("a", 4))  # block 4 = positions [64, 80): not loaded
    t.apply(FailLoad("a", 2))
    o = t.apply(Process())
    assert o.items[0].failed == (("a", 2),) and o.items[0].discarded == ("a",)
    assert not [i for i in o.items if isinstance(i, FreeObs)]
    assert o.counters.reqs["a"].computed == 32 and o.counters.reqs["a"].in_flight == 0
    o = t.apply(Schedule())
    step = o.items[-1].reqs[0]
    assert (step.start, step.end) == (32, 96) and step.tables == req.tables


def test_failed_load_in_a_sliding_window_recomputes_from_where_the_window_is_held():
    """The slots below the window of the external tokens were NULL-padded at
    admission (vLLM pads on local + external), so recomputing from the bad
    block would read NULL: the request goes back to a block whose window it
    holds, here the start."""
    cfg = config_for("sliding", window=16, block_size=16, depth=1, policy="settled")
    t, obs = run(cfg, [AddRequest("a", 100, 4, external_tokens=80), Schedule()])
    req = obs[2].items[-1].reqs[0]
    assert req.tables[0][:4] == (0, 0, 0, 0) and req.loaded == 80
    t.apply(FailLoad("a", 4))
    o = t.apply(Process())
    assert o.counters.reqs["a"].computed == 0
    o = t.apply(Schedule())
    assert o.items[-1].reqs[0].start == 0


def test_prefix_cache_hits_across_requests():
    cfg = config_for("hybrid", window=16, block_size=16, depth=1, prefix_caching=True)
    t, obs = run(cfg, [AddRequest("a", 70, 2), Schedule(), Process(), Finish("a"),
                       AddRequest("b", 90, 2), Schedule()])
    allocs = [i for i in obs[-1].items if isinstance(i, AllocObs)]
    hit = [a for a in allocs if a.cached]
    assert hit, allocs
    req = obs[-1].items[-1].reqs[0]
    assert req.start == 64  # four full prompt blocks of "a" hit in both groups
    assert req.tables[1][:3] == (0, 0, 0)  # sliding: only the window's block is taken
    assert {a.logical for a in hit if a.group == 0} == {0, 1, 2, 3}


def test_unordered_hazard_defers_request_frees_behind_in_flight_steps():
    for hazard, deferred in (("ordered", False), ("unordered", True)):
        cfg = config_for("full", block_size=16, depth=2, hazard=hazard)
        t, obs = run(cfg, [AddRequest("a", 40, 4), Schedule(), Abort("a")])
        frees = [i for i in obs[3].items if isinstance(i, FreeObs)]
        assert bool(frees) is not deferred
        assert obs[3].items[0] == FinishObs("a", "abort")
        o = t.apply(Process())
        assert o.items[0].discarded == ("a",)
        assert bool([i for i in o.items if isinstance(i, FreeObs)]) is deferred
        assert o.counters.free_blocks == cfg.num_blocks - 1


def test_invalid_events_are_refused():
    cfg = config_for("full", depth=1, spec_tokens=1)
    t = ReferenceTarget()
    t.reset(cfg)
    assert not t.can_apply(Process())
    with pytest.raises(ValueError):
        t.apply(Process())
    assert not t.can_apply(AddRequest("a", 500, 100))
    t.apply(AddRequest("a", 30, 5))
    assert not t.can_apply(AddRequest("a", 30, 5))
    assert not t.can_apply(Preempt("a"))  # no vLLM call preempts one request
    assert not t.can_apply(FailLoad("a", 0))
    t.apply(Schedule())
    assert not t.can_apply(Schedule())  # depth 1
    assert not t.can_apply(Process({"a": 1}))  # the prefill has no drafts
    t.apply(Process())
    t.apply(Schedule())
    assert t.can_apply(Process({"a": 1})) and not t.can_apply(Process({"a": 2}))
    o = t.apply(Finish("a"))  # depth 1: held while the step runs
    assert o.items == [] and t.can_apply(Abort("a"))
    o = t.apply(Process())
    assert o.items[0].discarded == ("a",) and o.items[1] == FinishObs("a", "finish")
    assert not t.can_apply(Abort("a"))
    with pytest.raises(Unsupported):
        t.reset(Config(groups=(Group("sliding", 0),)))


def test_counters_report_the_bound_per_group():
    cfg = config_for("hybrid", window=16, block_size=16, depth=2, max_num_batched_tokens=64,
                     max_model_len=512)
    o = ReferenceTarget().reset(cfg)
    # full: every block of max_model_len; sliding: cdiv(15 + 2*64, 16) + 1
    assert o.counters.bound == (32, 10)


def test_own_failed_load_past_a_shared_bad_block_recomputes_from_the_shared_one():
    """r1 hits r0's loaded blocks 1-5 and loads its own tail; both loads fail,
    r0's from block 0, r1's from block 5. r1 must recompute from 0 (it holds
    r0's spoiled blocks), not from its own bad block."""
    from properties.replay import replay

    cfg = config_for("full", block_size=16, num_blocks=11, max_num_batched_tokens=16,
                     depth=1, hazard="unordered", prefix_caching=True)
    events = [AddRequest("r0", 80, 1, 65), AddRequest("r1", 82, 1, 81), Schedule(),
              FailLoad("r0", 0), FailLoad("r1", 5), Process(), Finish("r0"), Schedule()]
    rr = replay(Trace(cfg, events), "reference")
    assert rr.first is None, rr.first
    (po,) = [it for it in rr.rows[5].obs.items if isinstance(it, ProcessObs)]
    assert dict(po.failed) == {"r0": 0, "r1": 0}
    (step,) = [it for it in rr.rows[7].obs.items if isinstance(it, StepObs)]
    assert [(rs.rid, rs.start) for rs in step.reqs] == [("r1", 0)]


def test_a_preempted_requests_output_that_read_a_failed_load_is_dropped():
    """r2 hits r1's blocks (prefix cache) in the step whose load into them
    fails, and is preempted meanwhile: its stale output read KV that never
    arrived, so it is dropped, not delivered like other stale output."""
    from properties.replay import replay

    cfg = config_for("full", block_size=16, num_blocks=6, max_num_batched_tokens=16,
                     depth=2, hazard="ordered", prefix_caching=True)
    cfg = replace(cfg, num_blocks=3)
    # the second step preempts r2 under pool pressure: r1's decode needs a block
    events = [AddRequest("r1", 16, 2, 1), AddRequest("r2", 17, 1), Schedule(),
              Schedule(), FailLoad("r1", 0), Process()]
    rr = replay(Trace(cfg, events), "reference")
    (step,) = [it for it in rr.rows[2].obs.items if isinstance(it, StepObs)]
    assert [(rs.rid, rs.start) for rs in step.reqs] == [("r1", 1), ("r2", 16)]
    assert {(f.rid, f.reason) for f in rr.rows[3].obs.items
            if isinstance(f, FreeObs)} == {("r2", "preempt")}
    assert rr.first is None, rr.first
    (po,) = [it for it in rr.rows[5].obs.items if isinstance(it, ProcessObs)]
    assert "r2" in po.discarded and "r2" not in dict(po.accepted)


@pytest.mark.parametrize("kind,held", [("ring", 1), ("cross", 3)])
def test_ring_and_cross_hold_their_blocks_until_the_request_ends(kind, held):
    """The reference's circular buffer holds one block, its cross attention
    cdiv(E, B) (E = 40, B = 16), from the first schedule to the request's end,
    however far decoding runs; the end returns them; a preemption takes them
    and the restart claims them again."""
    cfg = config_for(kind, block_size=16, depth=2, max_num_batched_tokens=128,
                     max_model_len=128, num_blocks=40, encoder_len=40)
    evs = [AddRequest("r0", 20, 60), Schedule()]
    for _ in range(35):
        evs += [Schedule(), Process()]
    t, obs = run(cfg, evs)
    steps = [s for s in items(obs, StepObs)]
    first = steps[0].reqs[0].tables[1]
    assert len(first) == held and NULL not in first
    assert steps[-1].reqs[0].start > 48
    assert all(s.reqs[0].tables[1] == first for s in steps)
    assert not [f for f in items(obs, FreeObs) if f.group == 1]
    end = [t.apply(Process()), t.apply(ResetPrefixCache()), t.apply(Schedule())]
    assert sorted(f.block for f in items(end, FreeObs) if f.group == 1) == sorted(first)
    again = [s for s in items(end, StepObs)][-1].reqs[0]
    assert again.start == 0 and len(again.tables[1]) == held
    done = [t.apply(Finish("r0")), t.apply(Process())]
    assert done[-1].counters.free_blocks == cfg.num_blocks - 1


def test_a_long_decode_shares_its_block_tables_between_steps():
    """Steps that do not change a request's table share one table object, and
    a table that changed shares with the one before every leaf it did not
    change: a long decode's tables cost memory per change, not per slot
    (as tuples, one per change, they grew quadratic in the decode)."""
    from model.observations import BlockTable

    cfg = config_for("sliding", block_size=16, num_blocks=16, max_num_batched_tokens=64,
                     max_num_seqs=1, max_model_len=2400, window=16)
    evs = [AddRequest("r0", 16, 2300)]
    for _ in range(2200):
        evs += [Schedule(), Process()]
    _, obs = run(cfg, evs)
    tables = [s.reqs[0].tables[0] for s in items(obs, StepObs)]
    assert len(tables) == 2200 and len(tables[-1]) > 130
    distinct = list({id(t): t for t in tables}.values())
    assert len(distinct) == len({tuple(t) for t in tables})  # equal tables: one object
    assert len(distinct) <= 2 * (2200 // 16 + 2)  # per block: appended, then NULL
    for a, b in zip(tables, tables[1:], strict=False):
        if tuple(a) == tuple(b):
            assert a is b
    longs = [t for t in distinct if len(t) > 32]
    assert longs and all(isinstance(t, BlockTable) for t in longs)
    for a, b in zip(longs, longs[1:], strict=False):
        was = {id(leaf) for leaf in a._leaves()}
        changed = {i // 32 for i in range(len(b)) if i >= len(a) or a[i] != b[i]}
        fresh = [k for k, leaf in enumerate(b._leaves()) if id(leaf) not in was]
        assert set(fresh) <= changed, (len(a), len(b), fresh, changed)


def test_ring_and_cross_take_no_prefix_hits():
    for kind in ("ring", "cross"):
        with pytest.raises(TraceError, match="takes no prefix hits"):
            config_for(kind, block_size=16, prefix_caching=True)
