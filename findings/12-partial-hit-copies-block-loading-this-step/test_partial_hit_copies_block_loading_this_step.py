# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A hit inside a block copies a block still loading.

Found by kvcheck on vllm@0.33.0 (its trace:
partial-hit-copies-block-loading-this-step.json); these calls, replayed on
vllm 0.33.0: property 2 (null-read): step 1 (scheduled) computes r2
positions [4, 8); position 4 reads [0, 4] (full) but block 7 (logical 0)
holds, at position 0, no KV: it is a copy of block 3, which held nothing
when the copies before this step ran (a block handed out afresh, or one
another copy of the same step was to fill)
Passes with findings/12-partial-hit-copies-block-loading-this-step/fix.diff
applied.
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import RequestStatus

from kvcheck_utils import attention, build

pytestmark = pytest.mark.cpu_test


def test_partial_hit_copies_block_loading_this_step(tmp_path):
    layers = {
        "layer0": attention(FullAttentionSpec, 8),
        "layer1": MambaSpec(
            block_size=8,
            shapes=((8,),),
            dtypes=(torch.float32,),
            page_size_padded=512,
            mamba_cache_mode="align",
        ),
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=20,
        block_size=8,
        max_num_batched_tokens=12,
        max_model_len=64,
        async_scheduling=True,
        prefix_caching=True,
        load_failure_policy="recompute",
        mamba_cache_mode="align",
        prefix_match_unit=4,
    )
    scheduler.add_request(request("r0", 5, 1))
    scheduler.schedule()
    scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    scheduler.connector.offers["r1"] = 8
    scheduler.add_request(request("r1", 17, 1))
    scheduler.add_request(request("r2", 9, 1))
    s1 = scheduler.schedule()
    copies = s1.kv_cache_block_copies or []
    loads = s1.kv_connector_metadata.blocks
    loading = {b for ids in loads.values() for group in ids for b in group}
    early = [tuple(c) for c in copies if c.src_block_id in loading]
    assert not early, (
        f"step 1 copies (source, destination) {early} whose source its "
        "connector loads in the same step: the model runner runs "
        "kv_cache_block_copies before start_load_kv, so r2's logical "
        "block 0, read by step 1, gets what its source held before the "
        "load: nothing"
    )
