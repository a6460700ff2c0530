# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prefix hit reads a failed load's blocks.

Found by kvcheck on vllm@0.33.0 with
findings/fixes/failed-load-serialized-repair-pr53298.diff applied (its
trace: failed-load-serialized-repair-misses-preempted-sharer.json); these
calls, replayed on that tree: property 2 (null-read): the output of step 0
for r1 counts, but the step read block 1 (logical 0, positions [0, 16)),
which a failed connector load left without KV
Passes with these diffs applied in turn:
    findings/01-failed-load-recompute-reads-null/fix.diff
    findings/02-failed-load-blocks-stay-cached/fix.diff
    findings/03-failed-load-in-flight-output-delivered/fix.diff
"""

import pytest

from vllm.v1.kv_cache_interface import RSWASpec

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_failed_load_serialized_repair_misses_preempted_sharer(tmp_path):
    layers = {"layer0": attention(RSWASpec, 16, rswa_window=1)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=12,
        block_size=16,
        max_num_batched_tokens=19,
        max_model_len=176,
        async_scheduling=True,
        prefix_caching=True,
        load_failure_policy="recompute",
        num_speculative_tokens=1,
    )
    scheduler.connector.offers["r0"] = 16
    scheduler.add_request(request("r0", 32, 1))
    scheduler.add_request(request("r1", 33, 1))
    s0 = scheduler.schedule()
    ids0 = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    req = scheduler.requests["r1"]  # preempted as schedule() does
    scheduler.running.remove(req)
    scheduler._preempt_request(
        req, 0.0, drop_stale_output=scheduler.requires_kv_delivery
    )
    req = scheduler.requests["r1"]  # held: it may finish
    before = req.num_output_tokens
    scheduler.update_from_output(s0, output(s0, {"r0": 1, "r1": 2}, failed=[ids0[0]]))
    assert req.num_output_tokens == before, (
        "r1's output of step 0 counts (it took the sampled token), but "
        "step 0 read r1's logical block 0 (positions [0, 16)), whose "
        "connector load failed in that same output"
    )
