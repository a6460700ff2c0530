# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A step in flight delivers its output after a failed load.

Found by kvcheck on vllm@0.33.0 (its trace:
failed-load-in-flight-output-delivered.json); these calls, replayed on vllm
0.33.0: property 2 (null-read): the output of step 1 for r0 counts, but the
step read block 1 (logical 0, positions [0, 3)), which a failed connector
load left without KV
Passes with these diffs applied in turn:
    findings/01-failed-load-recompute-reads-null/fix.diff
    findings/02-failed-load-blocks-stay-cached/fix.diff
    findings/03-failed-load-in-flight-output-delivered/fix.diff
"""

import pytest

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_failed_load_in_flight_output_delivered(tmp_path):
    layers = {"layer0": attention(FullAttentionSpec, 16)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=6,
        block_size=16,
        max_num_batched_tokens=16,
        max_model_len=80,
        async_scheduling=True,
        load_failure_policy="recompute",
        num_speculative_tokens=1,
    )
    scheduler.connector.offers["r0"] = 1
    scheduler.add_request(request("r0", 2, 2))
    s0 = scheduler.schedule()
    ids0 = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    s1 = scheduler.schedule()
    scheduler.update_from_output(s0, output(s0, {"r0": 2}, failed=[ids0[0]]))
    req = scheduler.requests["r0"]  # held: it may finish
    before = req.num_output_tokens
    scheduler.update_from_output(s1, output(s1, {"r0": 2}))
    assert req.num_output_tokens == before, (
        "r0's output of step 1 counts (it took the sampled token), but "
        "step 1 read r0's logical block 0 (positions [0, 3)), whose "
        "connector load failed in that same output"
    )
