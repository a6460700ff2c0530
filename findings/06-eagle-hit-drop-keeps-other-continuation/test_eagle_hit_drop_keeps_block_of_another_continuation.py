# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EAGLE's hit drop keeps another continuation's block.

Found by kvcheck on vllm@0.33.0 (its trace:
eagle-hit-drop-keeps-block-of-another-continuation.json); these calls,
replayed on vllm 0.33.0: property 2 (null-read): step 1 (scheduled) computes
r2 positions [4, 8); position 4 reads [0, 4] (full) but block 1 (logical 0)
holds, at position 3 (its EAGLE draft KV, built with the next token), KV of
position 4 of a 4-token prompt and its outputs (written by step 0 for r0),
not r2's prompt position 4
Passes with findings/06-eagle-hit-drop-keeps-other-continuation/fix.diff
applied.
"""

import pytest

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvcheck_utils import attention, build, worker_block_ids

pytestmark = pytest.mark.cpu_test


def test_eagle_hit_drop_keeps_block_of_another_continuation(tmp_path):
    layers = {
        "layer0": attention(FullAttentionSpec, 4),
        "draft": attention(FullAttentionSpec, 4),
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
        num_speculative_tokens=1,
        drafter="eagle",
    )
    scheduler.add_request(request("r0", 4, 1))
    scheduler.add_request(request("r1", 8, 1))
    s0 = scheduler.schedule()
    scheduler.add_request(request("r2", 9, 1))
    s1 = scheduler.schedule()
    mine = worker_block_ids([s0, s1], "r2")[0]
    theirs = worker_block_ids([s0], "r0")[0]
    shared = len(mine) > 0 and len(theirs) > 0 and mine[0] == theirs[0]
    assert not shared, (
        f"step 1 reads block {mine[0]} as r2's prefix (logical block 0), "
        "which step 0 wrote for r0: its EAGLE draft KV at position 3 is "
        "built with the token at position 4, the token step 0 samples "
        "for r0, not r2's prompt token 4"
    )
