"""The findings under findings/ stay true on the real vLLM, and the reference
manager (the correct model) passes them. If vLLM fixes one, its test fails:
move the finding to a fixed section then.

A finding's ``meta`` says where it shows (``target``: a release, or a release
with a diff from findings/fixes/ applied; default vllm@0.33.0), what it shows
(``expect``: text of the violation, property ``prop``, default 2; or
``crash``: text of the target's crash, on ``also_on`` releases too), and, with
``fixed_by``, the diff under which the same trace passes."""

from pathlib import Path

import pytest

from impl.target import TargetCrash
from model.events import Trace
from properties.replay import replay

ROOT = Path(__file__).resolve().parent.parent
FINDINGS = sorted((ROOT / "findings").glob("*.json"))


def _target(spec: str) -> str:
    """A target named in a finding, its diff's path taken from the repository."""
    release, plus, diff = spec.partition("+")
    return f"{release}+{ROOT / diff}" if plus else spec


def _run(path: Path, target: str):
    try:
        return replay(Trace.load(path), _target(target)), None
    except TargetCrash as e:
        return None, str(e)


def test_findings_exist():
    assert FINDINGS, "findings/ holds no trace"
    for path in FINDINGS:
        meta = Trace.load(path).meta
        assert ("expect" in meta) != ("crash" in meta), path.name
        if "fixed_by" in meta:
            assert (ROOT / meta["fixed_by"]).is_file(), meta["fixed_by"]


@pytest.mark.vllm
@pytest.mark.parametrize("path", FINDINGS, ids=lambda p: p.stem)
def test_finding_reproduces_on_vllm(path):
    meta = Trace.load(path).meta
    rr, crash = _run(path, meta.get("target", "vllm@0.33.0"))
    if "crash" in meta:
        for target in [meta.get("target", "vllm@0.33.0"), *meta.get("also_on", [])]:
            rr, crash = _run(path, target)
            crash = crash or (rr.crash if rr else None)
            assert crash is not None and meta["crash"] in crash, (target, crash)
        return
    assert crash is None and rr.crash is None, crash or rr.crash
    assert rr.first is not None and rr.first.prop == meta.get("prop", 2), rr.first
    assert meta["expect"] in rr.first.message, rr.first.message


@pytest.mark.vllm
@pytest.mark.parametrize("path", [p for p in FINDINGS if "fixed_by" in Trace.load(p).meta],
                         ids=lambda p: p.stem)
def test_finding_passes_with_its_fix(path):
    meta = Trace.load(path).meta
    release = meta.get("target", "vllm@0.33.0").partition("+")[0]
    rr, crash = _run(path, f"{release}+{meta['fixed_by']}")
    assert crash is None and rr.crash is None, crash or rr.crash
    assert rr.first is None, rr.first


# the reference schedules n-gram drafts only (an EAGLE finding's config is vLLM's)
@pytest.mark.parametrize("path", [p for p in FINDINGS
                                  if Trace.load(p).config.drafter == "ngram"],
                         ids=lambda p: p.stem)
def test_reference_recovers_correctly(path):
    rr = replay(Trace.load(path), "reference")
    assert rr.first is None, rr.first
