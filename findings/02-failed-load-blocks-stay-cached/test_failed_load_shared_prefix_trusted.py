# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prefix hit reads a failed load's blocks.

Found by kvcheck on vllm@0.33.0 (its trace:
failed-load-shared-prefix-trusted.json); these calls, replayed on vllm
0.33.0: property 2 (null-read): step 1 (scheduled) computes r1 positions
[81, 82); position 81 reads [0, 81] (full) but block 1 (logical 0) holds no
valid KV for positions [0, 16): a connector load into it failed and nothing
computed them again
Passes with these diffs applied in turn:
    findings/01-failed-load-recompute-reads-null/fix.diff
    findings/02-failed-load-blocks-stay-cached/fix.diff
    findings/03-failed-load-in-flight-output-delivered/fix.diff
"""

import pytest

from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import RequestStatus

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_failed_load_shared_prefix_trusted(tmp_path):
    layers = {"layer0": attention(FullAttentionSpec, 16)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=11,
        block_size=16,
        max_num_batched_tokens=16,
        max_model_len=160,
        prefix_caching=True,
        load_failure_policy="recompute",
    )
    scheduler.connector.offers["r0"] = 65
    scheduler.add_request(request("r0", 80, 1))
    scheduler.connector.offers["r1"] = 81
    scheduler.add_request(request("r1", 82, 1))
    s0 = scheduler.schedule()
    ids0 = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    scheduler.update_from_output(
        s0,
        output(
            s0, {"r0": 1, "r1": 1}, failed=[ids0[0], ids0[1], ids0[2], ids0[3], ids0[4]]
        ),
    )
    scheduler.finish_requests("r0", RequestStatus.FINISHED_STOPPED)
    s1 = scheduler.schedule()
    start = None  # step 1 computes r1's [start, end)
    if "r1" in s1.num_scheduled_tokens:
        end = scheduler.requests["r1"].num_computed_tokens
        start = end - s1.num_scheduled_tokens["r1"]
    assert start is None or start <= 0, (
        f"step 1 computes r1 from position {start} and reads positions "
        "[0, 16), whose connector load failed and which no step computed "
        "again"
    )
