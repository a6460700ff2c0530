# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""mamba-align-relocated-block-written-twice: a kvcheck trace replayed on
vLLM's scheduler.

Found by kvcheck on vllm@0.33.0; replayed on vllm 0.33.0: property 2
(null-read): step 2 (shifted down 4 by rejection) computes r0 positions [4,
9) and writes the Mamba states after positions 4 and 8 (mamba) into one
block, 3, named at slots 2 and 6 of the worker's table: the next step starts
from the first if 0 draft(s) are accepted, and it holds the second
Passes with findings/10-mamba-align-relocated-block-written-twice/fix.diff
applied.

Config: mamba B=4 blocks=13 depth=2 spec=4 policy=settled hazard=ordered
prefix-caching
Written by `./kvcheck export TRACE --vllm-test OUT.py` from the trace;
kvcheck_replay.Replay (beside it) replays the calls and asserts on vLLM's
objects at every step (its docstring says what). Needs vLLM (0.33 line) and
pytest only.
"""

import pytest
from kvcheck_replay import Replay, make_scheduler

pytestmark = pytest.mark.cpu_test

CONFIG = {
    "groups": [{"kind": "mamba"}],
    "block_size": 4,
    "num_blocks": 13,
    "max_num_batched_tokens": 5,
    "max_num_seqs": 4,
    "max_model_len": 32,
    "spec_tokens": 4,
    "depth": 2,
    "policy": "settled",
    "hazard": "ordered",
    "prefix_caching": True,
}
EVENTS = [
    ("add", "r0", [17, 7936, 15855], 3, 0),
    ("schedule",),
    ("schedule",),
    ("process", {}),
    ("schedule",),
    ("process", {"r0": 0}),
]


def test_mamba_align_relocated_block_written_twice(tmp_path):
    sched, hasher = make_scheduler(CONFIG, tmp_path)
    failure = Replay(CONFIG, sched, hasher).run(EVENTS)
    assert failure is None, failure
