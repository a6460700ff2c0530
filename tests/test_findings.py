"""The findings under findings/ stay true on the real vLLM, and the reference
manager (the correct model) passes them. If vLLM fixes one, its test fails:
move the finding to a fixed section then.

A finding's ``meta`` says where it shows (``target``: a release, or a release
with a diff from findings/fixes/ applied; default vllm@0.33.0), what it shows
(``expect``: text of the violation, property ``prop``, default 2; or
``crash``: text of the target's crash, on ``also_on`` releases too), and, with
``fixed_by``, the diff under which the same trace passes."""

import re
from pathlib import Path

import pytest

from gate.known import finding_traces, fix_files, in_repo, trace_path
from impl.target import TargetCrash, make_target
from model.events import Schedule, Trace
from properties.replay import InvalidEvent, replay

ROOT = Path(__file__).resolve().parent.parent
FINDINGS = finding_traces()


def _target(spec: str) -> str:
    """A target named in a finding, its diffs' paths taken from the repository."""
    return in_repo(spec) if "@" in spec else in_repo(f"vllm@{spec}").removeprefix("vllm@")


def _run(path: Path, target: str):
    try:
        return replay(Trace.load(path), _target(target)), None
    except TargetCrash as e:
        return None, str(e)


def test_findings_exist():
    assert FINDINGS, "findings/ holds no trace"
    for path in FINDINGS:
        meta = Trace.load(path).meta
        assert ("expect" in meta) != ("crash" in meta), path.name
        if "fixed_by" in meta:
            assert all(p.is_file() for p in fix_files(meta["fixed_by"])), meta["fixed_by"]


@pytest.mark.vllm
@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_finding_reproduces_on_vllm(path):
    meta = Trace.load(path).meta
    rr, crash = _run(path, meta.get("target", "vllm@0.33.0"))
    if "crash" in meta:
        for target in [meta.get("target", "vllm@0.33.0"), *meta.get("also_on", [])]:
            rr, crash = _run(path, target)
            crash = crash or (rr.crash if rr else None)
            assert crash is not None and meta["crash"] in crash, (target, crash)
        return
    for target in meta.get("also_on", []):  # the same violation on the releases it names
        more, crash = _run(path, target)
        assert crash is None and more.crash is None, (target, crash or more.crash)
        assert more.first is not None and more.first.prop == meta.get("prop", 2), target
        assert meta["expect"] in more.first.message, (target, more.first.message)
    assert crash is None and rr.crash is None, crash or rr.crash
    assert rr.first is not None and rr.first.prop == meta.get("prop", 2), rr.first
    assert meta["expect"] in rr.first.message, rr.first.message


@pytest.mark.vllm
@pytest.mark.parametrize("path", [p for p in FINDINGS if "fixed_by" in Trace.load(p).meta],
                         ids=lambda p: p.stem)
def test_finding_passes_with_its_fix(path):
    meta = Trace.load(path).meta
    release = meta.get("target", "vllm@0.33.0").partition("+")[0]
    rr, crash = _run(path, f"{release}+{meta['fixed_by']}")
    assert crash is None and rr.crash is None, crash or rr.crash
    assert rr.first is None, rr.first


# the reference schedules n-gram drafts only (an EAGLE finding's config is vLLM's)
@pytest.mark.parametrize("path", [p for p in FINDINGS
                                  if Trace.load(p).config.drafter == "ngram"],
                         ids=lambda p: p.stem)
def test_reference_recovers_correctly(path):
    t = Trace.load(path)
    if "reference_refuses" in t.meta:  # the reference schedules it otherwise: said so
        with pytest.raises(InvalidEvent, match=re.escape(t.meta["reference_refuses"])):
            replay(t, "reference")
        return
    rr = replay(t, "reference")
    assert rr.first is None, rr.first


# vLLM's default kv_load_failure_policy="fail": the request whose load failed
# ends with FINISHED_ERROR and nothing else is harmed (property 2: no one reads
# its blocks; 3: accounting holds), on vLLM and on the reference
FAIL_POLICY = [p for p in FINDINGS if p.stem.startswith("failed-load-")
               and "hybrid" not in p.stem and "fail-policy" not in p.stem
               and "downstream" not in p.stem
               and "+" not in Trace.load(p).meta.get("target", "")]


def _fail_policy(path: Path) -> Trace:
    from dataclasses import replace

    t = Trace.load(path)
    events, failed = [], set()
    for ev in t.events:  # up to the first event about a request that has ended
        if getattr(ev, "id", None) in failed and type(ev).__name__ != "FailLoad":
            break
        if type(ev).__name__ == "FailLoad":
            failed.add(ev.id)
        events.append(ev)
    events.append(Schedule())  # what the others do next reads none of its blocks
    # in the engine's order under "fail": no schedule() once nothing is left
    # to schedule (the failed request ended), none with the batch queue full
    cfg = replace(t.config, kv_load_failure_policy="fail")
    ref = make_target("reference")
    ref.reset(cfg)
    kept = []
    for ev in events:
        if ref.can_apply(ev):
            ref.apply(ev)
            kept.append(ev)
        elif type(ev).__name__ != "Schedule":
            break
    return Trace(cfg, kept, {})


def _errors(rr) -> set[str]:
    from model.observations import FinishObs

    return {i.rid for row in rr.rows for i in row.obs.items
            if isinstance(i, FinishObs) and i.reason == "error"}


@pytest.mark.vllm
@pytest.mark.parametrize("path", FAIL_POLICY, ids=lambda p: p.stem)
def test_fail_policy_ends_the_request_and_harms_nothing(path):
    trace = _fail_policy(path)
    failed = {ev.id for ev in trace.events if type(ev).__name__ == "FailLoad"}
    for target in ("vllm@0.33.0", "reference"):
        rr = replay(trace, target)
        assert rr.crash is None and rr.first is None, (target, rr.crash or rr.first)
        # every request whose load failed ends with an error (a sharer of its bad
        # blocks may too: vLLM fails every holder of an invalid block)
        assert failed <= _errors(rr), (target, _errors(rr))


def test_fail_policy_is_validated_and_saved_only_when_set(tmp_path):
    from model.events import TraceError

    t = _fail_policy(FAIL_POLICY[0])
    assert t.config.to_json()["kv_load_failure_policy"] == "fail"
    assert "kv_load_failure_policy" not in Trace.load(FAIL_POLICY[0]).config.to_json()
    d = t.to_json()
    d["config"]["kv_load_failure_policy"] = "retry"
    with pytest.raises(TraceError, match="kv_load_failure_policy"):
        Trace.from_json(d)


# Finding 8: a failed load on several KV-cache groups ends the releases' engine,
# so the vLLM target offers FailLoad on hybrids only where its tree survives it,
# decided by running the finding's shape on that tree (not from the spec's name)
@pytest.mark.vllm
def test_failed_loads_on_hybrids_only_where_the_tree_survives_them():
    from impl.vllm import VllmTarget

    crash = Trace.load(trace_path("failed-load-hybrid-crashes-0.33.0"))
    fixed = _target(f"0.33.0+{crash.meta['fixed_by']}")
    for spec, survives in (("0.33.0", False), (fixed, True)):
        t = VllmTarget(spec)
        try:
            assert t.hybrid_failed_loads() is survives, spec
            t.reset(crash.config)
            t.apply_many(list(crash.events[:2]))  # r0's load in flight
            assert t.can_apply(crash.events[2]) is survives, spec
        finally:
            t.close()
    # the same tree under another name: the same answer
    from impl.vllm import resolve

    tree = resolve(fixed).path[0]
    assert VllmTarget(str(tree)).hybrid_failed_loads() is True


# ... and only there does Mamba join the hybrids the fuzzer draws with
# connector loads: on the fixed tree it draws failed loads beside Mamba
@pytest.mark.vllm
def test_mamba_joins_hybrids_with_loads_only_where_the_tree_survives_them():
    from properties.machine import FuzzSpec, fuzz

    crash = Trace.load(trace_path("failed-load-hybrid-crashes-0.33.0"))
    fixed = _target(f"0.33.0+{crash.meta['fixed_by']}")
    for spec, survives in (("0.33.0", False), (fixed, True)):
        fs = FuzzSpec(target=f"vllm@{spec}", kind="hybrid", hazard="unordered",
                      prefix_caching=True, depth=2, spec_tokens=0)
        res = fuzz(fs, examples=40, seed=3)
        assert fs.mamba_loads is survives, spec
        mamba = sum(n for mix, n in res.stats.layouts.items() if "mamba" in mix)
        assert (mamba > 0) is survives, (spec, res.stats.layouts)
    assert res.violation is None and res.crash is None, res.violation or res.crash
    assert res.stats.events["FailLoad"] > 0


# On finding 8's fixed tree: a request whose load failed and that restarts as
# preempted parts the depth-1 twin (the reference recomputes into its blocks);
# under "fail" a request that ends lets go of its skipped Mamba state first
# (vLLM's finish path, on its own count), which is its end, not a window free
@pytest.mark.vllm
def test_hybrid_fix_restart_parts_the_twin_and_a_failed_end_frees_as_an_end():
    from model.observations import FinishObs, FreeObs

    trace = Trace.load(ROOT / "traces" / "vllm" /
                       "failed-load-hybrid-restart-parts-twin-hybrid-fix.json")
    rr = replay(trace, _target(trace.meta["target"]))
    assert rr.crash is None and rr.first is None, rr.crash or rr.first
    assert rr.witness.get("twin_parted") == 1 and rr.witness.get("twin_compared", 0) > 0
    trace = Trace.load(ROOT / "traces" / "vllm" /
                       "failed-load-fail-policy-mamba-window-free-at-end-hybrid-fix.json")
    rr = replay(trace, _target(trace.meta["target"]))
    assert rr.crash is None and rr.first is None, rr.crash or rr.first
    (end,) = [row.obs for row in rr.rows
              if any(isinstance(i, FinishObs) and i.reason == "error" for i in row.obs.items)]
    frees = [(i.group, i.reason) for i in end.items if isinstance(i, FreeObs)]
    assert (1, "window") in frees and (1, "failed_load") in frees, frees


# Finding 10: the chosen fix moves no speculative Mamba block in a decode (the
# worker's append-only row would still name it at its old slot) and still moves
# them at a prefill chunk boundary, where no draft is in flight (what vLLM's
# relocation saves); on the tree with the failed-load fixes too
F10 = ("mamba-align-relocated-block-written-twice",
       "mamba-align-relocated-block-checkpoint-overwritten")
F10_LOADS = ("findings/fixes/mamba-align-relocates-only-between-prefill-chunks-and-load-recovery"
             ".diff")
# the options judged beside it (findings/README.md): no relocation at all, and
# relocation below the slot the step reaches without its drafts
F10_OTHERS = ("findings/fixes/mamba-align-keeps-speculative-blocks.diff",
              "findings/fixes/mamba-align-relocates-below-draft-free-slot.diff")


@pytest.mark.vllm
def test_relocation_fix_moves_speculative_blocks_only_between_prefill_chunks():
    for stem in F10:
        trace = Trace.load(trace_path(stem))
        rr = replay(trace, "vllm@0.33.0")
        assert rr.first is not None and rr.witness.get("state_block_moved", 0) > 0, stem
        for fix in (trace.meta["fixed_by"], F10_LOADS, *F10_OTHERS):
            rr = replay(trace, _target(f"vllm@0.33.0+{fix}"))
            assert rr.crash is None and rr.first is None, (stem, fix, rr.crash or rr.first)
            assert not rr.witness.get("state_block_moved"), (stem, fix)
    chunked = Trace.from_json({  # two drafts, a 28-token prompt in chunks of 16 and 12
        "version": 1,
        "config": {"groups": [{"kind": "mamba"}], "block_size": 4, "num_blocks": 16,
                   "max_num_batched_tokens": 16, "max_num_seqs": 4, "max_model_len": 40,
                   "spec_tokens": 2, "depth": 2, "policy": "settled", "hazard": "ordered",
                   "prefix_caching": True},
        "events": [{"type": "AddRequest", "id": "r0", "prompt_len": 28, "max_new_tokens": 4,
                    "external_tokens": 0},
                   {"type": "Schedule"}, {"type": "Schedule"}, {"type": "Process", "accepted": {}},
                   {"type": "Schedule"}, {"type": "Process", "accepted": {}},
                   {"type": "Process", "accepted": {}}]})
    fix = Trace.load(trace_path(F10[0])).meta["fixed_by"]
    for target in ("vllm@0.33.0", f"vllm@0.33.0+{fix}"):
        rr = replay(chunked, _target(target))
        assert rr.crash is None and rr.first is None, (target, rr.crash or rr.first)
        assert rr.witness.get("state_block_moved") == 1, (target, rr.witness)
    # the combined tree keeps finding 8's first hybrid recovery (a failed load on a
    # hybrid survives); the chosen fix evicts copied states too
    crash = Trace.load(trace_path("failed-load-hybrid-crashes-0.33.0"))
    rr, err = _run(trace_path("failed-load-hybrid-crashes-0.33.0"),
                   f"vllm@0.33.0+{F10_LOADS}")
    assert err is None and rr.crash is None and rr.first is None, err or rr.crash or rr.first
    assert crash.meta["fixed_by"] == "findings/08-failed-load-hybrid-ends-engine/fix.diff"


# Finding 7 on a chunked-local group: its lookup indexes the hashes as the
# sliding one does, and the finding's fix bounds both scans
@pytest.mark.vllm
def test_finding_7_chunked_local_crashes_and_its_fix_bounds_both_lookups():
    trace = Trace.load(ROOT / "traces" / "vllm" / "chunked-mtp-hit-lookup-past-hashes-0.33.0.json")
    rr, crash = _run(ROOT / "traces" / "vllm" / "chunked-mtp-hit-lookup-past-hashes-0.33.0.json",
                     "vllm@0.33.0")
    crash = crash or (rr.crash if rr else None)
    assert crash and "IndexError" in crash and "block_hashes[i]" in crash, crash
    rr = replay(trace, in_repo(f"vllm@0.33.0+{trace.meta['fixed_by']}"))
    assert rr.crash is None and rr.first is None, rr.crash or rr.first
