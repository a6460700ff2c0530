# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prefix hit reads a failed load's blocks.

Found by kvcheck on vllm@0.33.0 (its trace:
failed-load-prefix-hit-reads-missing-kv.json); these calls, replayed on vllm
0.33.0: property 2 (null-read): step 2 (scheduled) computes r0 positions
[16, 17); position 16 reads [0, 16] (full) but block 1 (logical 0) holds no
valid KV for positions [0, 16): a connector load into it failed and nothing
computed them again
Passes with these diffs applied in turn:
    findings/01-failed-load-recompute-reads-null/fix.diff
    findings/02-failed-load-blocks-stay-cached/fix.diff
    findings/03-failed-load-in-flight-output-delivered/fix.diff
"""

import pytest

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvcheck_utils import attention, build, output, reset_prefix_cache

pytestmark = pytest.mark.cpu_test


def test_failed_load_prefix_hit_reads_missing_kv(tmp_path):
    layers = {"layer0": attention(FullAttentionSpec, 16)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=6,
        block_size=16,
        max_num_batched_tokens=16,
        max_model_len=80,
        async_scheduling=True,
        prefix_caching=True,
        load_failure_policy="recompute",
    )
    scheduler.connector.offers["r0"] = 1
    scheduler.add_request(request("r0", 17, 2))
    s0 = scheduler.schedule()
    ids0 = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    s1 = scheduler.schedule()
    scheduler.update_from_output(s0, output(s0, {"r0": 1}, failed=[ids0[0]]))
    reset_prefix_cache(scheduler)
    scheduler.update_from_output(s1, output(s1, {"r0": 1}))
    s2 = scheduler.schedule()
    start = None  # step 2 computes r0's [start, end)
    if "r0" in s2.num_scheduled_tokens:
        end = scheduler.requests["r0"].num_computed_tokens
        start = end - s2.num_scheduled_tokens["r0"]
    assert start is None or start <= 0, (
        f"step 2 computes r0 from position {start} and reads positions "
        "[0, 16), whose connector load failed and which no step computed "
        "again"
    )
