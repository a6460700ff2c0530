# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""sliding-mtp-hit-lookup-past-hashes: a kvcheck trace replayed on vLLM's
scheduler.

Found by kvcheck on vllm@0.33.0; replayed on vllm 0.33.0: target crash:
IndexError: list index out of range
Passes with findings/07-sliding-mtp-hit-lookup-past-hashes/fix.diff applied.

Config: sliding(W=16, R=1) B=16 blocks=12 depth=2 spec=2 policy=settled
hazard=ordered prefix-caching drafter=mtp
Written by `./kvcheck export TRACE --vllm-test OUT.py` from the trace;
kvcheck_replay.Replay (beside it) replays the calls and asserts on vLLM's
objects at every step (its docstring says what). Needs vLLM (0.33 line) and
pytest only.
"""

import pytest
from kvcheck_replay import Replay, make_scheduler

pytestmark = pytest.mark.cpu_test

CONFIG = {
    "groups": [{"kind": "sliding", "param": 16}],
    "block_size": 16,
    "num_blocks": 12,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 4,
    "max_model_len": 128,
    "spec_tokens": 2,
    "depth": 2,
    "policy": "settled",
    "hazard": "ordered",
    "prefix_caching": True,
    "drafter": "mtp",
}
EVENTS = [
    (
        "add",
        "r0",
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
        4,
        0,
    ),
    ("schedule",),
]


def test_sliding_mtp_hit_lookup_past_hashes(tmp_path):
    sched, hasher = make_scheduler(CONFIG, tmp_path)
    failure = Replay(CONFIG, sched, hasher).run(EVENTS)
    assert failure is None, failure
