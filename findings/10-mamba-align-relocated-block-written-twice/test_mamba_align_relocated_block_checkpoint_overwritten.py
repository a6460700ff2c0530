# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A relocated Mamba block written at two slots.

Found by kvcheck on vllm@0.33.0 (its trace:
mamba-align-relocated-block-checkpoint-overwritten.json); these calls,
replayed on vllm 0.33.0: property 2 (null-read): step 5 computes r1
positions [13, 18) from the Mamba state after position 12, which step 4 left
at slot 6 (block 5, mamba), but step 4's postprocess copied the state after
11 there: the block names two slots of the worker's table
Passes with findings/10-mamba-align-relocated-block-written-twice/fix.diff
applied.
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from kvcheck_utils import attention, build, output, propose, worker_block_ids

pytestmark = pytest.mark.cpu_test


def test_mamba_align_relocated_block_checkpoint_overwritten(tmp_path):
    layers = {
        "layer0": MambaSpec(
            block_size=4,
            shapes=((8,),),
            dtypes=(torch.float32,),
            page_size_padded=256,
            mamba_cache_mode="align",
            num_speculative_blocks=4,
        ),
        "draft": attention(FullAttentionSpec, 4),
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=21,
        block_size=4,
        max_num_batched_tokens=5,
        max_model_len=32,
        prefix_caching=True,
        mamba_cache_mode="align",
        num_speculative_tokens=4,
        drafter="mtp",
    )
    scheduler.add_request(request("r0", 1, 1))
    s0 = scheduler.schedule()
    scheduler.add_request(request("r1", 8, 7))
    scheduler.update_from_output(s0, output(s0, {"r0": 1}))
    s1 = scheduler.schedule()
    scheduler.update_from_output(s1, output(s1, {}))
    propose(scheduler, ["r1"])
    s2 = scheduler.schedule()
    scheduler.update_from_output(s2, output(s2, {"r1": 1}))
    propose(scheduler, ["r1"])
    s3 = scheduler.schedule()
    scheduler.update_from_output(s3, output(s3, {"r1": 1}))
    propose(scheduler, ["r1"])
    s4 = scheduler.schedule()
    scheduler.update_from_output(s4, output(s4, {"r1": 4}))
    propose(scheduler, ["r1"])
    s5 = scheduler.schedule()
    table = worker_block_ids([s0, s1, s2, s3, s4, s5], "r1")[0]
    shared = len(table or ()) > 6 and table[6] == table[2] != 0
    assert not shared, (
        "step 5 starts r1 from the Mamba state after position 12 at slot "
        f"6 of its block table, block {table[6]}, which the table also "
        "names at slot 2, where step 4's postprocess copied the state "
        "after position 11"
    )
