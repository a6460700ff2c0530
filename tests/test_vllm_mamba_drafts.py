"""Mamba in vLLM's align mode with drafts of a block or more (``K >= B``).

A Mamba step's blocks are read through the model runner's block table, which
the driver builds from the scheduler outputs as vLLM's model runners do
(append-only for a running request); the checker takes the state a step
starts from where the worker does (the step before's running slot plus its
accepted drafts). Finding 10 (findings/README.md) is where the two tables
part ways on a real bug."""

from pathlib import Path

import pytest

from gate.known import trace_path
from model.events import Trace
from model.observations import NULL, MoveObs, StepObs
from properties.replay import replay
from tests.vllm_targets import vllm_target

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
FINDING = trace_path("mamba-align-relocated-block-written-twice")
RUNNING_SLOT = ROOT / "traces" / "vllm" / "mamba-drafts-state-in-running-slot-0.33.0.json"


def test_a_relocated_block_stays_at_its_old_slot_of_the_worker_table():
    """Step 2 of finding 10: vLLM relocates speculative block 3 from slot 2 to
    slot 6 of the scheduler's table (NULL at 2) and hands the worker [3, 7] to
    append: the table the step is reported with names block 3 at both."""
    t = Trace.load(FINDING)
    target = vllm_target("0.33.0")
    target.reset(t.config)
    obs = [target.apply(ev) for ev in t.events[:5]]
    moves = [it for o in obs for it in o.items if isinstance(it, MoveObs)]
    assert [(m.block, m.logical, m.to) for m in moves] == [(3, 2, 6)]
    (step,) = [it for it in obs[4].items if isinstance(it, StepObs)]
    (rs,) = step.reqs
    assert (rs.start, rs.end, rs.spec) == (8, 13, 4)
    assert rs.tables[0] == (1, 2, 3, 4, 5, 6, 3, 7)


def test_a_shifted_step_starts_from_the_running_slot_of_the_step_before():
    """With four drafts of 4-token blocks the state after a rejected decode
    lies in the step's running slot, (e - 1) // B, not in the slot of its
    position (NULL there): the trace holds on 0.33.0, and the same reads
    taken at the slot of the position are a NULL read."""
    t = Trace.load(RUNNING_SLOT)
    assert replay(t, "vllm@0.33.0").first is None
    steps = [it for o in _observe(t) for it in o.items if isinstance(it, StepObs)]
    shifted = steps[-1].reqs[0]
    assert (shifted.start, shifted.end) == (9, 14) and shifted.spec == 4
    assert shifted.tables[0][(5 - 1) // 4] == NULL  # the slot of position 4
    assert shifted.tables[0][(9 - 1) // 4] != NULL  # the running slot of [4, 9)


def test_finding_10_is_the_shifted_step_writing_one_block_twice():
    """Once step 1's drafts are rejected, step 2 computes [4, 9) and writes
    its running state and its fourth draft's state into block 3; before the
    rejection (the same events up to it) everything holds."""
    t = Trace.load(FINDING)
    bad = replay(t, "vllm@0.33.0").first
    assert bad is not None and bad.prop == 2 and bad.step == 2 and bad.block == 3, bad
    assert "slots 2 and 6 of the worker's table" in bad.message
    assert replay(Trace(t.config, t.events[:-1]), "vllm@0.33.0").first is None


def _observe(t: Trace):
    target = vllm_target("0.33.0")
    target.reset(t.config)
    return [target.apply(ev) for ev in t.events]


IN_FLIGHT_CHUNKS = ROOT / "traces" / "vllm" / "mamba-drafts-state-per-chunk-in-flight-0.33.0.json"


def test_a_mamba_request_holds_a_state_per_chunk_in_flight_beside_its_draft_slots():
    """Depth 4, four drafts, four 16-token chunks in flight: r0 holds 9 live
    Mamba blocks, more than cdiv(max_model_len, B) = 8; the bound the target
    reports for the group is vLLM's table row with a block per draft
    (cdiv(max_model_len, B) + K = 12), and the trace holds."""
    t = Trace.load(IN_FLIGHT_CHUNKS)
    cfg = t.config
    rows = cfg.max_model_len // cfg.block_size
    obs = _observe(t)
    assert obs[-1].counters.bound[2] == rows + cfg.spec_tokens
    assert max(rc.live[2] for o in obs for rc in o.counters.reqs.values()) == 9 > rows
    assert replay(t, "vllm@0.33.0").first is None


DEPTH3 = ROOT / "traces" / "vllm" / "mamba-drafts-depth3-state-slots-of-the-step-before-0.33.0.json"


@pytest.mark.parametrize("where", ["reference", "0.33.0"])
def test_a_step_behind_an_unprocessed_one_starts_where_that_one_can_end(where):
    """Depth 3, two drafts: step 5 follows step 3, both unprocessed (steps 2
    and 4 scheduled nothing). Step 3's end moves down only by the drafts of
    the steps before it (none: step 1 is processed); its own drafts pick which
    of its slots step 5 starts from. No outcome reaches slot 0, so letting go
    of the state there holds (a checker that also moved step 3's end by its
    own drafts called it property 1)."""
    t = Trace.load(DEPTH3)
    rr = replay(t, "reference" if where == "reference" else vllm_target(where))
    assert rr.crash is None and rr.first is None, rr.crash or rr.first
    assert rr.witness.get("free_while_in_flight", 0) >= 1
