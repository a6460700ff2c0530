"""The proofs stay tied to the code: the Z3 terms agree with the reference
manager's own skip rule on 10,000 sampled inputs, and the refutation traces
of the broken policies replay to a violation on vLLM 0.25.1."""

import random
from dataclasses import replace

import pytest

from model.events import AddRequest, Group, Trace
from properties.replay import replay
from prove.proof import prove
from prove.z3model import Z3_KINDS as KINDS
from prove.z3model import eval_skipped


def test_z3_skipped_agrees_with_the_reference_managers():
    from impl.reference.block_pool import BlockPool
    from impl.reference.managers import make_manager

    rng = random.Random(5)
    for _ in range(10_000):
        kind = rng.choice(KINDS)
        B = rng.choice([1, 2, 4, 8, 16, 32])
        param = (rng.randint(1, 300) if kind == "sliding"
                 else B * rng.randint(1, 12) if kind == "chunked_local" else 0)
        n = rng.randint(0, 5000)
        mgr = make_manager(Group(kind, param), 0, BlockPool(8, False), B)
        assert max(0, mgr.get_num_skipped_tokens(n)) == eval_skipped(kind, param, n), \
            (kind, param, B, n)


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["sliding", "chunked_local"])
def test_refutation_replays_on_vllm_0_25_1(kind):
    r = prove(kind, "optimistic")
    assert r.status == "refuted" and r.trace is not None
    trace = r.trace
    cfg = trace.config
    if cfg.max_num_seqs > cfg.max_num_batched_tokens:
        # vLLM insists on max_num_seqs <= max_num_batched_tokens; with one
        # request in the trace the bound changes nothing
        assert sum(isinstance(e, AddRequest) for e in trace.events) <= cfg.max_num_batched_tokens
        trace = Trace(replace(cfg, max_num_seqs=cfg.max_num_batched_tokens), trace.events,
                      trace.meta)
    rr = replay(trace, "vllm@0.25.1")
    assert rr.crash is None, rr.crash
    assert rr.first is not None and rr.first.prop == 1, rr.first
    fixed = replay(trace, "vllm@0.33.0")
    assert fixed.first is None, fixed.first
