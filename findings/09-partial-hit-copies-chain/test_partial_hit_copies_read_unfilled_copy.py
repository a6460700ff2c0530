# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chained copies read a block not yet filled.

Found by kvcheck on vllm@0.33.0 (its trace:
partial-hit-copies-read-unfilled-copy.json); these calls, replayed on vllm
0.33.0: property 2 (null-read): step 2 (scheduled) computes r2 positions [8,
16); position 8 reads [0, 8] (full) but block 6 (logical 0) holds, at
position 0, no KV: it is a copy of block 4, which held nothing when the
copies before this step ran (a block handed out afresh, or one another copy
of the same step was to fill)
Passes with findings/09-partial-hit-copies-chain/fix.diff applied.
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_partial_hit_copies_read_unfilled_copy(tmp_path):
    layers = {
        "layer0": attention(FullAttentionSpec, 16),
        "layer1": MambaSpec(
            block_size=16,
            shapes=((8,),),
            dtypes=(torch.float32,),
            page_size_padded=1024,
            mamba_cache_mode="align",
        ),
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=17,
        block_size=16,
        max_num_batched_tokens=16,
        max_model_len=128,
        async_scheduling=True,
        prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=8,
    )
    scheduler.add_request(request("r0", 9, 1))
    s0 = scheduler.schedule()
    scheduler.schedule()
    scheduler.add_request(request("r1", 16, 1))
    scheduler.add_request(request("r2", 17, 1))
    scheduler.update_from_output(s0, output(s0, {}))
    s2 = scheduler.schedule()
    copies = s2.kv_cache_block_copies or []
    filled = {c.dst_block_id for c in copies}
    chained = [tuple(c) for c in copies if c.src_block_id in filled]
    assert not chained, (
        f"step 2 copies (source, destination) {chained} whose source "
        "another copy of the same step fills: the worker runs the copies "
        "as one gather, then one scatter, so r2's logical block 0, read "
        "by step 2, gets what its source held before: nothing"
    )
