# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A failed load recomputes from a window never allocated.

Found by kvcheck on vllm@0.33.0 with
findings/fixes/failed-load-recovery-preempted-sharers.diff and
findings/05-mamba-align-load-one-block-short/fix.diff applied (its trace:
failed-load-recovery-mamba-recomputes-into-null.json); these calls, replayed
on that tree: property 2 (null-read): step 2 (scheduled) computes r1
positions [0, 8); position 4 reads [3, 4] (mamba) but logical block 1 maps
to the NULL block
Passes with these diffs applied in turn:
    findings/01-failed-load-recompute-reads-null/fix.diff
    findings/02-failed-load-blocks-stay-cached/fix.diff
    findings/03-failed-load-in-flight-output-delivered/fix.diff
    findings/05-mamba-align-load-one-block-short/fix.diff
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import MambaSpec

from kvcheck_utils import build, output

pytestmark = pytest.mark.cpu_test


def test_failed_load_recovery_mamba_recomputes_into_null(tmp_path):
    layers = {
        "layer0": MambaSpec(
            block_size=4,
            shapes=((8,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        )
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=9,
        block_size=4,
        max_num_batched_tokens=8,
        max_model_len=32,
        async_scheduling=True,
        prefix_caching=True,
        load_failure_policy="recompute",
        mamba_cache_mode="align",
    )
    tables = scheduler.kv_cache_manager.coordinator.single_type_managers
    scheduler.add_request(request("r0", 1, 1))
    s0 = scheduler.schedule()
    scheduler.update_from_output(s0, output(s0, {"r0": 1}))
    scheduler.connector.offers["r1"] = 4
    scheduler.add_request(request("r1", 13, 1))
    s1 = scheduler.schedule()
    ids1 = scheduler.kv_cache_manager.get_block_ids("r1")[0]
    scheduler.update_from_output(s1, output(s1, {}, failed=[ids1[0]]))
    s2 = scheduler.schedule()
    start = None  # step 2 computes r1's [start, end)
    if "r1" in s2.num_scheduled_tokens:
        end = scheduler.requests["r1"].num_computed_tokens
        start = end - s2.num_scheduled_tokens["r1"]
    table = tables[0].req_to_blocks.get("r1", [])
    read = (
        set()
        if start is None
        else {(end - 1) // 4} | ({(start - 1) // 4} if start else set())
    )
    null = sorted(lg for lg in read if table[lg].is_null)
    assert not null, (
        f"step 2 computes r1's positions [{start}, {end}), whose Mamba "
        f"state is read from or written to logical block(s) {null}: r1's "
        "block table maps them to the NULL block"
    )
