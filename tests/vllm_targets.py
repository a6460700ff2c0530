"""One ``vllm@VERSION`` target per release for a whole test process.

A target's worker imports vLLM once (10-20 s), so tests share them. A release
that is not installed fails the asking test with the command that installs
it: the vLLM targets are tested on the real releases, never skipped.
"""

from __future__ import annotations

import pytest

from impl.target import Target, TargetError, make_target

_targets: dict[str, Target] = {}


def vllm_target(version: str) -> Target:
    if version not in _targets:
        try:
            _targets[version] = make_target(f"vllm@{version}")
        except TargetError as e:
            pytest.fail(f"{e}\n(the vLLM targets are tested on the real releases: run "
                        f"scripts/install-vllm.sh {version}, or make vllms)")
    return _targets[version]
