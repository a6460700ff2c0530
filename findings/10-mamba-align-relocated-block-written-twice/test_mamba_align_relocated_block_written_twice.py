# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A relocated Mamba block written at two slots.

Found by kvcheck on vllm@0.33.0 (its trace:
mamba-align-relocated-block-written-twice.json); these calls, replayed on
vllm 0.33.0: property 2 (null-read): step 2 (shifted down 4 by rejection)
computes r0 positions [4, 9) and writes the Mamba states after positions 4
and 8 (mamba) into one block, 3, named at slots 2 and 6 of the worker's
table: the next step starts from the first if 0 draft(s) are accepted, and
it holds the second
Passes with findings/10-mamba-align-relocated-block-written-twice/fix.diff
applied.
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import MambaSpec

from kvcheck_utils import build, output, worker_block_ids

pytestmark = pytest.mark.cpu_test


def test_mamba_align_relocated_block_written_twice(tmp_path):
    layers = {
        "layer0": MambaSpec(
            block_size=4,
            shapes=((8,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=4,
        )
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=13,
        block_size=4,
        max_num_batched_tokens=5,
        max_model_len=32,
        async_scheduling=True,
        prefix_caching=True,
        mamba_cache_mode="align",
        num_speculative_tokens=4,
    )
    scheduler.add_request(request("r0", 3, 3))
    s0 = scheduler.schedule()
    s1 = scheduler.schedule()
    scheduler.update_from_output(s0, output(s0, {"r0": 1}))
    s2 = scheduler.schedule()
    table = worker_block_ids([s0, s1, s2], "r0")[0]
    scheduler.update_from_output(s1, output(s1, {"r0": 1}))
    clash = len(table or ()) > 6 and table[2] == table[6] != 0
    assert not clash, (
        "step 2 writes r0's Mamba states after positions 4 and 8 into "
        f"slots 2 and 6 of its block table, both block {table[2]}: the "
        "next step starts from the first if 0 draft(s) are accepted, and "
        "the block holds the second"
    )
