"""The findings under findings/ stay true on the real vLLM, and the reference
manager (the correct model) passes them. If vLLM fixes one, its test fails:
move the finding to a fixed section then."""

from pathlib import Path

import pytest

from model.events import Trace
from properties.replay import replay

FINDINGS = sorted((Path(__file__).resolve().parent.parent / "findings").glob("*.json"))


def test_findings_exist():
    assert FINDINGS, "findings/ holds no trace"


@pytest.mark.vllm
@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_finding_reproduces_on_vllm_0_33(path):
    rr = replay(Trace.load(path), "vllm@0.33.0")
    assert rr.crash is None, rr.crash
    assert rr.first is not None and rr.first.prop == 2, rr.first
    assert Trace.load(path).meta["expect"] in rr.first.message, rr.first.message


@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_reference_recovers_correctly(path):
    rr = replay(Trace.load(path), "reference")
    assert rr.first is None, rr.first
