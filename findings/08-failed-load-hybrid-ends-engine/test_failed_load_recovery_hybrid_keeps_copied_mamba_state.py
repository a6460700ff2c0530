# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""failed-load-recovery-hybrid-keeps-copied-mamba-state: a kvcheck trace
replayed on vLLM's scheduler.

Found by kvcheck on vllm@0.33.0 with
findings/fixes/failed-load-recovery-hybrid.diff applied; replayed on that
tree: property 2 (null-read): step 8 (scheduled) computes r1 positions [6,
8); position 6 reads [5, 6] (mamba) but block 23 (logical 1) holds no valid
KV for positions [5, 6): a connector load into it failed and nothing
computed them again
Passes with findings/08-failed-load-hybrid-ends-engine/fix.diff applied.

Config: full+mamba B=4 blocks=26 depth=3 spec=0 policy=settled
hazard=unordered prefix-caching prefix-match-unit=1
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
    "block_size": 4,
    "num_blocks": 26,
    "max_num_batched_tokens": 25,
    "max_num_seqs": 4,
    "max_model_len": 32,
    "spec_tokens": 0,
    "depth": 3,
    "policy": "settled",
    "hazard": "unordered",
    "prefix_caching": True,
    "prefix_match_unit": 1,
}
EVENTS = [
    (
        "add",
        "r0",
        [32001, 7936, 15855, 23774, 31693, 7612, 15531, 23450, 31369, 7288, 15207],
        8,
        0,
    ),
    ("add", "r1", [32001, 7936, 15855, 23774, 31693, 7612, 15531], 4, 4),
    ("add", "r2", [17, 7936, 15855, 23774], 1, 0),
    ("schedule",),
    ("schedule",),
    ("schedule",),
    ("fail_load", "r1", 0),
    ("process", {}),
    ("reset",),
    ("schedule",),
    ("process", {}),
    ("process", {}),
    ("add", "r3", [17, 7936, 15855, 23774], 1, 0),
    ("schedule",),
    ("schedule",),
    ("process", {}),
    ("schedule",),
    ("process", {}),
    ("schedule",),
    ("process", {}),
    (
        "add",
        "r4",
        [
            32001,
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
            6640,
            14559,
            22478,
            30397,
            6316,
            14235,
        ],
        1,
        4,
    ),
    ("reset",),
    ("schedule",),
    ("finish", "r4"),
    ("process", {}),
    ("process", {}),
    ("schedule",),
]


def test_failed_load_recovery_hybrid_keeps_copied_mamba_state(tmp_path):
    sched, hasher = make_scheduler(CONFIG, tmp_path)
    failure = Replay(CONFIG, sched, hasher).run(EVENTS)
    assert failure is None, failure
