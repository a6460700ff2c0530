"""Property 7 on the real vLLM: with a KV-consumer connector and two batches in
flight, 0.25.1 and 0.26.0 preempt a victim whose blocks wait behind its
in-flight step (vLLM's deferred-free fence), so the preemption frees nothing
the allocation can use and the next victim follows (upstream #49674, fixed by
#49675 in the releases after). 0.33.0 passes the same trace."""

from pathlib import Path

import pytest

from model.events import Trace
from properties.replay import replay

TRACE = Path(__file__).resolve().parent.parent / "traces" / "vllm" / \
    "preemption-frees-nothing-0.25.1.json"


@pytest.mark.vllm
def test_a_fenced_victim_frees_nothing_on_0_25_1_and_is_skipped_on_0_33_0():
    t = Trace.load(TRACE)
    bad = replay(t, "vllm@0.25.1")
    assert bad.first is not None and bad.first.prop == 7, bad.first
    assert "frees nothing the scheduler can use" in bad.first.message
    assert replay(t, "vllm@0.33.0").first is None


STALE = Path(__file__).resolve().parent.parent / "traces" / "vllm" / \
    "failed-load-stale-placeholder-runner-samples-0.33.0.json"


@pytest.mark.vllm
def test_the_runner_samples_where_a_failed_load_left_a_stale_placeholder():
    """After a failed load at depth 3 the recovery keeps the discarded step's
    output placeholder, so vLLM's scheduler takes the recomputed prompt's last
    chunk for a prefill chunk (``is_prefill_chunk``); its model runner,
    aligned to the scheduler's output tokens, reaches the prompt's end and
    samples there. The driver does what the runner does: the request gets its
    token and finishes in the closing drain (property 7 holds)."""
    t = Trace.load(STALE)
    assert t.config.depth == 3 and [type(e).__name__ for e in t.events][-2:] == \
        ["FailLoad", "Drain"]
    rr = replay(t, "vllm@0.33.0")
    assert rr.crash is None and rr.first is None, rr.crash or rr.first
    assert rr.witness.get("drained"), rr.witness
