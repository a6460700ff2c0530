# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chained copies read a block not yet filled.

Found by kvcheck on vllm@0.33.0 (its trace:
partial-hit-copies-chain-qwen3-next-blocks.json); these calls, replayed on
vllm 0.33.0: property 2 (null-read): step 2 (scheduled) computes r2
positions [272, 544); position 272 reads [0, 272] (full) but block 5
(logical 0) holds, at position 0, no KV: it is a copy of block 2, which held
nothing when the copies before this step ran (a block handed out afresh, or
one another copy of the same step was to fill)
Passes with findings/09-partial-hit-copies-chain/fix.diff applied.
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_partial_hit_copies_chain_qwen3_next_blocks(tmp_path):
    layers = {
        "layer0": attention(FullAttentionSpec, 544),
        "layer1": MambaSpec(
            block_size=544,
            shapes=((8,),),
            dtypes=(torch.float32,),
            page_size_padded=34816,
            mamba_cache_mode="align",
        ),
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=17,
        block_size=544,
        max_num_batched_tokens=544,
        max_model_len=4352,
        prefix_caching=True,
        mamba_cache_mode="align",
        prefix_match_unit=272,
    )
    scheduler.add_request(request("r0", 273, 1))
    scheduler.add_request(request("r1", 544, 1))
    s0 = scheduler.schedule()
    scheduler.add_request(request("r2", 545, 1))
    scheduler.update_from_output(s0, output(s0, {}))
    s1 = scheduler.schedule()
    scheduler.update_from_output(s1, output(s1, {"r0": 1}))
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
