"""The ``sglang@0.5.23`` fuzz target (impl/sglang/target.py) on a fresh
install (``make sglang``): a short fuzz of each kind through the CLI, with
witnesses that show the frees it is about happened, and a replay of
traces/sglang/. A missing install fails here (the target's one line)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from impl.sglang import compat
from properties.invariants import WITNESSES

REPO = compat.REPO
TARGET = "sglang@0.5.23"
TRACE = REPO / "traces" / "sglang" / "chunked-overlap-retract-0.5.23.json"


def _kvcheck(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "kvcheck"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _fuzz(tmp_path, kind: str) -> dict:
    out = tmp_path / f"{kind}.json"
    p = _kvcheck("fuzz", "--target", TARGET, "--kind", kind, "--examples", "4", "--seed", "3",
                 "--workers", "1", "--quiet", "--no-report", "--out", str(tmp_path / "cx"),
                 "--json", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def test_sliding_fuzz_holds_with_window_frees_in_flight(tmp_path):
    res = _fuzz(tmp_path, "sliding")
    assert res["verdict"] == "holds", res
    w = {k: res["witnesses"].get(k, 0) for k in WITNESSES}
    # SGLang's SWA eviction freed blocks, some with another step of the
    # request in flight (the overlap scheduler), and examples drained
    assert w["window_free"] > 0 and w["free_while_in_flight"] > 0, w
    assert w["drained"] > 0 and w["block_reused"] > 0, w


def test_full_fuzz_holds_and_frees_nothing_early(tmp_path):
    res = _fuzz(tmp_path, "full")
    assert res["verdict"] == "holds", res
    w = {k: res["witnesses"].get(k, 0) for k in WITNESSES}
    assert w["window_free"] == 0 and w["drained"] > 0 and w["block_reused"] > 0, w


def test_replay_of_chunked_prefill_retraction_and_abort():
    p = _kvcheck("replay", str(TRACE), "--target", TARGET)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "verdict: all properties hold" in out
    # the retraction and the abort went through SGLang's release paths
    assert "(preempt)" in out and "(abort)" in out and "(window)" in out, out[-3000:]


@pytest.mark.parametrize("args, line", [
    (("--kind", "chunked_local"), "does not support kind chunked_local"),
    (("--kind", "sliding", "--spec-tokens", "2"), "speculative decoding is not driven"),
    (("--kind", "sliding", "--hazard", "unordered"), "HiCache's load stream"),
])
def test_unsupported_options_are_one_line_exit_2(args, line):
    p = _kvcheck("fuzz", "--target", TARGET, *args, "--examples", "1", timeout=120)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert line in p.stderr + p.stdout
    assert "Traceback" not in p.stderr
