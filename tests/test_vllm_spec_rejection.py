"""On vLLM 0.25.1 the other half of the seed bug is reachable: a draft
rejection rolls the count back below a block already replaced by NULL, and a
step in flight reads it (property 2). 0.33.0 passes the same trace."""

from pathlib import Path

import pytest

from model.events import Trace
from properties.machine import FuzzSpec, fuzz
from properties.replay import replay

TRACE = Path(__file__).resolve().parent.parent / "traces" / "vllm" / \
    "spec-reject-null-read-0.25.1.json"


@pytest.mark.vllm
def test_saved_trace_reads_null_on_0_25_1_and_passes_on_0_33_0():
    t = Trace.load(TRACE)
    bad = replay(t, "vllm@0.25.1", props=frozenset({2}))  # the property it shows
    assert bad.first is not None and bad.first.prop == 2, bad.first
    assert "rejection" in bad.first.message and "NULL" in bad.first.message
    assert replay(t, "vllm@0.33.0").first is None


@pytest.mark.vllm
def test_fuzzing_0_25_1_with_drafts_finds_the_null_read():
    spec = FuzzSpec(target="vllm@0.25.1", kind="sliding", policy="optimistic", depth=2,
                    spec_tokens=2, props=frozenset({2}), fail_loads=False)
    res = fuzz(spec, examples=300, seed=1)
    assert res.violation is not None and res.violation.prop == 2, res.violation
