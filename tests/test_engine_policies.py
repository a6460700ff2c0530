"""Other engines' freeing rules as policies (docs/ENGINES.md): SGLang's
decode rule is proved, TensorRT-LLM's is refuted with traces that replay to
the same violation on the reference target."""

from __future__ import annotations

import pytest

from impl.target import make_target
from model.events import Group
from model.policy import REGISTRY, Counts, basis
from properties.replay import replay
from prove.proof import prove, search_counterexample
from prove.z3model import policy_rule


def test_engine_policies_are_registered_with_their_bases():
    g = Group("sliding", 4)
    c = Counts(computed=20, in_flight=3, loading=0, spec=2)
    assert basis("sglang", g, c) == 16  # settled 17, one token later
    assert basis("trtllm", g, c) == 19  # optimistic 20 less one, drafts included
    assert {"sglang", "trtllm"} <= set(REGISTRY)


@pytest.mark.parametrize("kind", ["sliding", "chunked_local"])
def test_sglang_rule_is_proved(kind):
    r = prove(kind, "sglang")
    assert r.status == "proved", r.detail


@pytest.mark.parametrize("kind", ["sliding", "chunked_local"])
def test_trtllm_rule_is_refuted_and_the_trace_replays_on_the_reference(kind):
    r = prove(kind, "trtllm")
    assert r.status == "refuted" and r.trace is not None
    rr = replay(r.trace, make_target("reference"))
    assert [v.prop for v in rr.violations][:1] == [1]


def test_trtllm_rejected_draft_reads_a_detached_block():
    found = search_counterexample("sliding", "trtllm", policy_rule("trtllm"), 2)
    assert found is not None and found.trace.config.spec_tokens > 0
    rr = replay(found.trace, make_target("reference"), props=frozenset({2}))
    assert [v.prop for v in rr.violations][:1] == [2]
