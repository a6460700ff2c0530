# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""mamba-align-mtp-lookahead-stalls-prefill: a kvcheck trace replayed on vLLM's
scheduler.

Found by kvcheck on vllm@0.33.0; replayed on vllm 0.33.0: property 7
(progress): nothing is in flight and schedule() scheduled nothing 2 times in
a row, while r0 have not finished
Passes with findings/11-mamba-align-mtp-stalls-prefill/fix.diff applied.

Config: full+full(draft)+mamba B=16 blocks=40 depth=1 spec=2 policy=settled
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
    "groups": [{"kind": "full"}, {"kind": "full", "draft": True}, {"kind": "mamba"}],
    "block_size": 16,
    "num_blocks": 40,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "max_model_len": 64,
    "spec_tokens": 2,
    "depth": 1,
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
        2,
        0,
    ),
    ("drain",),
]


def test_mamba_align_mtp_lookahead_stalls_prefill(tmp_path):
    sched, hasher = make_scheduler(CONFIG, tmp_path)
    failure = Replay(CONFIG, sched, hasher).run(EVENTS)
    assert failure is None, failure
