"""make check's job: a verdict table with every part and every kind."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_check_prints_a_passing_verdict_table(tmp_path):
    env = dict(os.environ, KVCHECK_NO_VENV="1")
    # from another folder: its inputs (traces/attention) come from the installation
    p = subprocess.run([sys.executable, str(ROOT / "kvcheck"), "check", "--examples", "300",
                        "--out", "out"], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    table = p.stdout[p.stdout.index("part "):]
    for kind in ("full", "sliding", "chunked_local", "mamba", "hybrid"):
        assert f"fuzz       {kind} " in table
        assert f"{kind} settled" in table or kind == "hybrid"
    for subject in ("sliding optimistic", "bound sliding", "optimistic sliding d2"):
        assert subject in table
    assert "attention" in table and "verdict: PASS" in p.stdout
    assert "MISSING" not in table
    report = tmp_path / "out" / "check" / "latest" / "check.md"
    assert report.read_text().count("holds") >= 5
    assert f"report: out/check/{report.parent.resolve().name}/check.md" in p.stdout
