# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sink-blocks-handed-to-requests: a kvcheck trace replayed on vLLM's
scheduler.

Found by kvcheck on vllm@0.33.0 with
findings/fixes/sink-manager-takes-kwargs.diff applied; replayed on that
tree: property 2 (null-read): step 0 (scheduled) computes r0 positions [0,
1); every position reads the sink (sink(S=16), physical blocks 1) but block
1 holds, at sink token 0, KV of prompt position 0 (written by step 0 for
r0), not the sink token 0
Passes with findings/04-sink-manager-startup-and-sink-blocks/fix.diff
applied.

Config: sink(S=16) B=16 blocks=7 depth=2 spec=0 policy=settled
hazard=ordered
Written by `./kvcheck export TRACE --vllm-test OUT.py` from the trace;
kvcheck_replay.Replay (beside it) replays the calls and asserts on vLLM's
objects at every step (its docstring says what). Needs vLLM (0.33 line) and
pytest only.
"""

import pytest
from kvcheck_replay import Replay, make_scheduler

pytestmark = pytest.mark.cpu_test

CONFIG = {
    "groups": [{"kind": "sink", "param": 16}],
    "block_size": 16,
    "num_blocks": 7,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "max_model_len": 96,
    "spec_tokens": 0,
    "depth": 2,
    "policy": "settled",
    "hazard": "ordered",
    "prefix_caching": False,
}
EVENTS = [("add", "r0", [17], 1, 0), ("schedule",)]


def test_sink_blocks_handed_to_requests(tmp_path):
    sched, hasher = make_scheduler(CONFIG, tmp_path)
    failure = Replay(CONFIG, sched, hasher).run(EVENTS)
    assert failure is None, failure
