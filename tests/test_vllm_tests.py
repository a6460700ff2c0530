"""The findings as tests in vLLM's own style (``findings/NN-NAME/test_*.py``
beside their traces, the helpers in ``findings/kvcheck_utils.py``; written by
``./kvcheck export TRACE --vllm-test OUT.py``): each module is what the
exporter writes from its trace today, fails on the release the trace names
with the trace's violation, and passes on that release with the finding's fix
(``meta.fixed_by``) applied. The modules run in a plain pytest process whose
``PYTHONPATH`` holds only the vLLM tree and the helpers: they need nothing
of kvcheck."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

from cli.main import main
from gate.known import finding_traces, in_repo
from impl.vllm.export_steps import export
from model.events import Trace

ROOT = Path(__file__).resolve().parent.parent
HELPERS = ROOT / "findings" / "kvcheck_utils.py"
REPLAY_HELPERS = ROOT / "findings" / "kvcheck_replay.py"
PATHS = {p.stem: p for p in finding_traces()}
TRACES = {stem: Trace.load(p) for stem, p in PATHS.items()}


def _ident(stem: str) -> str:
    return re.sub(r"\W+", "_", stem).strip("_").lower()


def _module(stem: str) -> Path:
    """A trace's test: beside it, in its finding's folder."""
    return PATHS[stem].parent / f"test_{_ident(stem)}.py"


EXPORTED = [s for s in TRACES if _module(s).is_file()]
# kept in the replaying form though the step form states them: their fix
# repairs the state in a step before the one the step form's assertion reads,
# or schedules other steps before it (the model runner outputs the step form
# writes are the buggy run's)
REPLAYING = {"failed-load-recovery-hybrid-keeps-copied-mamba-state",
             "mamba-align-mtp-lookahead-stalls-prefill-shared-budget"}


def _steps(stem: str) -> bool:
    """Written in the step form (vLLM's calls one by one, kvcheck_utils beside)."""
    return "from kvcheck_utils import" in _module(stem).read_text()


def _runs_on(stem: str) -> str:
    """Where the module shows the bug: the trace's vLLM, or, for a step-form
    module of a trace found on an older line, vllm@0.33.0 (its calls' API)."""
    target = TRACES[stem].meta.get("target", "vllm@0.33.0")
    if _steps(stem) and not target.startswith("vllm@0.33."):
        return "vllm@0.33.0"
    return target


def test_every_finding_has_its_vllm_test():
    assert set(EXPORTED) == set(TRACES)
    assert set((ROOT / "findings").glob("[0-9][0-9]-*/test_*.py")) == {
        _module(s) for s in TRACES}
    steps = [s for s in EXPORTED if _steps(s)]
    lines = sorted(len(_module(s).read_text().splitlines()) for s in EXPORTED)
    # vLLM's own tests are 20-60 lines: the median at most 60, none over 120
    assert steps and lines[-1] <= 120 and statistics.median(lines) <= 60, lines
    assert sum(len(p.read_text().splitlines())  # one replay helper, not 10 copies of it
               for p in (ROOT / "findings").rglob("*.py")) < 4000
    for s in EXPORTED:
        text = _module(s).read_text()
        assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n")
        assert "pytestmark = pytest.mark.cpu_test" in text and "_registry" not in text
        assert max(map(len, text.splitlines())) <= 88, s
        test = text[text.index("\ndef test_"):]
        assert "\n    assert " in test, s  # the test function asserts itself
        target = TRACES[s].meta.get("target", "")
        if "+" in target:  # a trace found on a patched tree names its diffs
            words = " ".join(text.split())
            assert all(d in words for d in target.partition("+")[2].split("+")), s
            assert "replayed on that tree" in words, s


@pytest.mark.vllm
@pytest.mark.parametrize("stem", EXPORTED)
def test_module_is_what_the_exporter_writes(stem):
    text, _, _ = export(TRACES[stem], stem, "replaying" if stem in REPLAYING else "auto")
    assert _module(stem).read_text() == text, (
        f"regenerate: ./kvcheck export {PATHS[stem].relative_to(ROOT)} --vllm-test ...")


@pytest.mark.vllm
def test_the_helpers_are_what_the_exporter_writes():
    stem = next(s for s in EXPORTED if not _steps(s))
    _, (name, text), _ = export(TRACES[stem], stem, "replaying")
    assert name == REPLAY_HELPERS.name and REPLAY_HELPERS.read_text() == text
    stem = next(s for s in EXPORTED if _steps(s))
    _, (name, utils), _ = export(TRACES[stem], stem)
    assert name == HELPERS.name and HELPERS.read_text() == utils
    import ast
    import inspect

    from impl.vllm import build

    def body(tree, name):
        f = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        return ast.dump(f, include_attributes=False)

    for name in ("plan_kv_cache", "build_scheduler"):  # the driver's own steps
        assert body(ast.parse(utils), name) == body(ast.parse(inspect.getsource(build)), name)


@pytest.mark.vllm
def test_export_refuses_what_it_cannot_state(tmp_path, capsys):
    src = PATHS["failed-load-recompute-reads-null-sliding"]
    t = Trace.load(src)
    holds = Trace(t.config, t.events[:1], {"violation": "property 1 (freed-while-read): x"})
    path = tmp_path / "holds.json"
    holds.save(path)
    out = tmp_path / "test_holds.py"
    assert main(["export", str(path), "--vllm-test", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to assert" in err[0], err
    assert not out.exists()
    out = tmp_path / "test_kept.py"
    out.write_text("# mine\n")
    assert main(["export", str(src), "--vllm-test", str(out)]) == 2
    assert out.read_text() == "# mine\n"
    (tmp_path / "kvcheck_utils.py").write_text("# mine too\n")
    assert main(["export", str(src), "--vllm-test", str(tmp_path / "test_x.py")]) == 2
    assert "differs" in capsys.readouterr().err
    assert (tmp_path / "kvcheck_utils.py").read_text() == "# mine too\n"
    fresh = tmp_path / "fresh" / "test_fresh.py"
    fresh.parent.mkdir()
    assert main(["export", str(src), "--vllm-test", str(fresh)]) == 0
    assert fresh.read_text() == _module(src.stem).read_text()
    assert (fresh.parent / "kvcheck_utils.py").is_file()


def _run(target: str, stems: list[str], tmp: Path) -> dict[str, str | None]:
    """pytest the modules of ``stems`` on ``target`` (a release, or
    RELEASE+findings/fixes/X.diff); per stem its failure text (None: passed)."""
    from impl.vllm import resolve

    inst = resolve(in_repo(f"vllm@{target}").removeprefix("vllm@"))
    junit = tmp / f"junit-{len(list(tmp.glob('junit-*.xml')))}.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, [*inst.path, HELPERS.parent])),
               HF_HUB_OFFLINE="1",
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
        groups[_runs_on(stem)].append(stem)
    for target, stems in groups.items():
        for stem, failure in _run(target.removeprefix("vllm@"), stems, tmp_path).items():
            meta = TRACES[stem].meta
            assert failure is not None, f"{stem} passes on {target}"
            if "crash" in meta:
                said = "AssertionError: vLLM raised" if _steps(stem) else meta["crash"]
                assert said in failure, (stem, failure[:600])
                continue
            if _steps(stem):  # its own assertion, naming the request and the step
                v = meta["violation"]
                assert "AssertionError" in failure and re.search(r"r\d+", v)[0] in failure
                step = re.search(r"step \d+", v)
                assert step is None or step[0] in failure, (stem, failure[:600])
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


@pytest.mark.vllm
def test_a_trace_of_an_older_release_exports_in_the_newest_api(tmp_path):
    """The seed bug's trace on 0.25.1 (property 1 once every property is
    checked), exported in 0.33's API: the test holds on 0.33.0, which fixed
    the bug, and fails on 0.33.0 with the fix reverted (scripts/mutants.py's
    optimistic-basis), naming the freed block."""
    from impl.vllm import resolve

    sys.path.insert(0, str(ROOT / "scripts"))
    import mutants

    stem = "spec-reject-null-read-0.25.1"
    text, (helper, _utils), why = export(
        Trace.load(ROOT / "traces" / "vllm" / f"{stem}.json"), stem)
    assert not why and helper == HELPERS.name
    words = " ".join(text.split())
    assert "Found by kvcheck on vllm@0.25.1" in words and "they hold there" in words
    module = tmp_path / f"test_{_ident(stem)}.py"
    module.write_text(text)
    m = next(x for x in mutants.MUTANTS if x.name == "optimistic-basis")
    tree = mutants.mutant_tree(m, tmp_path / "tree")
    outcome = {}
    for where in ("0.33.0", str(tree)):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(PYTHONPATH=os.pathsep.join(map(str, [*resolve(where).path,
                                                        HELPERS.parent])),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   OMP_NUM_THREADS="1")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "--rootdir", str(tmp_path), "-c", os.devnull, str(module)],
                             cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=900)
        outcome[where] = (run.returncode, run.stdout[-3000:])
    assert outcome["0.33.0"][0] == 0, outcome["0.33.0"][1]
    code, out = outcome[str(tree)]
    assert code == 1 and "was freed while step 0, still in flight, reads" in out, out
