# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prefix hit reads a failed load's blocks.

Found by kvcheck on vllm@0.33.0 (its trace:
failed-load-fail-policy-sharer-reads-missing-kv-sync.json); these calls,
replayed on vllm 0.33.0: property 2 (null-read): the output of step 0 for r1
counts, but the step read block 3 (logical 2, positions [22, 24)), which a
failed connector load left without KV
Passes with findings/fixes/failed-load-fails-downstream-holders.diff
applied.
"""

import pytest

from vllm.v1.kv_cache_interface import SlidingWindowSpec

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_failed_load_fail_policy_sharer_reads_missing_kv_sync(tmp_path):
    layers = {"layer0": attention(SlidingWindowSpec, 8, sliding_window=3)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=8,
        block_size=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        prefix_caching=True,
        load_failure_policy="fail",
    )
    scheduler.connector.offers["r0"] = 8
    scheduler.add_request(request("r0", 25, 1))
    scheduler.add_request(request("r1", 25, 2))
    s0 = scheduler.schedule()
    ids0 = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    req = scheduler.requests["r1"]  # held: it may finish
    before = req.num_output_tokens
    scheduler.update_from_output(s0, output(s0, {"r0": 1, "r1": 1}, failed=[ids0[0]]))
    assert req.num_output_tokens == before, (
        "r1's output of step 0 counts (it took the sampled token), but "
        "step 0 read r1's logical block 2 (positions [22, 24)), whose "
        "connector load failed in that same output"
    )
