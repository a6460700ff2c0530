"""The attention replay: numerical confirmation that no step reads NULL or
overwritten KV (confirm/attention.py).

Two layers of tests:

* the execution model on hand-built observation streams (no target needed):
  depth ordering, the unordered writer, rejection shifts, prefix-cache hits,
  failed loads, bf16, device choice, vLLM's kernel call (emulated on CPU);
* the fixed traces of traces/attention/ replayed on the reference target:
  counterexamples garble or read NaN at the step the checker names, the same
  events under the settled policy stay exact.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from confirm.attention import (
    AttentionReplay,
    format_report,
    replay_attention,
    run_observations,
)
from confirm.attention_kernels import (
    Shape,
    VllmKernel,
    kv_true,
    load_vllm_kernel,
    pick_device,
)
from gate.known import trace_path, with_fix
from model.events import Config, Group, Trace, sliding
from model.observations import AllocObs, FreeObs, ProcessObs, ReqStep, StepObs
from tests.vllm_targets import vllm_target

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces" / "attention"
FP32_TOL = 1e-5


# ----------------------------------------------------------- hand-built streams


def _step(step, rid, a, b, *tables, spec=0, loaded=0):
    return StepObs(step, (ReqStep(rid, a, b, spec, loaded, tuple(tuple(t) for t in tables)),))


def _allocs(rid, blocks, first_logical=0, group=0, cached=False):
    return [AllocObs(b, group, rid, first_logical + i, cached) for i, b in enumerate(blocks)]


def _swa_stream(policy: str):
    """sliding W=16, B=16, budget 64, depth 2: r0 (prompt 100) prefill in two
    steps, the second scheduled before the first is processed. Optimistic
    frees logical 0-2 (blocks 1-3) at the second schedule: step 0 still
    reads them."""
    first = [*_allocs("r0", [1, 2, 3, 4]), _step(0, "r0", 0, 64, [1, 2, 3, 4])]
    if policy == "optimistic":
        second = [FreeObs(b, 0, "r0", b - 1, "window") for b in (1, 2, 3)]
        table = [0, 0, 0, 4, 5, 6, 7]
    else:
        second, table = [], [1, 2, 3, 4, 5, 6, 7]
    second += [*_allocs("r0", [5, 6, 7], 4), _step(1, "r0", 64, 100, table)]
    return [[], first, second, [ProcessObs(0)], [ProcessObs(1)]]


def _spec_stream(policy: str):
    """sliding W=16, spec 2, depth 2: step 1 computes [29, 32) (2 drafts);
    step 2 is scheduled on the optimistic count 32, which frees logical 0.
    Step 1 rejects both drafts: step 2 moves down to [30, 33) and position 30
    reads [15, 30], i.e. logical 0: NULL."""
    third = [FreeObs(1, 0, "r0", 0, "window")] if policy == "optimistic" else []
    third += [*_allocs("r0", [3], 2),
              _step(2, "r0", 32, 35, [0 if policy == "optimistic" else 1, 2, 3], spec=2)]
    return [[], [*_allocs("r0", [1, 2]), _step(0, "r0", 0, 29, [1, 2])], [ProcessObs(0)],
            [_step(1, "r0", 29, 32, [1, 2], spec=2)], third,
            [ProcessObs(1, (("r0", 0),))], [ProcessObs(2, (("r0", 2),))]]


def _cfg(**kw) -> Config:
    base = dict(block_size=16, num_blocks=64, max_num_batched_tokens=64, depth=2)
    base.update(kw)
    return sliding(16, **base)


@pytest.mark.parametrize("hazard", ["unordered", "ordered"])
def test_hand_optimistic_free_garbles_only_under_unordered_writer(hazard):
    rep = run_observations(_cfg(policy="optimistic", hazard=hazard), {"r0": 100},
                           _swa_stream("optimistic"), device="cpu")
    if hazard == "unordered":
        assert not rep.ok
        assert rep.first_bad.step == 0 and rep.first_bad.kind == "garbled"
        assert rep.max_err > 1.0  # a foreign block, not rounding
        assert rep.foreign_writes == 3
        assert [r.verdict for r in rep.rows] == ["garbled", "ok"]
    else:
        # stream order: the later step's writes land after step 0 ran
        assert rep.ok and rep.max_err <= FP32_TOL


def test_hand_settled_is_exact_under_unordered_writer():
    rep = run_observations(_cfg(policy="settled", hazard="unordered"), {"r0": 100},
                           _swa_stream("settled"), device="cpu")
    assert rep.ok and rep.max_err <= FP32_TOL and rep.nan_reads == 0
    assert rep.positions == 100


def test_hand_rejection_shift_reads_null():
    rep = run_observations(_cfg(policy="optimistic", spec_tokens=2), {"r0": 29},
                           _spec_stream("optimistic"), device="cpu")
    fb = rep.first_bad
    assert (fb.step, fb.rid, fb.position, fb.kind) == (2, "r0", 30, "nan")
    row = rep.rows[-1]
    assert row.positions == (30, 33) and "shifted -2" in row.note
    ok = run_observations(_cfg(policy="settled", spec_tokens=2), {"r0": 29},
                          _spec_stream("settled"), device="cpu")
    assert ok.ok and ok.max_err <= FP32_TOL and ok.nan_reads == 0
    # the rejected drafts were rewritten by step 2 before anyone read them
    assert ok.rows[1].positions == (29, 30)


def test_hand_null_read_of_a_discarded_output_is_shown_not_judged():
    """The rejection shifts step 2 onto NULL, then r0 is preempted: step 2 still
    runs and reads NaN, but nobody uses its output."""
    evs = _spec_stream("optimistic")
    evs.insert(6, [FreeObs(b, 0, "r0", lg, "preempt") for b, lg in ((3, 2), (2, 1))])
    evs[-1] = [ProcessObs(2, discarded=("r0",))]
    rep = run_observations(_cfg(policy="optimistic", spec_tokens=2), {"r0": 29}, evs,
                           device="cpu")
    assert rep.ok and rep.nan_reads == 0 and rep.discarded_bad == 1
    last = rep.rows[-1]
    assert last.verdict == "discarded" and last.nan_reads == 1
    assert "preempt" in last.note and "shifted -2" in last.note and "read NaN" in last.note
    assert "not judged" in format_report(rep)


def test_hand_stale_draft_is_garbled_when_not_rewritten():
    """A manager that forgot to roll back after a rejection schedules [32, 35)
    although 30 and 31 were rejected: position 32 reads the rejected drafts'
    K/V (junk of the right scale, not NaN)."""
    evs = [[], [*_allocs("r0", [1, 2]), _step(0, "r0", 0, 29, [1, 2])], [ProcessObs(0)],
           [_step(1, "r0", 29, 32, [1, 2], spec=2)], [ProcessObs(1, (("r0", 0),))],
           [*_allocs("r0", [3], 2), _step(2, "r0", 32, 33, [1, 2, 3])], [ProcessObs(2)]]
    rep = run_observations(_cfg(spec_tokens=2), {"r0": 29}, evs, device="cpu")
    fb = rep.first_bad
    assert (fb.step, fb.position, fb.kind) == (2, 32, "garbled")
    assert rep.nan_reads == 0


def test_hand_discarded_outputs_are_not_checked_but_still_write():
    # r0 preempted while step 1 is in flight: step 1's output is discarded
    evs = _swa_stream("settled")
    evs.insert(3, [FreeObs(b, 0, "r0", b - 1, "preempt") for b in range(1, 8)])
    rep = run_observations(_cfg(hazard="ordered"), {"r0": 100}, evs, device="cpu")
    assert [r.verdict for r in rep.rows] == ["discarded", "discarded"]
    assert rep.ok
    # under the unordered writer the preempt is a hazard, but nobody reads
    rep = run_observations(_cfg(hazard="unordered"), {"r0": 100}, evs, device="cpu")
    assert rep.ok and rep.foreign_writes == 7


def test_hand_restart_after_preemption_is_checked():
    """vLLM 0.25.1 resumes a preempted request at once: its old step's output
    is discarded, the restart's step (scheduled while the old one is still in
    flight) is checked."""
    evs = [[], [*_allocs("r0", [1, 2, 3, 4]), _step(0, "r0", 0, 64, [1, 2, 3, 4])],
           [FreeObs(b, 0, "r0", b - 1, "preempt") for b in (4, 3, 2, 1)],
           [*_allocs("r0", [5, 6, 7, 8]), _step(1, "r0", 0, 64, [5, 6, 7, 8])],
           [ProcessObs(0, discarded=("r0",))], [ProcessObs(1, (("r0", 0),))]]
    rep = run_observations(_cfg(hazard="unordered"), {"r0": 100}, evs, device="cpu")
    assert [r.verdict for r in rep.rows] == ["discarded", "ok"]
    assert rep.ok and rep.positions == 64


def _load_stream():
    """r0 (prompt 30) decodes position 30 in step 1 (window [15, 30]: logical 0
    and 1). Step 2 is scheduled on the optimistic count 31, frees r0's logical
    0 (block 1) and hands block 1 to r1 at once, as r1's logical 1; r1's
    connector loads its prompt positions [0, 32) into blocks 8 and 1."""
    return [[], [*_allocs("r0", [1, 2]), _step(0, "r0", 0, 30, [1, 2])], [ProcessObs(0)],
            [_step(1, "r0", 30, 31, [1, 2])],
            [FreeObs(1, 0, "r0", 0, "window"), *_allocs("r1", [8, 1]), *_allocs("r1", [9], 2),
             StepObs(2, (ReqStep("r0", 31, 32, 0, 0, ((0, 2),)),
                         ReqStep("r1", 32, 40, 0, 32, ((8, 1, 9),))))],
            [ProcessObs(1)], [ProcessObs(2)]]


@pytest.mark.parametrize("hazard", ["unordered", "ordered"])
def test_hand_connector_load_into_a_block_a_pending_step_reads(hazard):
    rep = run_observations(_cfg(policy="optimistic", hazard=hazard), {"r0": 30, "r1": 40},
                           _load_stream(), device="cpu")
    by = {(r.step, r.request): r.verdict for r in rep.rows}
    if hazard == "unordered":
        # the load lands before step 1 runs: position 30 reads r1's position 31 at slot 15
        assert (rep.first_bad.step, rep.first_bad.position) == (1, 30)
        assert rep.first_bad.kind == "garbled"
    else:
        assert rep.ok
    assert by[(2, "r1")] == "ok" and by[(2, "r0")] == "ok"


def test_hand_pending_decode_reads_a_block_freed_after_it_was_scheduled():
    """Step 1 decodes position 30 (window [15, 30], block 1 slot 15, written by
    step 0). Step 2, scheduled on the optimistic count 31, returns block 1 to
    the pool: the unordered writer fills it before step 1 reads it."""
    evs = list(_load_stream())
    evs[4] = [FreeObs(1, 0, "r0", 0, "window"), _step(2, "r0", 31, 32, [0, 2])]
    rep = run_observations(_cfg(policy="optimistic", hazard="unordered"), {"r0": 30}, evs,
                           device="cpu")
    assert (rep.first_bad.step, rep.first_bad.position, rep.first_bad.kind) == (1, 30, "garbled")
    assert rep.foreign_writes == 1
    assert [r.verdict for r in rep.rows] == ["ok", "garbled", "ok"]


def test_hand_prefix_hit_reads_other_requests_prompt_kv():
    """Prompt K/V depends on the position only: r1 reading r0's cached
    block 1 (positions 0-15) is exact, also after r0 let it go."""
    cfg = _cfg(hazard="unordered", prefix_caching=True)
    evs = [[], [*_allocs("r0", [1, 2]), _step(0, "r0", 0, 20, [1, 2])], [ProcessObs(0)],
           [FreeObs(1, 0, "r0", 0, "finish"), FreeObs(2, 0, "r0", 1, "finish")],
           [*_allocs("r1", [1], cached=True), *_allocs("r1", [3], 1),
            _step(1, "r1", 16, 24, [1, 3])], [ProcessObs(1)]]
    rep = run_observations(cfg, {"r0": 20, "r1": 24}, evs, device="cpu")
    assert rep.ok and rep.max_err <= FP32_TOL
    assert rep.foreign_writes == 1  # block 2 only: block 1 was hit again from the cache


def test_hand_failed_load_leaves_junk_and_discards():
    cfg = _cfg(hazard="ordered")
    evs = [[], [*_allocs("r0", [1, 2, 3]), _step(0, "r0", 40, 41, [1, 2, 3], loaded=40)],
           [ProcessObs(0, failed=(("r0", 1),)),
            FreeObs(2, 0, "r0", 1, "failed_load"), FreeObs(3, 0, "r0", 2, "failed_load")],
           [*_allocs("r0", [4, 5], 1), _step(1, "r0", 16, 48, [1, 4, 5])], [ProcessObs(1)]]
    rep = run_observations(cfg, {"r0": 48}, evs, device="cpu")
    assert [r.verdict for r in rep.rows] == ["discarded", "ok"]
    assert rep.ok
    # had the recompute not been scheduled, a reader of the failed range is garbled
    evs[3] = [_step(1, "r0", 41, 42, [1, 2, 3])]
    rep = run_observations(cfg, {"r0": 48}, evs, device="cpu")
    assert rep.first_bad.kind == "garbled" and rep.first_bad.step == 1


def test_hand_unprocessed_steps_run_at_the_end():
    evs = _swa_stream("optimistic")[:3]  # the trace stops before any Process
    rep = run_observations(_cfg(policy="optimistic", hazard="unordered"), {"r0": 100}, evs,
                           device="cpu")
    assert rep.steps == 2 and rep.first_bad.step == 0


def test_hand_out_of_order_processing_is_an_error():
    evs = _swa_stream("settled")
    evs[3], evs[4] = [ProcessObs(1)], [ProcessObs(0)]
    with pytest.raises(ValueError, match="oldest in flight"):
        run_observations(_cfg(), {"r0": 100}, evs, device="cpu")


def test_hand_bf16_within_its_tolerance_and_still_catches_garbage():
    clean = run_observations(_cfg(policy="settled", hazard="unordered"), {"r0": 100},
                             _swa_stream("settled"), device="cpu", dtype="bf16")
    assert clean.ok and 0 < clean.max_err <= 2e-2 and clean.tol == 2e-2
    bad = run_observations(_cfg(policy="optimistic", hazard="unordered"), {"r0": 100},
                           _swa_stream("optimistic"), device="cpu", dtype="bf16")
    assert not bad.ok and bad.max_err > 1.0


def test_kv_is_a_function_of_the_tokens_up_to_the_position():
    """Prompt positions: shared by every request. Generated positions (every
    target samples the same token): shared by requests with the same prompt
    length, as a prefix-cache hit across them reads; not by another length."""
    s = Shape()
    pos = np.arange(8, 12)
    k0, _ = kv_true(10, 0, pos, s)
    k2, _ = kv_true(11, 0, pos, s)
    assert torch.equal(k0[:2], k2[:2])  # prompt 8, 9
    assert not torch.equal(k0[3:], k2[3:])  # 11: generated for both, other prefixes
    assert not torch.equal(k0[2:3], k2[2:3])  # 10: generated after 10, prompt after 11
    assert torch.equal(kv_true(10, 0, pos, s)[0], k0)  # deterministic
    assert not torch.equal(kv_true(10, 1, pos, s)[0], k0)  # groups differ


def test_mamba_and_chunked_local_and_hybrid_groups_run():
    for groups in ((Group("mamba"),), (Group("chunked_local", 32),),
                   (Group("full"), Group("sliding", 16))):
        cfg = Config(groups=groups, block_size=16, num_blocks=64, depth=2)
        tabs = [[1, 2, 3, 4, 5, 6, 7]] * len(groups)
        evs = [[], [_step(0, "r0", 0, 64, *[t[:4] for t in tabs])],
               [_step(1, "r0", 64, 100, *tabs)], [ProcessObs(0)], [ProcessObs(1)]]
        rep = run_observations(cfg, {"r0": 100}, evs, device="cpu")
        assert rep.ok and rep.positions == 100 * len(groups), cfg.label()


# Mamba in vLLM's align mode: states in the worker's slots (model/mamba_slots.py).
# B = 4, two drafts; r0 (prompt 5) prefills [0, 5) (state after 4 in slot 1),
# decodes [5, 8) (after 5, 6, 7 in slots 1, 2, 3), both drafts accepted: the
# count reaches the edge at 8 and the postprocess copies slot 3 into slot 1,
# where the next step, [8, 11), starts from (after 8, 9, 10 in slots 2, 3, 4).


def _align_stream(last_table=(1, 2, 3, 4, 5)):
    return [[], [*_allocs("r0", [1, 2]), _step(0, "r0", 0, 5, [1, 2])], [ProcessObs(0)],
            [*_allocs("r0", [3, 4], 2), _step(1, "r0", 5, 8, [1, 2, 3, 4], spec=2)],
            [ProcessObs(1, (("r0", 2),))],
            [*_allocs("r0", [5], 4), _step(2, "r0", 8, 11, list(last_table), spec=2)],
            [ProcessObs(2, (("r0", 2),))]]


def _align_cfg() -> Config:
    return Config(groups=(Group("mamba"),), block_size=4, num_blocks=16, spec_tokens=2,
                  depth=1, prefix_caching=True)


def test_align_mamba_states_follow_the_worker_slots(monkeypatch):
    rep = run_observations(_align_cfg(), {"r0": 5}, _align_stream(), device="cpu",
                           mamba_align=True)
    assert rep.ok and rep.max_err <= FP32_TOL, format_report(rep)
    assert rep.positions == 11 and rep.state_reads == 2 and rep.checkpoints == 1
    # without the postprocess copy step 2 would start from the state after 5
    monkeypatch.setattr(AttentionReplay, "_checkpoint", lambda self, r, rejected: None)
    rep = run_observations(_align_cfg(), {"r0": 5}, _align_stream(), device="cpu",
                           mamba_align=True)
    fb = rep.first_bad
    assert fb is not None and (fb.step, fb.position) == (2, 8), format_report(rep)


def test_align_mamba_block_named_at_two_slots_garbles_the_state_left():
    """Step 2's table names block 3 at slots 2 and 4: the state after 10 lands
    on the state after 8, which the next step would start from had it
    rejected both drafts."""
    rep = run_observations(_align_cfg(), {"r0": 5}, _align_stream((1, 2, 3, 4, 3)),
                           device="cpu", mamba_align=True)
    fb = rep.first_bad
    assert fb is not None and (fb.step, fb.position, fb.kind) == (2, 8, "garbled"), (
        format_report(rep))
    assert "left at slot 2 (block 3)" in str(fb) and rep.max_err > 1e3 * FP32_TOL


def test_format_report_names_the_first_bad_read():
    rep = run_observations(_cfg(policy="optimistic", spec_tokens=2), {"r0": 29},
                           _spec_stream("optimistic"), device="cpu")
    text = format_report(rep)
    assert "NaN READ" in text and "step 2, r0 position 30" in text and ">>" in text
    assert len(text.splitlines()) < 20


# ---------------------------------------------------------------------- devices


def test_device_selection_on_this_machine():
    assert pick_device("cpu").type == "cpu"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device(None).type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            pick_device("cuda")
        kernel, why = load_vllm_kernel(torch.device("cpu"), Shape(2, 16))
        assert kernel is None and "no CUDA" in why
    with pytest.raises(ValueError, match="unsupported device"):
        pick_device("meta")


def _emulated_unified_attention(*, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k,
                                max_seqlen_k, softmax_scale, causal, window_size, block_table,
                                softcap, q_descale, k_descale, v_descale):
    """What vLLM's Triton unified_attention computes, written out plainly
    (causal; key j of sequence i at block_table[i, j // B], slot j % B;
    ``window_size[0] >= 0`` keeps keys with ``qpos - j < window_size[0] + 1``)."""
    assert causal and softcap == 0 and q_descale is None
    B = k.shape[1]
    win = 1 + window_size[0]
    for i in range(len(seqused_k)):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        seq_len = int(seqused_k[i])
        assert seq_len <= max_seqlen_k and qe - qs <= max_seqlen_q
        keys = torch.arange(seq_len)
        blocks = block_table[i, keys // B].long()
        kk, vv = k[blocks, keys % B].float(), v[blocks, keys % B].float()
        for j in range(qs, qe):
            qpos = seq_len - (qe - qs) + (j - qs)
            m = keys <= qpos
            if win > 0:
                m &= (qpos - keys) < win
            s = torch.einsum("hd,lhd->hl", q[j].float(), kk) * softmax_scale
            s = s.masked_fill(~m[None], float("-inf"))
            out[j] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv).to(out.dtype)


@pytest.mark.parametrize("group", [Group("full"), Group("sliding", 20), Group("mamba"),
                                   Group("chunked_local", 32)])
def test_vllm_kernel_call_agrees_with_torch_path_emulated(group):
    """The arguments we hand vLLM's kernel (per-row sequences, windows,
    chunked-local virtual batches) give what our torch path computes, with the
    kernel's semantics emulated on the CPU."""
    cfg = Config(groups=(group,), block_size=16, num_blocks=64, depth=2)
    tab = [3, 9, 4, 7, 1, 2, 5]
    evs = [[], [_step(0, "r0", 0, 64, tab[:4])], [_step(1, "r0", 64, 100, tab)],
           [ProcessObs(0)], [ProcessObs(1)]]
    fake = VllmKernel(_emulated_unified_attention, "emulated")
    rep = run_observations(cfg, {"r0": 100}, evs, device="cpu", head_dim=16, vllm=fake)
    assert rep.ok and rep.kernel_failed == ""
    assert rep.kernel_max_err is not None and rep.kernel_max_err < 1e-5, rep.kernel_max_err
    assert rep.kernel_ok


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA GPU on this machine (torch sees none): the CUDA and vLLM "
                           "kernel confirmation runs only on a GPU (scripts/gpu_check.py)")
def test_cuda_matches_cpu_and_vllm_kernel_agrees():
    evs = _spec_stream("optimistic")
    cfg = _cfg(policy="optimistic", spec_tokens=2)
    cpu = run_observations(cfg, {"r0": 29}, evs, device="cpu", head_dim=16)
    gpu = run_observations(cfg, {"r0": 29}, evs, device="cuda", head_dim=16)
    assert gpu.device.startswith("cuda")
    assert (gpu.first_bad.step, gpu.first_bad.position, gpu.first_bad.kind) == \
        (cpu.first_bad.step, cpu.first_bad.position, cpu.first_bad.kind)
    assert abs(gpu.max_err - cpu.max_err) <= 1e-5
    if gpu.kernel_max_err is None:
        pytest.skip(f"vLLM's kernel did not run on this GPU: {gpu.kernel_note}")
    assert gpu.kernel_ok, gpu.kernel_max_err


# ---------------------------------------------------------- the reference target
#
# traces/attention/: NAME-optimistic.json (meta.expect_violation, expect_kind,
# expect_step) and NAME-settled.json (the same events under the fix), plus
# long-*.json (random walks under settled: preemptions, rejections, loads).

PROPERTY1 = ["swa-unordered", "chunked-unordered", "hybrid-pp3-unordered"]  # freed while read
PROPERTY2 = ["spec-reject-null", "mamba-spec-reject-null"]  # null read after rejection


def _fixed(name: str) -> Trace:
    return Trace.load(TRACES / f"{name}.json")


def _target_of(t: Trace):
    """The target a trace names (a layout only it builds), else the reference."""
    name = t.meta.get("target", "reference")
    return vllm_target(name[len("vllm@"):]) if name.startswith("vllm@") else name


def _with(t: Trace, **kw) -> Trace:
    return Trace(replace(t.config, **kw), list(t.events), dict(t.meta))


@pytest.mark.parametrize("name", PROPERTY1)
def test_property1_counterexample_garbles_at_the_named_step(name):
    rep = replay_attention(_fixed(f"{name}-optimistic"), "reference", device="cpu")
    named = rep.named_step(1)
    assert named is not None, "the checker should flag property 1 on this trace"
    assert not rep.ok, format_report(rep)
    assert rep.first_bad.kind == "garbled" and rep.first_bad.step == named, format_report(rep)
    assert rep.max_err > 1e3 * FP32_TOL  # far above tolerance: foreign KV, not rounding
    assert rep.nan_reads == 0


@pytest.mark.parametrize("name", PROPERTY1)
def test_property1_counterexample_needs_the_unordered_writer(name):
    """In stream order the later step's writes land after the reader ran."""
    rep = replay_attention(_with(_fixed(f"{name}-optimistic"), hazard="ordered"), device="cpu")
    assert rep.named_step(1) is not None  # the checker still flags the free
    assert rep.ok and rep.max_err <= FP32_TOL


@pytest.mark.parametrize("name", PROPERTY2)
def test_property2_counterexample_reads_nan_at_the_named_step(name):
    rep = replay_attention(_fixed(f"{name}-optimistic"), "reference", device="cpu")
    named = rep.named_step(2)
    assert named is not None, "the checker should flag property 2 on this trace"
    assert rep.first_bad.kind == "nan" and rep.first_bad.step == named, format_report(rep)
    assert rep.nan_reads > 0
    bad = [r for r in rep.rows if r.step == named and r.request == rep.first_bad.rid][0]
    assert bad.verdict == "nan" and "shifted" in bad.note


@pytest.mark.parametrize("name", PROPERTY1 + PROPERTY2)
def test_same_events_under_settled_are_exact(name):
    t = _with(_fixed(f"{name}-optimistic"), policy="settled")
    assert _fixed(f"{name}-settled").events == t.events  # the twin file holds these events
    rep = replay_attention(t, "reference", device="cpu")
    assert rep.ok and rep.max_err <= FP32_TOL and rep.nan_reads == 0, format_report(rep)
    assert not rep.violations
    bf = replay_attention(t, "reference", device="cpu", dtype="bf16")
    assert bf.ok and bf.max_err <= 2e-2


def test_fixed_set_matches_its_metadata():
    paths = sorted(TRACES.glob("*.json"))
    assert len(paths) >= 10
    assert any(p.stem.startswith("long-") for p in paths)
    for p in paths:
        t = Trace.load(p)
        rep = replay_attention(t, _target_of(t), device="cpu")
        if t.meta.get("expect_violation"):
            assert not rep.ok, p.stem
            assert rep.first_bad.kind == t.meta["expect_kind"], p.stem
            assert rep.first_bad.step == t.meta["expect_step"], p.stem
        else:
            assert rep.ok and rep.max_err <= FP32_TOL and rep.nan_reads == 0, (
                p.stem, format_report(rep))
            assert not rep.violations, p.stem
            assert rep.positions > 0


def test_long_traces_reach_the_dangerous_situations():
    """The clean long traces are not clean for lack of trying."""
    seen: set[str] = set()
    for p in sorted(TRACES.glob("long-*.json")):
        seen |= {k for k, n in Trace.load(p).meta.get("witness", {}).items() if n}
    for w in ("free_while_in_flight", "rollback_near_free", "preempt_in_flight",
              "failed_load", "block_reused"):
        assert w in seen, w


# Findings 9, 10 and 12 (findings/README.md): a copy of a block not yet filled
# (9: by another copy of the step; 12: by a connector load later in the step),
# one block at two slots of the worker's table (10). The checker names the step;
# the replay must garble there, and be exact on the fix's tree.
NAMED_STEP = ["partial-hit-copies-read-unfilled-copy",
              "partial-hit-copies-block-loading-this-step",
              "mamba-align-relocated-block-written-twice",
              "mamba-align-relocated-block-checkpoint-overwritten"]
FIXED = [n for n in NAMED_STEP
         if "fixed_by" in Trace.load(trace_path(n)).meta]


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMED_STEP)
def test_finding_garbles_at_the_named_step(name):
    t = Trace.load(trace_path(name))
    rep = replay_attention(t, vllm_target("0.33.0"), device="cpu")
    named = rep.named_step(2)
    assert named is not None, "the checker should flag property 2 on this trace"
    assert not rep.ok and rep.first_bad.kind == "garbled", format_report(rep)
    assert rep.first_bad.step == named and rep.first_bad.group == 0, format_report(rep)
    assert rep.max_err > 1e3 * FP32_TOL and rep.nan_reads == 0


@pytest.mark.vllm
@pytest.mark.parametrize("name", FIXED)
def test_finding_exact_with_its_fix(name):
    """On the tree with the finding's fix (meta.fixed_by) the same replay is exact."""
    t = Trace.load(trace_path(name))
    fixed = with_fix("vllm@0.33.0", t.meta["fixed_by"]).removeprefix("vllm@")
    rep = replay_attention(t, vllm_target(fixed), device="cpu")
    assert rep.ok and rep.max_err <= FP32_TOL and rep.nan_reads == 0, format_report(rep)
    assert not rep.violations and rep.state_reads > 0, format_report(rep)


# Controls on the combined fix tree of findings 8-10: a hit's copy holds both
# blocks until its frees; vLLM frees those holds in the schedule that queues the
# copy at depth 1, where the copy still runs before any later write; a step
# never processed (the trace's end) ran its postprocess too.
REPLAY_CONTROLS = ["partial-hit-copy-of-loaded-block-attention-fix",
                   "partial-hit-copy-freed-in-its-schedule-attention-fix",
                   "mamba-drafts-unprocessed-at-end-attention-fix"]


@pytest.mark.vllm
@pytest.mark.parametrize("name", REPLAY_CONTROLS)
def test_copy_and_postprocess_controls_match(name):
    t = Trace.load(ROOT / "traces" / "vllm" / f"{name}.json")
    rep = replay_attention(t, _target_of(t), device="cpu")
    assert rep.ok and rep.max_err <= FP32_TOL and not rep.violations, format_report(rep)
    assert rep.state_reads > 0 and rep.positions > 0


@pytest.mark.vllm
def test_align_mamba_control_with_drafts_matches():
    """The control beside finding 10: align mode, three drafts (K < B), rejections
    with a step in flight, block-edge copies, prefix hits; exact on 0.33.0."""
    t = _fixed("long-mamba-align-drafts")
    assert t.config.prefix_caching and t.config.spec_tokens > 0
    rep = replay_attention(t, _target_of(t), device="cpu")
    assert rep.ok and rep.max_err <= FP32_TOL and not rep.violations, format_report(rep)
    assert rep.state_reads > 10 and rep.checkpoints > 5
    assert any("rejected" in r.note for r in rep.rows)


# ------------------------------------------------------------------ gpu_check


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_runs_the_fixed_set_here(capsys):
    code = _gpu_check().main(["--cpu-ok"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ALL AS EXPECTED" in out
    for p in TRACES.glob("*.json"):
        assert p.stem in out
    if not torch.cuda.is_available():
        assert "no CUDA GPU here" in out and "(on the CPU)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit status")
def test_gpu_check_without_gpu_says_so_and_exits_3(tmp_path, capsys):
    (tmp_path / "t.json").write_text((TRACES / "spec-reject-null-settled.json").read_text())
    code = _gpu_check().main(["--traces", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 3 and "did NOT run" in out.out and "--cpu-ok" in out.err


def test_gpu_check_shows_a_row_whose_target_is_not_installed(tmp_path, capsys):
    """A GPU machine may lack the vLLM a trace's layout needs: that row is shown
    as NOT RUN and named in the verdict, the others still judged; a run in which
    no row ran is exit 3, not a pass."""
    import json

    (tmp_path / "a.json").write_text((TRACES / "spec-reject-null-settled.json").read_text())
    other = json.loads((TRACES / "spec-reject-null-settled.json").read_text())
    other.setdefault("meta", {})["target"] = "vllm@0.27.0"  # supported, never installed here
    (tmp_path / "b.json").write_text(json.dumps(other))
    code = _gpu_check().main(["--traces", str(tmp_path), "--cpu-ok"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "NOT RUN (vllm@0.27.0)" in out and "1 row(s) NOT RUN" in out
    (tmp_path / "a.json").unlink()
    code = _gpu_check().main(["--traces", str(tmp_path), "--cpu-ok"])
    assert code == 3, capsys.readouterr().out


# ------------------------------------------------------------- real vLLM managers


@pytest.mark.vllm
@pytest.mark.parametrize("version,garbled", [("0.25.1", True), ("0.33.0", False)])
def test_real_vllm_manager_garbles_before_the_fix_and_not_after(version, garbled):
    """The sliding-window counterexample driven through vLLM's own scheduler and
    KV-cache manager: 0.25.1 (optimistic) frees blocks step 0 still reads, the
    unordered writer garbles them; 0.33.0 (the fix) stays exact."""
    target = vllm_target(version)
    rep = replay_attention(_fixed("swa-unordered-optimistic"), target, device="cpu")
    if garbled:
        assert not rep.ok and rep.first_bad.kind == "garbled" and rep.first_bad.step == 0
        assert rep.named_step(1) == 0
    else:
        assert rep.ok and rep.max_err <= FP32_TOL, format_report(rep)
