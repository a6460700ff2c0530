# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A failed load on a hybrid model ends the engine.

Found by kvcheck on vllm@0.33.0 (its trace:
failed-load-hybrid-crashes-0.33.0.json); these calls, replayed on vllm
0.33.0: vLLM raises RuntimeError: A KV connector reported block-level load
failures (invalid_block_ids) which is not supported for models with multiple
KV cache groups. Connectors must report failed requests via
KVConnectorTransferResults.failed_recving instead.
Passes with findings/08-failed-load-hybrid-ends-engine/fix.diff applied.
"""

import pytest

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvcheck_utils import attention, build, output

pytestmark = pytest.mark.cpu_test


def test_failed_load_hybrid_crashes_0_33_0(tmp_path):
    layers = {
        "layer0": attention(FullAttentionSpec, 16),
        "layer1": attention(SlidingWindowSpec, 16, sliding_window=4),
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=24,
        block_size=16,
        max_num_batched_tokens=64,
        max_model_len=128,
        async_scheduling=True,
        load_failure_policy="recompute",
    )
    scheduler.connector.offers["r0"] = 32
    scheduler.add_request(request("r0", 40, 2))
    s0 = scheduler.schedule()
    ids0 = scheduler.kv_cache_manager.get_block_ids("r0")[0]
    try:
        scheduler.update_from_output(s0, output(s0, {"r0": 1}, failed=[ids0[1]]))
        error = None
    except RuntimeError as e:
        error = e
    assert error is None, f"vLLM raised {type(error).__name__}: {error}"
