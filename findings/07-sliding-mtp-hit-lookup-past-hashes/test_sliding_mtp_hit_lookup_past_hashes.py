# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A sliding hit lookup with an MTP drafter indexes past the hashes.

Found by kvcheck on vllm@0.33.0 (its trace:
sliding-mtp-hit-lookup-past-hashes.json); these calls, replayed on vllm
0.33.0: vLLM raises IndexError: list index out of range
Passes with findings/07-sliding-mtp-hit-lookup-past-hashes/fix.diff applied.
"""

import pytest

from vllm.v1.kv_cache_interface import SlidingWindowSpec

from kvcheck_utils import attention, build

pytestmark = pytest.mark.cpu_test


def test_sliding_mtp_hit_lookup_past_hashes(tmp_path):
    layers = {
        "layer0": attention(SlidingWindowSpec, 16, sliding_window=16),
        "draft": attention(SlidingWindowSpec, 16, sliding_window=16),
    }
    scheduler, request = build(
        tmp_path,
        layers,
        num_blocks=12,
        block_size=16,
        max_num_batched_tokens=32,
        max_model_len=128,
        async_scheduling=True,
        prefix_caching=True,
        num_speculative_tokens=2,
        drafter="mtp",
    )
    scheduler.add_request(request("r0", 17, 4))
    try:
        scheduler.schedule()
        error = None
    except IndexError as e:
        error = e
    assert error is None, f"vLLM raised {type(error).__name__}: {error}"
