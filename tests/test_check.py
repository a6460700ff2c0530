"""make check's job: a verdict table with every part and every kind."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_check_prints_a_passing_verdict_table(tmp_path):
    env = dict(os.environ, KVCHECK_NO_VENV="1")
    p = subprocess.run([sys.executable, str(ROOT / "kvcheck"), "check", "--examples", "300",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    table = p.stdout[p.stdout.index("part "):]
    for kind in ("full", "sliding", "chunked_local", "mamba", "hybrid"):
        assert f"fuzz       {kind} " in table
        assert f"{kind} settled" in table or kind == "hybrid"
    for subject in ("sliding optimistic", "bound sliding", "optimistic sliding d2"):
        assert subject in table
    assert "attention" in table and "verdict: PASS" in p.stdout
    assert (tmp_path / "check.md").read_text().count("holds") >= 5
