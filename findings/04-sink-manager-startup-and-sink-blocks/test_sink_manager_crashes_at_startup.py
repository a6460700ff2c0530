# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sink manager crashes at startup, then hands out sink blocks.

Found by kvcheck on vllm@0.33.0 (its trace:
sink-manager-crashes-at-startup.json); these calls, replayed on vllm 0.33.0:
vLLM raises TypeError: SinkFullAttentionManager.__init__() got an unexpected
keyword argument 'needs_kv_cache_zeroing'
Passes with findings/04-sink-manager-startup-and-sink-blocks/fix.diff
applied.
"""

import pytest

from vllm.v1.kv_cache_interface import SinkFullAttentionSpec

from kvcheck_utils import attention, build

pytestmark = pytest.mark.cpu_test


def test_sink_manager_crashes_at_startup(tmp_path):
    layers = {"layer0": attention(SinkFullAttentionSpec, 16, sink_len=16)}
    try:
        build(
            tmp_path,
            layers,
            num_blocks=7,
            block_size=16,
            max_num_batched_tokens=16,
            max_model_len=96,
            async_scheduling=True,
        )
        error = None
    except TypeError as e:
        error = e
    assert error is None, f"vLLM raised {type(error).__name__}: {error}"
