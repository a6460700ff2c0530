# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba align prefill stalls at the MTP lookahead.

Found by kvcheck on vllm@0.33.0 (its trace:
mamba-align-mtp-lookahead-stalls-prefill.json); these calls, replayed on
vllm 0.33.0: property 7 (progress): nothing is in flight and schedule()
scheduled nothing 2 times in a row, while r0 have not finished
Passes with findings/11-mamba-align-mtp-stalls-prefill/fix.diff applied.
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from kvcheck_utils import attention, build, output, propose

pytestmark = pytest.mark.cpu_test


def test_mamba_align_mtp_lookahead_stalls_prefill(tmp_path):
    layers = {
        "layer0": attention(FullAttentionSpec, 16),
        "draft": attention(FullAttentionSpec, 16),
        "layer2": MambaSpec(
            block_size=16,
            shapes=((8,),),
            dtypes=(torch.float32,),
            page_size_padded=1024,
            mamba_cache_mode="align",
            num_speculative_blocks=2,
        ),
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=40,
        block_size=16,
        max_num_batched_tokens=16,
        max_model_len=64,
        prefix_caching=True,
        mamba_cache_mode="align",
        num_speculative_tokens=2,
        drafter="mtp",
    )
    scheduler.add_request(request("r0", 17, 2))
    s0 = scheduler.schedule()
    scheduler.update_from_output(s0, output(s0, {}))
    propose(scheduler, ["r0"])
    outs = [scheduler.schedule() for _ in range(2)]
    req = scheduler.requests["r0"]
    assert any(o.total_num_scheduled_tokens for o in outs), (
        "nothing is in flight and schedule() scheduled nothing 2 times "
        f"in a row, while r0 has {req.num_computed_tokens} of "
        f"{req.num_tokens} tokens computed ({req.status.name})"
    )
