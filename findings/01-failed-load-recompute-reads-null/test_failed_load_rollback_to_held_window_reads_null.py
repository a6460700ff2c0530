# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A failed load recomputes from a window never allocated.

Found by kvcheck on vllm@0.33.0 with
findings/fixes/failed-load-rolls-back-to-held-window.diff applied (its
trace: failed-load-rollback-to-held-window-reads-null.json); these calls,
replayed on that tree: property 2 (null-read): step 1 (scheduled) computes
r0 positions [0, 16); position 0 reads [0, 0] (sliding(W=2)) but logical
block 0 maps to the NULL block
Passes with these diffs applied in turn:
    findings/01-failed-load-recompute-reads-null/fix.diff
    findings/02-failed-load-blocks-stay-cached/fix.diff
    findings/03-failed-load-in-flight-output-delivered/fix.diff
"""

import pytest

from vllm.v1.kv_cache_interface import SlidingWindowSpec

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_failed_load_rollback_to_held_window_reads_null(tmp_path):
    layers = {"layer0": attention(SlidingWindowSpec, 16, sliding_window=2)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=6,
        block_size=16,
        max_num_batched_tokens=16,
        max_model_len=512,
        load_failure_policy="recompute",
    )
    tables = scheduler.kv_cache_manager.coordinator.single_type_managers
    scheduler.connector.offers["r0"] = 32
    scheduler.add_request(request("r0", 34, 1))
    s0 = scheduler.schedule()
    ids0 = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    scheduler.update_from_output(s0, output(s0, {"r0": 1}, failed=[ids0[1]]))
    s1 = scheduler.schedule()
    start = None  # step 1 computes r0's [start, end)
    if "r0" in s1.num_scheduled_tokens:
        end = scheduler.requests["r0"].num_computed_tokens
        start = end - s1.num_scheduled_tokens["r0"]
    table = tables[0].req_to_blocks.get("r0", [])
    read = set() if start is None else {q // 16 for q in range(max(0, start - 1), end)}
    null = sorted(lg for lg in read if table[lg].is_null)
    assert not null, (
        f"step 1 computes r0's positions [{start}, {end}), whose windows "
        f"read logical block(s) {null}: r0's block table maps them to the "
        "NULL block"
    )
