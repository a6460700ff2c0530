"""Gating a change: a vLLM source tree passed as ``--target vllm@PATH``.

A copy of the installed 0.33.0 sources with the freeing line broken (the
settled basis turned back into the optimistic count) must be caught; an
unmodified copy must pass the same run."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = ROOT / ".vllm" / "0.33.0" / "vllm"
GOOD = "max(0, total_computed_tokens - request.num_in_flight_tokens),"
BROKEN = "total_computed_tokens,"


def _copy(tmp_path: Path, broken: bool) -> Path:
    if not INSTALLED.is_dir():
        pytest.fail(f"vLLM 0.33.0 is not installed at {INSTALLED}: run make vllm VLLM=0.33.0")
    dest = tmp_path / ("broken" if broken else "clean")
    shutil.copytree(INSTALLED, dest / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if broken:
        f = dest / "vllm" / "v1" / "core" / "kv_cache_manager.py"
        text = f.read_text()
        assert text.count(GOOD) == 1, "the freeing line moved; update this test"
        f.write_text(text.replace(GOOD, BROKEN))
    return dest


def _fuzz(path: Path, kind: str):
    env = dict(os.environ, KVCHECK_NO_VENV="1")
    return subprocess.run(
        [sys.executable, str(ROOT / "kvcheck"), "fuzz", "--target", f"vllm@{path}",
         "--kind", kind, "--depth", "2", "--examples", "150", "--seed", "1", "--quiet",
         "--no-failed-loads", "--no-report", "--out", str(path / "out")],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


@pytest.mark.vllm
def test_a_broken_freeing_line_in_a_checkout_is_caught(tmp_path):
    p = _fuzz(_copy(tmp_path, broken=True), "sliding")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "property 1 (freed-while-read)" in p.stdout


@pytest.mark.vllm
def test_an_unmodified_checkout_passes(tmp_path):
    p = _fuzz(_copy(tmp_path, broken=False), "sliding")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all properties hold" in p.stdout
