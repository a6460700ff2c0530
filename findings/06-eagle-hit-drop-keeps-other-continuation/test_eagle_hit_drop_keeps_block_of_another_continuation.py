# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""eagle-hit-drop-keeps-block-of-another-continuation: a kvcheck trace replayed
on vLLM's scheduler.

Found by kvcheck on vllm@0.33.0; replayed on vllm 0.33.0: property 2
(null-read): step 1 (scheduled) computes r2 positions [4, 8); position 4
reads [0, 4] (full) but block 1 (logical 0) holds, at position 3 (its EAGLE
draft KV, built with the next token), KV of position 4 of a 4-token prompt
and its outputs (written by step 0 for r0), not r2's prompt position 4
Passes with findings/06-eagle-hit-drop-keeps-other-continuation/fix.diff
applied.

Config: full B=4 blocks=9 depth=2 spec=1 policy=settled hazard=unordered
prefix-caching drafter=eagle
Written by `./kvcheck export TRACE --vllm-test OUT.py` from the trace;
kvcheck_replay.Replay (beside it) replays the calls and asserts on vLLM's
objects at every step (its docstring says what). Needs vLLM (0.33 line) and
pytest only.
"""

import pytest
from kvcheck_replay import Replay, make_scheduler

pytestmark = pytest.mark.cpu_test

CONFIG = {
    "groups": [{"kind": "full"}],
    "block_size": 4,
    "num_blocks": 9,
    "max_num_batched_tokens": 8,
    "max_num_seqs": 4,
    "max_model_len": 32,
    "spec_tokens": 1,
    "depth": 2,
    "policy": "settled",
    "hazard": "unordered",
    "prefix_caching": True,
    "drafter": "eagle",
}
EVENTS = [
    ("add", "r0", [17, 7936, 15855, 23774], 1, 0),
    ("add", "r1", [17, 7936, 15855, 23774, 31693, 7612, 15531, 23450], 1, 0),
    ("schedule",),
    ("add", "r2", [17, 7936, 15855, 23774, 31693, 7612, 15531, 23450, 31369], 1, 0),
    ("schedule",),
]


def test_eagle_hit_drop_keeps_block_of_another_continuation(tmp_path):
    sched, hasher = make_scheduler(CONFIG, tmp_path)
    failure = Replay(CONFIG, sched, hasher).run(EVENTS)
    assert failure is None, failure
