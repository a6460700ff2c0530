# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""mamba-align-relocated-block-checkpoint-overwritten: a kvcheck trace replayed
on vLLM's scheduler.

Found by kvcheck on vllm@0.33.0; replayed on vllm 0.33.0: property 2
(null-read): step 5 computes r1 positions [13, 18) from the Mamba state
after position 12, which step 4 left at slot 6 (block 5, mamba), but step
4's postprocess copied the state after 11 there: the block names two slots
of the worker's table
Passes with findings/10-mamba-align-relocated-block-written-twice/fix.diff
applied.

Config: mamba+full(draft) B=4 blocks=21 depth=1 spec=4 policy=settled
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
    "groups": [{"kind": "mamba"}, {"kind": "full", "draft": True}],
    "block_size": 4,
    "num_blocks": 21,
    "max_num_batched_tokens": 5,
    "max_num_seqs": 4,
    "max_model_len": 32,
    "spec_tokens": 4,
    "depth": 1,
    "policy": "settled",
    "hazard": "ordered",
    "prefix_caching": True,
    "drafter": "mtp",
}
EVENTS = [
    ("add", "r0", [17], 1, 0),
    ("schedule",),
    ("add", "r1", [17, 7936, 15855, 23774, 31693, 7612, 15531, 23450], 7, 0),
    ("process", {}),
    ("schedule",),
    ("process", {}),
    ("schedule",),
    ("process", {}),
    ("schedule",),
    ("process", {"r1": 0}),
    ("schedule",),
    ("process", {"r1": 3}),
    ("schedule",),
]


def test_mamba_align_relocated_block_checkpoint_overwritten(tmp_path):
    sched, hasher = make_scheduler(CONFIG, tmp_path)
    failure = Replay(CONFIG, sched, hasher).run(EVENTS)
    assert failure is None, failure
