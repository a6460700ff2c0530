# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prefix hit reads a failed load's blocks.

Found by kvcheck on vllm@0.33.0 (its trace:
failed-load-downstream-block-shared.json); these calls, replayed on vllm
0.33.0: property 2 (null-read): step 2 (scheduled) computes r1 positions
[25, 26); position 25 reads [23, 25] (sliding(W=3)) but block 3 (logical 2)
holds no valid KV for positions [23, 24): a connector load into it failed
and nothing computed them again
Passes with these diffs applied in turn:
    findings/01-failed-load-recompute-reads-null/fix.diff
    findings/02-failed-load-blocks-stay-cached/fix.diff
    findings/03-failed-load-in-flight-output-delivered/fix.diff
"""

import pytest

from vllm.v1.kv_cache_interface import SlidingWindowSpec

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_failed_load_downstream_block_shared(tmp_path):
    layers = {"layer0": attention(SlidingWindowSpec, 8, sliding_window=3)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=8,
        block_size=8,
        max_num_batched_tokens=10,
        max_model_len=64,
        async_scheduling=True,
        prefix_caching=True,
        load_failure_policy="recompute",
        pipeline_parallel_size=2,
    )
    scheduler.connector.offers["r0"] = 8
    scheduler.add_request(request("r0", 25, 1))
    scheduler.add_request(request("r1", 25, 2))
    s0 = scheduler.schedule()
    ids0 = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    scheduler.schedule()
    scheduler.schedule()  # nothing to run
    scheduler.update_from_output(s0, output(s0, {}, failed=[ids0[0]]))
    req = scheduler.requests["r0"]  # preempted as schedule() does
    scheduler.running.remove(req)
    scheduler._preempt_request(
        req, 0.0, drop_stale_output=scheduler.requires_kv_delivery
    )
    s2 = scheduler.schedule()
    start = None  # step 2 computes r1's [start, end)
    if "r1" in s2.num_scheduled_tokens:
        end = scheduler.requests["r1"].num_computed_tokens
        start = end - s2.num_scheduled_tokens["r1"]
    assert start is None or start <= 23, (
        f"step 2 computes r1 from position {start} and reads positions "
        "[23, 24), whose connector load failed and which no step "
        "computed again"
    )
