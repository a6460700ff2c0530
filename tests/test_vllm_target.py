"""The ``vllm@VERSION`` target on the real vLLM releases (impl/vllm).

Each test drives vLLM's own scheduler and KV-cache manager in a worker
process and reads the observations back. They need the releases installed
(``scripts/install-vllm.sh 0.25.1`` and ``0.33.0``; ``make test`` does it): a
missing install FAILS the test with that command, it never skips.
"""

from __future__ import annotations

import subprocess

import pytest

from impl.target import Capabilities, TargetCrash, TargetError, Unsupported, make_target
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
    config_for,
)
from model.observations import (
    NULL,
    FinishObs,
    FreeObs,
    LiveCounters,
    Observed,
    ProcessObs,
    StepObs,
)
from model.windows import read_blocks
from tests.vllm_targets import vllm_target

pytestmark = pytest.mark.vllm

BUGGY, FIXED = "0.25.1", "0.33.0"
def target(version: str):
    return vllm_target(version)


def run(version: str, cfg, events) -> list[Observed]:
    t = target(version)
    t.reset(cfg)
    return [t.apply(ev) for ev in events]


def items(obs: Observed, kind: type) -> list:
    return [it for it in obs.items if isinstance(it, kind)]


def step_of(obs: Observed) -> StepObs:
    (s,) = items(obs, StepObs)
    return s


# ------------------------------------------------------------- the seed bug


SEED = [AddRequest("r0", 100, 8), Schedule(), Schedule()]


@pytest.mark.parametrize("kind", ["sliding", "chunked_local"])
def test_seed_bug_on_0_25_1_frees_blocks_step_0_still_reads(kind):
    cfg = config_for(kind, window=16, chunk=32, block_size=16, depth=2,
                     max_num_batched_tokens=128)
    obs = run(BUGGY, cfg, SEED)
    s0, s1 = step_of(obs[1]), step_of(obs[2])
    assert (s0.reqs[0].start, s0.reqs[0].end) == (0, 100)
    assert (s1.reqs[0].start, s1.reqs[0].end) == (100, 101)
    freed = items(obs[2], FreeObs)
    assert freed and {f.reason for f in freed} == {"window"}
    # step 0 is still in flight and reads every one of those blocks
    table0 = s0.reqs[0].tables[0]
    read0 = {table0[i] for i in read_blocks(cfg.groups[0], 0, 100, 16)}
    assert {f.block for f in freed} <= read0
    # ... and step 1 is scheduled with NULL in their slots
    assert all(s1.reqs[0].tables[0][f.logical] == NULL for f in freed)


@pytest.mark.parametrize("kind", ["sliding", "chunked_local"])
def test_seed_bug_fixed_on_0_33_0(kind):
    cfg = config_for(kind, window=16, chunk=32, block_size=16, depth=2,
                     max_num_batched_tokens=128)
    obs = run(FIXED, cfg, SEED)
    assert not items(obs[2], FreeObs)
    assert step_of(obs[2]).reqs[0].tables == step_of(obs[1]).reqs[0].tables
    # the out-of-window blocks go once step 0 is processed
    more = target(FIXED).apply(Process())
    assert not items(more, FreeObs)
    later = target(FIXED).apply(Schedule())
    assert {f.reason for f in items(later, FreeObs)} == {"window"}


def test_capabilities_follow_the_fix():
    old, new = target(BUGGY).capabilities, target(FIXED).capabilities
    assert isinstance(old, Capabilities)
    assert old.fixed_policy == "optimistic" and new.fixed_policy == "settled"


def test_two_releases_in_one_process():
    cfg = config_for("sliding", window=16, block_size=16, depth=2,
                     max_num_batched_tokens=128)
    a, b = target(BUGGY), target(FIXED)
    a.reset(cfg)
    b.reset(cfg)
    for ev in SEED:
        oa, ob = a.apply(ev), b.apply(ev)
    assert items(oa, FreeObs) and not items(ob, FreeObs)
    assert oa.counters.reqs["r0"].in_flight is None
    assert ob.counters.reqs["r0"].in_flight == 101


# ------------------------------------------------------- the paths on 0.33.0


def test_failed_load_recomputes_from_the_bad_block():
    cfg = config_for("full", block_size=16, depth=1, hazard="unordered",
                     max_num_batched_tokens=128)
    t = target(FIXED)
    obs = run(FIXED, cfg, [AddRequest("r0", 100, 4, external_tokens=64), Schedule()])
    rs = step_of(obs[1]).reqs[0]
    assert (rs.start, rs.end, rs.loaded) == (64, 100, 64)
    assert t.can_apply(FailLoad("r0", 2)) and not t.can_apply(FailLoad("r0", 4))
    t.apply(FailLoad("r0", 2))
    done = t.apply(Process())
    (p,) = items(done, ProcessObs)
    assert p.failed == (("r0", 2),) and p.discarded == ("r0",)
    assert done.counters.reqs["r0"].computed == 32
    assert done.counters.reqs["r0"].in_flight == 0
    # vLLM keeps the blocks and recomputes into them: nothing is freed
    assert not items(done, FreeObs)
    again = step_of(t.apply(Schedule())).reqs[0]
    assert (again.start, again.end, again.loaded) == (32, 100, 0)
    assert again.tables == rs.tables


def test_a_reset_frees_everything_and_resumes_at_once_dropping_the_stale_output():
    """reset_prefix_cache(reset_running_requests=True) preempts the running
    request with its in-flight output dropped (drop_stale_output): it may
    resume in the next step while the old one still runs."""
    cfg = config_for("sliding", window=16, block_size=16, depth=2,
                     max_num_batched_tokens=128)
    obs = run(FIXED, cfg, [AddRequest("r0", 40, 8), Schedule(), ResetPrefixCache()])
    table = step_of(obs[1]).reqs[0].tables[0]
    freed = items(obs[2], FreeObs)
    assert sorted(f.block for f in freed) == sorted(b for b in table if b != NULL)
    assert {f.reason for f in freed} == {"preempt"}
    rc = obs[2].counters.reqs["r0"]
    assert (rc.computed, rc.status, rc.live) == (0, "preempted", (0,))
    assert rc.in_flight == 40  # vLLM keeps counting the stale in-flight step
    t = target(FIXED)
    resumed = step_of(t.apply(Schedule())).reqs[0]
    assert resumed.start == 0 and resumed.end >= 40
    (p,) = items(t.apply(Process()), ProcessObs)
    assert p.discarded == ("r0",)  # the stale output is dropped


@pytest.mark.parametrize("version", [BUGGY, FIXED])
def test_a_reset_waits_for_room_in_the_batch_queue(version):
    """The engine takes a utility call between two steps of its loop, never
    with depth steps in flight; then every running request is preempted."""
    cfg = config_for("sliding", window=16, block_size=16, depth=2,
                     max_num_batched_tokens=32)
    run(version, cfg, [AddRequest("r0", 40, 8), Schedule(), Schedule()])
    t = target(version)
    assert not t.can_apply(ResetPrefixCache())
    t.apply(Process())
    done = t.apply(ResetPrefixCache())
    assert {f.reason for f in items(done, FreeObs)} == {"preempt"}
    assert done.counters.reqs["r0"].status == "preempted"


def test_an_empty_step_takes_a_slot_of_the_batch_queue():
    """The engine queues a step that schedules nothing like any other, and
    calls schedule() only while it has requests."""
    cfg = config_for("full", block_size=16, depth=2, max_num_batched_tokens=16)
    # r0's one output token is in flight after the first step: nothing to schedule
    obs = run(FIXED, cfg, [AddRequest("r0", 16, 1), Schedule(), Schedule()])
    empty = step_of(obs[2])
    assert empty.reqs == () and empty.step == step_of(obs[1]).step + 1
    t = target(FIXED)
    assert not t.can_apply(Schedule())
    t.apply(Process())  # r0's output: it finishes
    (p,) = items(t.apply(Process()), ProcessObs)
    assert p.step == empty.step and p.accepted == () and p.discarded == ()
    t.apply(Schedule())  # once more: the workers learn that r0 ended
    t.apply(Process())
    assert not t.can_apply(Schedule())


def test_blocks_in_the_deferred_free_queue_belong_to_no_live_request():
    """With a KV consumer at depth 2 a preempted request's blocks wait in vLLM's
    deferred-free queue; 0.25.1 re-admits it at once with new blocks. Its live
    count is the new table only (the old blocks are nobody's). The reset
    itself raises (its blocks are still held), and the engine goes on."""
    cfg = config_for("hybrid", window=1, block_size=4, num_blocks=20, depth=2,
                     hazard="unordered", max_num_batched_tokens=16, max_model_len=32)
    obs = run(BUGGY, cfg, [AddRequest("r0", 9, 4), Schedule(), ResetPrefixCache(),
                           Schedule()])
    assert not items(obs[2], FreeObs)  # deferred behind step 0
    assert obs[2].counters.reqs["r0"].live == (0, 0)
    again = step_of(obs[3]).reqs[0]
    assert again.start == 0
    assert obs[3].counters.reqs["r0"].live == tuple(
        sum(b != NULL for b in tab) for tab in again.tables)
    done = target(BUGGY).apply(Process())
    assert {f.reason for f in items(done, FreeObs)} == {"preempt"}
    assert done.counters.reqs["r0"].live == obs[3].counters.reqs["r0"].live


def test_no_vllm_call_preempts_one_chosen_request():
    cfg = config_for("full", block_size=16, depth=2)
    run(FIXED, cfg, [AddRequest("r0", 20, 4), Schedule()])
    t = target(FIXED)
    assert not t.can_apply(Preempt("r0"))
    with pytest.raises(Unsupported, match="no call that preempts one chosen request"):
        t.apply(Preempt("r0"))


@pytest.mark.parametrize("hazard", ["ordered", "unordered"])
def test_finish_and_abort_free_all_blocks(hazard):
    cfg = config_for("sliding", window=64, block_size=16, depth=2, hazard=hazard,
                     max_num_batched_tokens=128)
    t = target(FIXED)
    obs = run(FIXED, cfg, [AddRequest("r0", 40, 8), AddRequest("r1", 20, 8), Schedule(),
                           Finish("r0"), Abort("r1")])
    tables = {rs.rid: rs.tables[0] for rs in step_of(obs[2]).reqs}
    assert items(obs[3], FinishObs) == [FinishObs("r0", "finish")]
    assert items(obs[4], FinishObs) == [FinishObs("r1", "abort")]
    done = t.apply(Process())
    (p,) = items(done, ProcessObs)
    assert set(p.discarded) == {"r0", "r1"}
    frees = [f for o in (*obs[3:], done) for f in items(o, FreeObs)]
    assert sorted((f.rid, f.block, f.reason) for f in frees) == sorted(
        [("r0", b, "finish") for b in tables["r0"]] + [("r1", b, "abort") for b in tables["r1"]])
    if hazard == "unordered":
        # a KV-consumer connector: vLLM defers the frees until the step is processed
        assert not items(obs[3], FreeObs) and not items(obs[4], FreeObs)
        # waiting in the queue, the blocks are nobody's: r0 holds none in the
        # event it ends and is not listed after it
        assert obs[3].counters.reqs["r0"].live == (0,)
        assert "r0" not in obs[4].counters.reqs
    else:
        assert items(obs[3], FreeObs) and items(obs[4], FreeObs)
    assert done.counters.free_blocks == cfg.num_blocks - 1


def test_depth_1_holds_ends_until_the_step_ran():
    """The synchronous engine takes an abort that arrives while its step runs
    after the step, right before processing the output."""
    cfg = config_for("full", block_size=16, depth=1, hazard="unordered")
    t = target(FIXED)
    obs = run(FIXED, cfg, [AddRequest("r0", 20, 4), Schedule(), Abort("r0")])
    assert obs[2].items == []
    assert obs[2].counters.reqs["r0"].status == "running"
    done = t.apply(Process())
    kinds = [type(it).__name__ for it in done.items]
    assert kinds[0] == "ProcessObs" and kinds[1] == "FinishObs"
    assert done.items[0].discarded == ("r0",)
    assert {f.reason for f in items(done, FreeObs)} == {"abort"}
    assert done.counters.reqs["r0"].status == "finished"


def test_spec_rejection_rolls_the_count_back():
    cfg = config_for("sliding", window=16, block_size=4, depth=2, spec_tokens=3,
                     max_num_batched_tokens=64)
    t = target(FIXED)
    run(FIXED, cfg, [AddRequest("r0", 14, 10), Schedule(), Process()])
    s1 = step_of(t.apply(Schedule())).reqs[0]
    assert (s1.start, s1.end, s1.spec) == (14, 18, 3)
    s2 = step_of(t.apply(Schedule())).reqs[0]
    assert (s2.start, s2.end, s2.spec) == (18, 22, 3)
    rej = t.apply(Process({"r0": 1}))
    (p,) = items(rej, ProcessObs)
    assert p.accepted == (("r0", 1),) and not p.discarded
    rc = rej.counters.reqs["r0"]
    assert (rc.computed, rc.in_flight) == (22 - 2, 4)


def test_length_finish_at_max_new_tokens():
    cfg = config_for("full", block_size=16, depth=1, max_num_batched_tokens=64)
    obs = run(FIXED, cfg, [AddRequest("r0", 10, 2), Schedule(), Process(), Schedule(),
                           Process()])
    assert items(obs[2], FinishObs) == []
    assert items(obs[4], FinishObs) == [FinishObs("r0", "length")]
    assert [f.reason for f in items(obs[4], FreeObs)] == ["finish"]


def test_pool_pressure_preempts_the_last_request():
    cfg = config_for("full", block_size=4, num_blocks=9, depth=1, max_num_batched_tokens=64,
                     max_model_len=32)
    obs = run(FIXED, cfg, [AddRequest("r0", 12, 12), AddRequest("r1", 12, 12)]
              + [Schedule(), Process()] * 6)
    frees = [f for o in obs for f in items(o, FreeObs)]
    # 8 usable blocks; both requests need a 5th block at position 16: the
    # scheduler preempts the last-arrived request to make room for the first
    assert frees and {f.reason for f in frees} == {"preempt"} and {f.rid for f in frees} == {"r1"}
    # (each event lists what it may have changed: the fold holds every request's)
    live = LiveCounters()
    for o in obs:
        live.update(o.counters)
    assert live["r1"].status == "preempted"


# ----------------------------------------------------------- the adapter


def test_apply_many_equals_apply():
    from model.streams import Driver

    cfg = config_for("hybrid", window=8, block_size=4, depth=2, spec_tokens=2,
                     max_num_batched_tokens=32, num_blocks=40, max_model_len=32)
    t = target(FIXED)
    d = Driver(cfg, [t], 7, max_requests=20)
    d.run(60)
    assert len(d.events) == 60
    t.reset(cfg)
    assert t.apply_many(d.events) == d.obs[0][1:]


def test_unsupported_versions_and_events():
    with pytest.raises(TargetError, match="not supported"):
        make_target("vllm@0.24.0")
    # a folder that is not there, or a release number cut short, is bad input (exit 2)
    with pytest.raises(Unsupported, match="neither"):
        make_target("vllm@/nonexistent/checkout")
    with pytest.raises(Unsupported, match="not a release number"):
        make_target("vllm@0.33")
    t = target(FIXED)
    t.reset(config_for("sliding", window=16, block_size=16, hazard="ordered"))
    ev = AddRequest("r0", 40, 4, external_tokens=16)
    assert not t.can_apply(ev)
    with pytest.raises(Unsupported, match="hazard=unordered"):
        t.apply(ev)


def test_a_checkout_path_runs_its_own_tree():
    from impl.vllm import compat

    t = make_target(f"vllm@{compat.install_dir(FIXED)}")
    assert t.inst.version == FIXED and t.capabilities.fixed_policy == "settled"
    t.reset(config_for("sliding", window=16, block_size=16, depth=2,
                       max_num_batched_tokens=128))
    assert not items(t.apply_many(SEED)[2], FreeObs)
    t.close()


def test_a_dead_worker_is_a_crash_with_its_log_and_restarts():
    cfg = config_for("full", block_size=16, depth=1)
    t = target(FIXED)
    t.reset(cfg)
    t._w().proc.kill()
    t._w().proc.wait()
    with pytest.raises(TargetCrash, match="worker process died"):
        t.apply(AddRequest("r0", 10, 2))
    t.reset(cfg)  # a fresh worker
    assert items(t.apply_many([AddRequest("r0", 10, 2), Schedule()])[1], StepObs)


def test_a_session_dropped_during_a_call_goes_with_the_next_call():
    """A target's finalizer (a garbage collection in the middle of a call on
    the same worker) must not wait on the worker's lock, which that call
    holds: the drop is kept and sent before the worker's next call."""
    from impl.vllm import _drop_session

    cfg = config_for("full", block_size=16, depth=1)
    t = target(FIXED)
    t.reset(cfg)
    w = t._w()
    other = next(w.sessions)
    assert w.call("reset", other, cfg)[0] == "ok"
    with w.p.lock:  # a call under way
        _drop_session(w, other)  # returns at once
        assert w.pending_drops == [other]
    t.apply(AddRequest("r0", 10, 2))
    assert w.pending_drops == []
    # the dropped session's driver is gone: a fresh one, never reset, refuses
    # an event (a session still held would take it)
    assert w.call("apply", other, [Schedule()])[0] != "ok"
    _drop_session(w, other)


def test_install_script_is_a_no_op_when_installed_and_refuses_bad_versions():
    out = subprocess.run(["bash", "scripts/install-vllm.sh", FIXED], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "already installed" in out.stdout
    bad = subprocess.run(["bash", "scripts/install-vllm.sh", "0.20.0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------- Mamba layouts


def test_mamba_runs_in_align_mode_and_keeps_only_the_last_state_of_a_chunk():
    """With prefix caching vLLM builds block-sized Mamba states ("align"): a
    prefill chunk leaves NULL slots before the block of its last position, and
    a step reads only the state before it and the state it writes."""
    cfg = config_for("mamba", block_size=16, prefix_caching=True, spec_tokens=0,
                     max_num_batched_tokens=64, depth=2)
    obs = run(FIXED, cfg, [AddRequest("r0", 40, 4), Schedule()])
    s = step_of(obs[1])
    (rs,) = s.reqs
    # the chunk ends on a block edge (vLLM's _mamba_block_aligned_split)
    assert (rs.start, rs.end) == (0, 32)
    assert rs.tables[0][0] == NULL and rs.tables[0][1] != NULL
    assert list(read_blocks(cfg.groups[0], 0, 32, 16)) == [1]


@pytest.mark.parametrize("over,why", [({"prefix_caching": False}, "max_model_len")])
def test_mamba_layouts_vllm_does_not_build_are_refused(over, why):
    kw = dict(block_size=16, prefix_caching=True, spec_tokens=0, depth=2)
    kw.update(over)
    t = target(FIXED)
    with pytest.raises(Unsupported, match=why):
        t.reset(config_for("mamba", **kw))


def test_pinned_options_fill_what_is_drawn_and_refuse_what_contradicts():
    from impl.target import fit_spec
    from properties.machine import FuzzSpec

    caps = target(FIXED).capabilities
    spec = FuzzSpec(target="vllm@" + FIXED, kind="mamba", policy="settled")
    fit_spec("vllm", caps, spec)
    assert (spec.prefix_caching, spec.spec_tokens) == (True, None)
    spec = FuzzSpec(target="vllm@" + FIXED, kind="mamba", policy="settled",
                    prefix_caching=False)
    with pytest.raises(Unsupported, match="--prefix-caching on"):
        fit_spec("vllm", caps, spec)


def test_mamba_drafts_hold_a_state_block_each_and_relocation_is_a_move():
    """Align mode with two drafts: a step's table reaches two slots past its
    running state (num_speculative_blocks), and when a prefill chunk moves the
    running state two blocks on, the speculative block left behind moves to
    the end of the table (_relocate_speculative_block): a MoveObs, no
    reference dropped, and every property holds. The step reads the worker's
    table, which vLLM only appends to: it names the block at both slots."""
    from model.observations import MoveObs
    from properties.replay import replay

    cfg = config_for("mamba", block_size=16, prefix_caching=True, spec_tokens=2,
                     max_num_batched_tokens=48, depth=1, max_model_len=96)
    # r0 takes 32 of the budget, so r1's first chunk is one block; its second
    # chunk then moves its running state from slot 0 to slot 2
    evs = [AddRequest("r0", 40, 4), AddRequest("r1", 64, 4, variant=1), Schedule(),
           Process(), Schedule()]
    obs = run(FIXED, cfg, evs)
    first = {r.rid: r for r in step_of(obs[2]).reqs}["r1"]
    assert (first.start, first.end) == (0, 16) and len(first.tables[0]) == 1 + 2
    moves = [it for it in obs[4].items if isinstance(it, MoveObs)]
    assert [(m.rid, m.logical, m.to) for m in moves] == [("r1", 1, 3)]
    second = {r.rid: r for r in step_of(obs[4]).reqs}["r1"]
    assert (second.start, second.end) == (16, 48)
    assert second.tables[0][1] == second.tables[0][3] == first.tables[0][1] != NULL
    assert len(second.tables[0]) == 48 // 16 + 2
    assert replay(Trace(cfg, evs), "vllm@" + FIXED).first is None


@pytest.mark.parametrize("drafter,kept", [("ngram", False), ("mtp", True)])
def test_a_multi_module_mtp_drafter_makes_sliding_windows_retain_tokens(drafter, kept):
    """drafter=mtp (two MTP modules, two drafts): vLLM's planner gives the
    sliding window extra_retained_tokens = 1, so at a settled count of 32 a
    17-token window keeps block 0 (skipped 15), which it frees without."""
    cfg = config_for("sliding", window=17, block_size=16, spec_tokens=2, drafter=drafter,
                     max_num_batched_tokens=16, depth=1, max_model_len=96)
    assert cfg.groups[0].retained == (1 if kept else 0)
    obs = run(FIXED, cfg, [AddRequest("r0", 64, 2), Schedule(), Process(), Schedule(),
                           Process(), Schedule()])
    freed = [it.logical for it in obs[5].items if isinstance(it, FreeObs)]
    assert freed == ([] if kept else [0])


# ------------------------------------------------ layouts vLLM's planner builds


@pytest.mark.parametrize("version", [BUGGY, FIXED])
@pytest.mark.parametrize("kind,kw", [
    ("full", {}),
    ("sliding", {"window": 24}),
    ("chunked_local", {"chunk": 32}),
    ("hybrid", {"window": 5}),
])
def test_a_pool_too_small_for_one_request_is_refused_and_startup_blocks_is_enough(
        version, kind, kw):
    """vLLM's engine refuses to start when the pool cannot serve one request of
    max_model_len; the driver says so in one line, and the model's
    startup_blocks is a pool vLLM's planner accepts."""
    from dataclasses import replace

    from model.windows import startup_blocks

    cfg = config_for(kind, block_size=8, depth=2, max_num_batched_tokens=24,
                     max_model_len=96, num_blocks=4, **kw)
    t = target(version)
    with pytest.raises(Unsupported, match=r"refuses to start: 4 blocks cannot serve one "
                                          r"request of max_model_len 96.*num_blocks >= \d+"):
        t.reset(cfg)
    obs = t.reset(replace(cfg, num_blocks=startup_blocks(cfg)))
    assert obs.counters.free_blocks == startup_blocks(cfg) - 1


def test_groups_the_planner_merges_are_refused():
    """Two layers of one spec are one group in vLLM's plan: the checker's model
    needs its groups as configured, so the layout is refused, not misread."""
    cfg = Config(groups=(Group("sliding", 8), Group("sliding", 8)), block_size=8,
                 num_blocks=64, max_model_len=64)
    with pytest.raises(Unsupported, match="as groups"):
        target(FIXED).reset(cfg)


def test_mamba_beside_attention_shares_the_attention_page():
    """A hybrid model's config pads the Mamba page to the attention page, so
    vLLM's planner puts both groups in one pool of B-token blocks (0.25.1
    refuses unequal pages outright)."""
    for version in (BUGGY, FIXED):
        cfg = Config(groups=(Group("full"), Group("sliding", 8), Group("mamba")),
                     block_size=8, num_blocks=64, max_model_len=64, prefix_caching=True)
        obs = run(version, cfg, [AddRequest("r0", 20, 2), Schedule()])
        (rs,) = step_of(obs[1]).reqs
        assert [len(t) for t in rs.tables] == [rs.end // 8] * 3
        ids = [b for t in rs.tables for b in t if b != NULL]
        assert len(ids) == len(set(ids))  # one pool: no block in two groups


def test_a_hybrid_with_mamba_takes_drafts_in_the_layout_vllm_plans():
    """full + sliding + Mamba with two n-gram drafts (align mode): vLLM's
    planner keeps three groups in one pool (the Mamba page padded to the
    attention page), a decode's Mamba table reaches two state slots past its
    running one, and a rejection rolls the request back below the block edge
    whose state that decode wrote: the checker sees that and nothing wrong."""
    from properties.invariants import Checker

    cfg = Config(groups=(Group("full"), Group("sliding", 8), Group("mamba")), block_size=8,
                 num_blocks=64, max_model_len=64, prefix_caching=True, spec_tokens=2, depth=1,
                 max_num_batched_tokens=32)
    evs = [AddRequest("r0", 15, 6), Schedule(), Process(), Schedule(), Process(), Schedule(),
           Process(accepted={"r0": 0}), Schedule()]
    t = target(FIXED)
    checker = Checker(cfg)
    checker.feed(None, t.reset(cfg))
    obs = []
    for ev in evs:
        obs.append(t.apply(ev))
        checker.feed(ev, obs[-1])
    (decode,) = step_of(obs[5]).reqs
    assert (decode.start, decode.end, decode.spec) == (15, 18, 2)
    full, sliding, mamba = decode.tables
    assert len(full) == len(sliding) == 3 and len(mamba) == 17 // 8 + 1 + 2
    ids = [b for tb in decode.tables for b in tb if b != NULL]
    assert len(ids) == len(set(ids))  # one pool: no block in two groups
    (after,) = step_of(obs[7]).reqs
    assert after.start == 16  # 18 rolled back by the two rejected drafts
    assert checker.violations == []
    assert checker.witness["checkpoint_near_rejection"] == 1


# ------------------------------------------------------------------ EAGLE


@pytest.mark.parametrize("version,hazard,hit", [
    (FIXED, "ordered", 24),    # 0.33: lookahead hashes prove block 2's boundary token
    (FIXED, "unordered", 16),  # a connector keeps the legacy hashes: the last block drops
    (BUGGY, "ordered", 16),    # 0.25.1 always drops it
])
def test_an_eagle_prefix_hit_drops_its_last_block_unless_hashes_look_ahead(version, hazard, hit):
    """drafter=eagle builds vLLM's EAGLE config (a draft layer grouped with
    layer 0): a prefix hit on a 30-token prompt of B=8 keeps 3 full blocks,
    minus EAGLE's dropped block where the hashes do not cover the next token."""
    cfg = config_for("sliding", window=8, block_size=8, num_blocks=40, max_model_len=64,
                     spec_tokens=2, drafter="eagle", prefix_caching=True, hazard=hazard,
                     max_num_batched_tokens=32)
    obs = run(version, cfg, [AddRequest("r0", 30, 4), Schedule(), Process(),
                             AddRequest("r1", 30, 4), Schedule()])
    r1 = [r for r in step_of(obs[-1]).reqs if r.rid == "r1"]
    assert r1 and r1[0].start == hit


@pytest.mark.parametrize("drafter", ["eagle", "mtp"])
@pytest.mark.parametrize("groups", [
    (Group("mamba"), Group("full", draft=True)),
    (Group("full"), Group("full", draft=True), Group("sliding", 8), Group("mamba")),
])
def test_mamba_with_a_model_drafter_plans_the_draft_layer_as_a_group_of_its_own(drafter, groups):
    """Beside Mamba, vLLM's planner puts EAGLE's (MTP's) draft layer in a
    group of its own (an EAGLE group), after the first attention group; the
    config states it (draft: true), and its KV is the one keyed one token
    ahead. A decode with two drafts, rejected: the rejection rolls the Mamba
    request back below the block edge its step wrote, and nothing is wrong."""
    from properties.invariants import Checker

    cfg = Config(groups=groups, block_size=8, num_blocks=64, max_model_len=64,
                 prefix_caching=True, spec_tokens=2, depth=1, max_num_batched_tokens=32,
                 drafter=drafter)
    assert cfg.draft_group == 1
    t = target(FIXED)
    checker = Checker(cfg)
    checker.feed(None, t.reset(cfg))
    evs = [AddRequest("r0", 15, 6), Schedule(), Process(), Schedule(), Process(), Schedule(),
           Process(accepted={"r0": 0}), Schedule(), Process(), AddRequest("r1", 15, 6),
           Schedule()]
    obs = []
    for ev in evs:
        obs.append(t.apply(ev))
        checker.feed(ev, obs[-1])
    (decode,) = step_of(obs[5]).reqs
    assert (decode.start, decode.end, decode.spec) == (15, 18, 2)
    assert len(decode.tables[1]) == 3  # the draft group: a block per 8 positions
    mamba = next(i for i, g in enumerate(groups) if g.kind == "mamba")
    assert len(decode.tables[mamba]) == 17 // 8 + 1 + 2  # the running slot, one per draft
    hit = {r.rid: r for r in step_of(obs[-1]).reqs}["r1"]
    assert hit.start > 0  # r1 hits r0's blocks, the draft group's among them
    assert checker.violations == []
    assert checker.witness["checkpoint_near_rejection"] == 1


def test_the_content_rule_reads_the_draft_groups_keys_beside_mamba():
    """Finding 6 (EAGLE's hit drop with a connector) reached beside Mamba, where
    the draft layer has a group of its own: the stale read is judged in that
    group, by its KV keyed one token ahead."""
    from pathlib import Path

    from properties.replay import replay

    path = Path(__file__).parent.parent / "traces/vllm/eagle-hit-drop-beside-mamba-0.33.0.json"
    trace = Trace.load(path)
    assert [g.draft for g in trace.config.groups] == [False, True]
    v = replay(trace, "vllm@" + FIXED).first
    assert v is not None and v.prop == 2
    assert "(full(draft))" in v.message and "its EAGLE draft KV" in v.message
    assert v.message == trace.meta["violation"].split(": ", 1)[1]


def test_a_draft_group_vllm_plans_elsewhere_is_refused():
    cfg = Config(groups=(Group("full"), Group("mamba"), Group("full", draft=True)),
                 block_size=8, num_blocks=64, max_model_len=64, prefix_caching=True,
                 spec_tokens=2, drafter="eagle", max_num_batched_tokens=32)
    with pytest.raises(Unsupported, match="as groups"):
        target(FIXED).reset(cfg)


def test_the_reference_refuses_an_eagle_drafter():
    ref = make_target("reference")
    with pytest.raises(Unsupported, match="drafter eagle"):
        ref.reset(config_for("sliding", spec_tokens=2, drafter="eagle"))


# ------------------------------------------- managers that never free early


@pytest.mark.parametrize("kind,held", [("ring", 1), ("cross", 3)])
def test_ring_and_cross_hold_their_blocks_until_the_request_ends(kind, held):
    """vLLM's CircularBufferManager claims one ring block, its
    CrossAttentionManager cdiv(E, B) blocks for the encoder's outputs (E = 40,
    B = 16), at the first schedule; decoding far past them frees none, and
    the request's end returns them all."""
    cfg = config_for(kind, block_size=16, depth=2, max_num_batched_tokens=128,
                     max_model_len=128, num_blocks=40, encoder_len=40)
    evs = [AddRequest("r0", 20, 60), Schedule()]
    for _ in range(35):
        evs += [Schedule(), Process()]
    obs = run(FIXED, cfg, evs)
    steps = [step_of(o) for o in obs if items(o, StepObs)]
    first = steps[0].reqs[0].tables[1]
    assert len(first) == held and NULL not in first
    assert steps[-1].reqs[0].start > 48  # well past three blocks of tokens
    assert all(s.reqs[0].tables[1] == first for s in steps)
    assert not [f for o in obs for f in items(o, FreeObs) if f.group == 1]
    t = target(FIXED)
    end = t.apply(Finish("r0"))
    end = t.apply(Process())
    assert end.counters.free_blocks == cfg.num_blocks - 1


def test_cross_attention_configs_vllm_does_not_build_are_refused():
    t = target(FIXED)
    with pytest.raises(Unsupported, match="without KV connectors"):
        t.reset(config_for("cross", block_size=16, depth=2, hazard="unordered",
                           max_num_batched_tokens=128, max_model_len=128, num_blocks=40))
    with pytest.raises(Unsupported, match="max_num_batched_tokens"):
        t.reset(config_for("cross", block_size=16, depth=2, max_num_batched_tokens=64,
                           max_model_len=128, num_blocks=40))


def test_a_series_of_diffs_applies_in_turn(tmp_path, monkeypatch):
    """``RELEASE+A.diff+B.diff``: a diff written on top of A applies to the tree
    A left; a diff of the release is merged into it (three-way, the release
    the base), so fixes of one file compose; changes to the same lines are
    refused with both names."""
    from impl.vllm import compat, overlay

    assert overlay.series("a.diff+b+c.patch+d.diff") == ["a.diff", "b+c.patch", "d.diff"]
    pool = "vllm/v1/core/block_pool.py"
    lines = (compat.install_dir(FIXED) / pool).read_text().splitlines()
    top, n = lines[0], len(lines)

    def diff(name: str, body: str):
        (tmp_path / name).write_text(f"--- a/{pool}\n+++ b/{pool}\n{body}")
        return tmp_path / name

    a = diff("a.diff", f"@@ -1,1 +1,2 @@\n {top}\n+# first\n")
    on_a = diff("b.diff", f"@@ -1,2 +1,3 @@\n {top}\n # first\n+# second\n")
    end = diff("e.diff", f"@@ -{n},1 +{n},2 @@\n {lines[-1]}\n+# last\n")
    monkeypatch.setattr(compat, "REPO", tmp_path)
    tree = overlay.overlay_tree(FIXED, [a, on_a])
    text = (tree / pool).read_text()
    assert text.startswith(f"{top}\n# first\n# second\n") and "-a-b-" in tree.name
    assert (tree / "vllm" / "v1" / "request.py").is_symlink()
    both = (overlay.overlay_tree(FIXED, [a, end]) / pool).read_text().splitlines()
    assert both[:2] == [top, "# first"] and both[-1] == "# last" and len(both) == n + 2
    c = diff("c.diff", f"@@ -1,1 +1,1 @@\n-{top}\n+# c\n")
    d = diff("d.diff", f"@@ -1,1 +1,1 @@\n-{top}\n+# d\n")
    with pytest.raises(Unsupported, match=r"d.diff changes lines of .*block_pool.py that "
                                          r"the diffs before it change too \(after c.diff\)"):
        overlay.overlay_tree(FIXED, [c, d])
    assert not list((tmp_path / ".vllm" / "trees").glob("*tmp*"))  # nothing half-built left


def test_overlay_tree_replaces_a_stale_tree(tmp_path, monkeypatch):
    """A fix's tree links the release's real files (not a path through the
    checkout that built it), and a tree whose links lead into a folder that is
    gone is built again rather than run."""
    from impl.vllm import compat, overlay

    diff = tmp_path / "fix.diff"
    diff.write_text("--- a/vllm/v1/core/block_pool.py\n+++ b/vllm/v1/core/block_pool.py\n"
                    "@@ -1,0 +1,1 @@\n+# a fix\n")
    monkeypatch.setattr(compat, "REPO", tmp_path)
    digest = overlay.hashlib.sha256(diff.read_text().encode()).hexdigest()[:12]
    stale = tmp_path / ".vllm" / "trees" / f"{FIXED}-fix-{digest}" / "vllm"
    stale.mkdir(parents=True)
    (stale / "__init__.py").symlink_to(tmp_path / "gone" / "__init__.py")
    tree = overlay.overlay_tree(FIXED, diff)
    assert tree == stale.parent and (tree / "vllm" / "__init__.py").is_file()
    link = (tree / "vllm" / "__init__.py").readlink()
    assert link.is_absolute() and link == link.resolve()
    patched = tree / "vllm" / "v1" / "core" / "block_pool.py"
    assert not patched.is_symlink() and "\n# a fix\n" in patched.read_text()
    assert [p.name for p in tree.parent.iterdir()] == [tree.name]  # the stale copy is gone
