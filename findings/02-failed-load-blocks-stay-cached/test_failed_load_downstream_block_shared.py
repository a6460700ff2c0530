# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prefix hit reads a failed load's blocks.

Found by kvcheck on vllm@0.33.0 (its trace:
failed-load-downstream-block-shared.json); these calls, replayed on vllm
0.33.0: property 2 (null-read): step 3 (scheduled) computes r0 positions
[24, 25); position 24 reads [22, 24] (sliding(W=3)) but block 3 (logical 2)
holds no valid KV for positions [22, 24): a connector load into it failed
and nothing computed them again
Passes with these diffs applied in turn:
    findings/01-failed-load-recompute-reads-null/fix.diff
    findings/02-failed-load-blocks-stay-cached/fix.diff
    findings/03-failed-load-in-flight-output-delivered/fix.diff
"""

import pytest

from vllm.v1.kv_cache_interface import SlidingWindowSpec

from kvcheck_utils import attention, build, output, reset_prefix_cache

pytestmark = pytest.mark.cpu_test


def test_failed_load_downstream_block_shared(tmp_path):
    layers = {"layer0": attention(SlidingWindowSpec, 8, sliding_window=3)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=7,
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
    reset_prefix_cache(scheduler)
    s3 = scheduler.schedule()
    start = None  # step 3 computes r0's [start, end)
    if "r0" in s3.num_scheduled_tokens:
        end = scheduler.requests["r0"].num_computed_tokens
        start = end - s3.num_scheduled_tokens["r0"]
    assert start is None or start <= 22, (
        f"step 3 computes r0 from position {start} and reads positions "
        "[22, 24), whose connector load failed and which no step "
        "computed again"
    )
