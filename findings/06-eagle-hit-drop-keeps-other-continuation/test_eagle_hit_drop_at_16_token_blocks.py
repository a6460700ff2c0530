# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EAGLE's hit drop keeps another continuation's block.

Found by kvcheck on vllm@0.33.0 (its trace:
eagle-hit-drop-at-16-token-blocks.json); these calls, replayed on vllm
0.33.0: property 2 (null-read): step 2 (scheduled) computes r2 positions
[16, 20); position 16 reads [0, 16] (full) but block 1 (logical 0) holds, at
position 15 (its EAGLE draft KV, built with the next token), KV of position
16 of a 16-token prompt and its outputs (written by step 0 for r0), not r2's
prompt position 16
Passes with findings/06-eagle-hit-drop-keeps-other-continuation/fix.diff
applied.
"""

import pytest

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvcheck_utils import attention, build, output, worker_block_ids

pytestmark = pytest.mark.cpu_test


def test_eagle_hit_drop_at_16_token_blocks(tmp_path):
    layers = {
        "layer0": attention(FullAttentionSpec, 16),
        "draft": attention(FullAttentionSpec, 16),
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=9,
        block_size=16,
        max_num_batched_tokens=18,
        max_model_len=128,
        async_scheduling=True,
        prefix_caching=True,
        load_failure_policy="recompute",
        num_speculative_tokens=1,
        drafter="eagle",
    )
    scheduler.add_request(request("r0", 16, 1))
    s0 = scheduler.schedule()
    scheduler.update_from_output(s0, output(s0, {"r0": 1}))
    scheduler.add_request(request("r1", 32, 1))
    s1 = scheduler.schedule()
    scheduler.add_request(request("r2", 33, 1))
    s2 = scheduler.schedule()
    mine = worker_block_ids([s0, s1, s2], "r2")[0]
    theirs = worker_block_ids([s0], "r0")[0]
    shared = len(mine) > 0 and len(theirs) > 0 and mine[0] == theirs[0]
    assert not shared, (
        f"step 2 reads block {mine[0]} as r2's prefix (logical block 0), "
        "which step 0 wrote for r0: its EAGLE draft KV at position 15 is "
        "built with the token at position 16, the token step 0 samples "
        "for r0, not r2's prompt token 16"
    )
