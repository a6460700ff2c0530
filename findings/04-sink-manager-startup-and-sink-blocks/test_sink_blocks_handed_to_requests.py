# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sink manager crashes at startup, then hands out sink blocks.

Found by kvcheck on vllm@0.33.0 with
findings/fixes/sink-manager-takes-kwargs.diff applied (its trace:
sink-blocks-handed-to-requests.json); these calls, replayed on that tree:
property 2 (null-read): step 0 (scheduled) computes r0 positions [0, 1);
every position reads the sink (sink(S=16), physical blocks 1) but block 1
holds, at sink token 0, KV of prompt position 0 (written by step 0 for r0),
not the sink token 0
Passes with findings/04-sink-manager-startup-and-sink-blocks/fix.diff
applied.
"""

import pytest

from vllm.v1.kv_cache_interface import SinkFullAttentionSpec

from kvcheck_utils import attention, build

pytestmark = pytest.mark.cpu_test


def test_sink_blocks_handed_to_requests(tmp_path):
    layers = {"layer0": attention(SinkFullAttentionSpec, 16, sink_len=16)}
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=7,
        block_size=16,
        max_num_batched_tokens=16,
        max_model_len=96,
        async_scheduling=True,
    )
    scheduler.add_request(request("r0", 1, 1))
    scheduler.schedule()
    table = scheduler.kv_cache_manager.get_block_ids("r0")[0]  # as step 0 writes
    handed = sorted(set(table) & set(range(1, 2)))
    assert not handed, (
        f"step 0 writes r0's KV into its block(s) {handed}, where the "
        "sink's attention keeps the sink's KV (physical block 1), which "
        "every step reads (step 0 for r0)"
    )
