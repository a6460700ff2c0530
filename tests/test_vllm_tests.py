"""The findings as tests in vLLM's own style (findings/vllm_tests/, written by
``./kvcheck export TRACE --vllm-test OUT.py``): each module is what the
exporter writes from its trace today, fails on the release the trace names
with the trace's violation, and passes on that release with the finding's fix
(``meta.fixed_by``) applied. The modules run in a plain pytest process whose
``PYTHONPATH`` holds only the vLLM tree: they need nothing of kvcheck."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from cli.main import main
from impl.vllm.export import ExportError, vllm_test_source
from model.events import Trace

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "findings" / "vllm_tests"
TRACES = {p.stem: Trace.load(p) for p in sorted((ROOT / "findings").glob("*.json"))}


def _ident(stem: str) -> str:
    return re.sub(r"\W+", "_", stem).strip("_").lower()


def _module(stem: str) -> Path:
    return TESTS / f"test_{_ident(stem)}.py"


EXPORTED = [s for s in TRACES if _module(s).is_file()]


def _on_033(trace: Trace) -> bool:
    return trace.meta.get("target", "vllm@0.33.0").startswith("vllm@0.33.")


def test_every_finding_has_its_vllm_test():
    """Every finding that shows on the 0.33 line (the exported tests speak its API)."""
    want = set()
    for s, t in TRACES.items():
        try:
            vllm_test_source(t, s)
            want.add(s)
        except ExportError as e:  # refused with a reason, never for the 0.33 API alone
            assert not _on_033(t) or "0.33's API" not in str(e), (s, e)
    assert set(EXPORTED) == want, want ^ set(EXPORTED)
    assert {p.name for p in TESTS.glob("test_*.py")} == {_module(s).name for s in want}
    older = next(s for s, t in TRACES.items() if not _on_033(t))
    with pytest.raises(ExportError, match="0.33"):
        vllm_test_source(TRACES[older], older)


@pytest.mark.parametrize("stem", EXPORTED)
def test_module_is_what_the_exporter_writes(stem):
    assert _module(stem).read_text() == vllm_test_source(TRACES[stem], stem), (
        f"regenerate: ./kvcheck export findings/{stem}.json --vllm-test ...")


def test_export_refuses_what_it_cannot_state(tmp_path, capsys):
    src = ROOT / "findings" / "failed-load-prefix-hit-reads-missing-kv.json"
    t = Trace.load(src)
    cases = {
        "drain": Trace(t.config, [*t.events, *Trace.from_json(
            {"version": 1, "config": t.config.to_json(), "events": [{"type": "Drain"}]}
        ).events], {}),
        "prop1": Trace(t.config, t.events, {"violation": "property 1 (freed-while-read): x"}),
        "prop7_no_drain": Trace(t.config, t.events, {"violation": "property 7 (progress): x"}),
    }
    for name, trace in cases.items():
        path = tmp_path / f"{name}.json"
        trace.save(path)
        out = tmp_path / f"test_{name}.py"
        assert main(["export", str(path), "--vllm-test", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot be exported" in err[0], err
        assert not out.exists()
    out = tmp_path / "test_kept.py"
    out.write_text("# mine\n")
    assert main(["export", str(src), "--vllm-test", str(out)]) == 2
    assert out.read_text() == "# mine\n"
    fresh = tmp_path / "test_fresh.py"
    assert main(["export", str(src), "--vllm-test", str(fresh)]) == 0
    assert fresh.read_text() == vllm_test_source(t, src.stem)


def _run(target: str, stems: list[str], tmp: Path) -> dict[str, str | None]:
    """pytest the modules of ``stems`` on ``target`` (a release, or
    RELEASE+findings/fixes/X.diff); per stem its failure text (None: passed)."""
    from impl.vllm import resolve

    release, plus, diff = target.partition("+")
    inst = resolve(f"{release}+{ROOT / diff}" if plus else target)
    junit = tmp / f"junit-{len(list(tmp.glob('junit-*.xml')))}.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, inst.path)), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR", VLLM_NO_USAGE_STATS="1",
               OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "--rootdir", str(tmp), "-c", os.devnull, f"--junitxml={junit}",
                    *(str(_module(s)) for s in stems)],
                   cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert junit.is_file(), (target, run.returncode, (run.stdout + run.stderr)[-2000:])
    results: dict[str, str | None] = {}
    for case in ET.parse(junit).iter("testcase"):
        stem = next(s for s in stems if case.get("name") == f"test_{_ident(s)}")
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        results[stem] = None if bad is None else (bad.get("message", "") + "\n" + (bad.text or ""))
    assert set(results) == set(stems), (target, results)
    return results


@pytest.mark.vllm
def test_vllm_tests_fail_where_the_findings_show(tmp_path):
    groups = defaultdict(list)
    for stem in EXPORTED:
        groups[TRACES[stem].meta.get("target", "vllm@0.33.0")].append(stem)
    for target, stems in groups.items():
        for stem, failure in _run(target.removeprefix("vllm@"), stems, tmp_path).items():
            meta = TRACES[stem].meta
            assert failure is not None, f"{stem} passes on {target}"
            if "crash" in meta:
                assert meta["crash"] in failure, (stem, failure[:600])
                continue
            v = meta["violation"]
            # the property, the step (property 7: what stalled, up to the requests) and request
            label, _, what = v.partition(": ")
            step = re.search(r"step \d+", v)
            parts = [label, re.search(r"r\d+", v)[0],
                     step[0] if step else what.partition(" have not finished")[0]]
            for part in parts:
                assert part in failure, (stem, part, failure[:600])


@pytest.mark.vllm
def test_vllm_tests_pass_with_the_fixes(tmp_path):
    groups = defaultdict(list)
    for stem in EXPORTED:
        meta = TRACES[stem].meta
        if "fixed_by" in meta:
            release = meta.get("target", "vllm@0.33.0").removeprefix("vllm@").partition("+")[0]
            groups[f"{release}+{meta['fixed_by']}"].append(stem)
    assert groups
    for target, stems in groups.items():
        for stem, failure in _run(target, stems, tmp_path).items():
            assert failure is None, (stem, target, failure[:1500])
