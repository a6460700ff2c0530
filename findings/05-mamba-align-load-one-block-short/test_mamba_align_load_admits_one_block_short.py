# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mamba align load admitted one block short.

Found by kvcheck on vllm@0.33.0 (its trace:
mamba-align-load-admits-one-block-short.json); these calls, replayed on vllm
0.33.0: vLLM raises ValueError: Cannot get 1 free blocks from the pool
Passes with findings/05-mamba-align-load-one-block-short/fix.diff applied.
"""

import pytest
import torch

from vllm.v1.kv_cache_interface import MambaSpec

from kvcheck_utils import build, output

pytestmark = pytest.mark.cpu_test


def test_mamba_align_load_admits_one_block_short(tmp_path):
    layers = {
        "layer0": MambaSpec(
            block_size=8,
            shapes=((8,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        )
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=6,
        block_size=8,
        max_num_batched_tokens=8,
        max_model_len=256,
        async_scheduling=True,
        prefix_caching=True,
        load_failure_policy="recompute",
        mamba_cache_mode="align",
    )
    scheduler.connector.offers["r0"] = 16
    scheduler.add_request(request("r0", 17, 1))
    s0 = scheduler.schedule()
    scheduler.update_from_output(s0, output(s0, {"r0": 1}))
    scheduler.add_request(request("r1", 1, 1))
    scheduler.add_request(request("r2", 1, 1))
    scheduler.add_request(request("r3", 17, 1))
    scheduler.connector.offers["r4"] = 8
    scheduler.add_request(request("r4", 9, 1))
    try:
        scheduler.schedule()
        error = None
    except ValueError as e:
        error = e
    assert error is None, f"vLLM raised {type(error).__name__}: {error}"
