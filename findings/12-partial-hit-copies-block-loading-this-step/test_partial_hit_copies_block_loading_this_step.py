# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""partial-hit-copies-block-loading-this-step: a kvcheck trace replayed on
vLLM's scheduler.

Found by kvcheck on vllm@0.33.0; replayed on vllm 0.33.0: property 2
(null-read): step 1 (scheduled) computes r2 positions [4, 8); position 4
reads [0, 4] (full) but block 7 (logical 0) holds, at position 0, no KV: it
is a copy of block 3, which held nothing when the copies before this step
ran (a block handed out afresh, or one another copy of the same step was to
fill)
Passes with findings/12-partial-hit-copies-block-loading-this-step/fix.diff
applied.

Config: full+mamba B=8 blocks=20 depth=2 spec=0 policy=settled
hazard=unordered prefix-caching prefix-match-unit=4
Written by `./kvcheck export TRACE --vllm-test OUT.py` from the trace;
kvcheck_replay.Replay (beside it) replays the calls and asserts on vLLM's
objects at every step (its docstring says what). Needs vLLM (0.33 line) and
pytest only.
"""

import pytest
from kvcheck_replay import Replay, make_scheduler

pytestmark = pytest.mark.cpu_test

CONFIG = {
    "groups": [{"kind": "full"}, {"kind": "mamba"}],
    "block_size": 8,
    "num_blocks": 20,
    "max_num_batched_tokens": 12,
    "max_num_seqs": 4,
    "max_model_len": 64,
    "spec_tokens": 0,
    "depth": 2,
    "policy": "settled",
    "hazard": "unordered",
    "prefix_caching": True,
    "prefix_match_unit": 4,
}
EVENTS = [
    ("add", "r0", [17, 7936, 15855, 23774, 31693], 1, 0),
    ("schedule",),
    ("abort", "r0"),
    (
        "add",
        "r1",
        [
            17,
            7936,
            15855,
            23774,
            31693,
            7612,
            15531,
            23450,
            31369,
            7288,
            15207,
            23126,
            31045,
            6964,
            14883,
            22802,
            30721,
        ],
        1,
        8,
    ),
    ("add", "r2", [17, 7936, 15855, 23774, 31693, 7612, 15531, 23450, 31369], 1, 0),
    ("schedule",),
]


def test_partial_hit_copies_block_loading_this_step(tmp_path):
    sched, hasher = make_scheduler(CONFIG, tmp_path)
    failure = Replay(CONFIG, sched, hasher).run(EVENTS)
    assert failure is None, failure
