"""The CLI's contract: exit statuses and one-line errors, never a traceback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args, cwd=None):
    env = dict(os.environ, KVCHECK_NO_VENV="1")
    p = subprocess.run([sys.executable, str(ROOT / "kvcheck"), *args], capture_output=True,
                       text=True, cwd=cwd or ROOT, env=env, timeout=600)
    return p.returncode, p.stdout, p.stderr


def good_trace(tmp_path, **cfg):
    d = {"version": 1,
         "config": {"groups": [{"kind": "sliding", "param": 16}], "block_size": 16,
                    "num_blocks": 64, "max_num_batched_tokens": 64, "depth": 2,
                    "policy": "optimistic", **cfg},
         "events": [{"type": "AddRequest", "id": "r0", "prompt_len": 100, "max_new_tokens": 8},
                    {"type": "Schedule"}, {"type": "Schedule"}]}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("content", [
    "{not json",
    '{"version": 1}',
    '{"version": 1, "config": {"groups": [{"kind": "hisparse"}]}, "events": []}',
    '[1, 2]',
])
def test_malformed_trace_exit_2(tmp_path, content):
    p = tmp_path / "bad.json"
    p.write_text(content)
    before = p.read_text()
    code, out, err = run("replay", str(p))
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert p.read_text() == before  # nothing the user gave is touched


def test_missing_trace_file_exit_2(tmp_path):
    code, _, err = run("replay", str(tmp_path / "nope.json"))
    assert code == 2 and "cannot read" in err


@pytest.mark.parametrize("args", [
    ["fuzz", "--kind", "hisparse"],
    ["fuzz", "--kind", "ring", "--prefix-caching", "on"],
    ["fuzz", "--kind", "cross", "--attention-every", "5"],
    ["fuzz", "--policy", "hopeful"],
    ["fuzz", "--depth", "9"],
    ["fuzz", "--target", "tpu"],
    ["frobnicate"],
    ["fuzz", "--examples", "0"],
])
def test_bad_usage_exit_2(args):
    code, out, err = run(*args)
    assert code == 2, (out, err)
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_unsupported_vllm_version_exit_3(tmp_path):
    code, out, err = run("replay", str(good_trace(tmp_path)), "--target", "vllm@0.1.0")
    assert code == 3, (out, err)
    assert "Traceback" not in err


def test_help_on_every_subcommand():
    for sub in ("fuzz", "replay", "prove", "check"):
        code, out, _ = run(sub, "--help")
        assert code == 0 and "example" in out


def test_replay_reports_violation_and_timeline(tmp_path):
    code, out, _ = run("replay", str(good_trace(tmp_path)), "--target", "reference")
    assert code == 1, out
    assert "property 1" in out and ">>" in out


def test_a_trace_never_narrows_what_a_replay_checks(tmp_path):
    p = good_trace(tmp_path)
    d = json.loads(p.read_text())
    d["meta"] = {"props": [2, 3]}  # the violation is of property 1
    p.write_text(json.dumps(d))
    code, out, _ = run("replay", str(p), "--no-report")
    assert code == 1 and "VIOLATION of property 1" in out, out
    assert "checked only properties 2, 3 (meta.props); every property is checked" in out
    code, out, _ = run("replay", str(p), "--props", "2,3", "--no-report")
    assert code == 0, out  # only the command line narrows, and says so
    assert "checking only properties 2, 3 (--props)" in out
    assert "properties 2, 3 hold (the others were not checked)" in out


def test_replay_same_events_settled_holds(tmp_path):
    code, out, _ = run("replay", str(good_trace(tmp_path, policy="settled")))
    assert code == 0, out
    assert "all properties hold" in out


def test_fuzz_confirms_every_nth_example_with_attention():
    code, out, err = run("fuzz", "--kind", "sliding", "--depth", "2", "--examples", "300",
                         "--seed", "3",
                         "--attention-every", "10", "--quiet")
    assert code == 0, out + err
    line = next(x for x in out.splitlines() if x.startswith("attention:"))
    assert int(line.split()[1]) >= 5
    assert ", 0 where attention saw a bad read" in line


def test_fuzz_json_carries_the_verdict_the_cli_prints(tmp_path):
    """``--json`` writes the same verdict the CLI prints: the violated property,
    the counterexample's length and the trace it saved."""
    out, result = tmp_path / "out", tmp_path / "result.json"
    code, stdout, err = run("fuzz", "--kind", "sliding", "--policy", "optimistic",
                            "--examples", "200", "--seed", "1", "--workers", "1", "--quiet",
                            "--no-report", "--out", str(out), "--json", str(result))
    assert code == 1, stdout + err
    r = json.loads(result.read_text())
    said = next(ln for ln in stdout.splitlines() if ln.startswith("verdict: VIOLATION"))
    assert said == (f"verdict: VIOLATION of property {r['property']} ({r['property_name']}) "
                    f"after shrinking to {r['events']} events")
    assert r["verdict"] == "violation" and r["property"] == 1
    assert r["message"] in {ln.strip(" >") for ln in stdout.splitlines()}
    assert len(json.loads(Path(r["trace"]).read_text())["events"]) == r["events"]
    assert r["examples"] >= 1 and r["witnesses"]


def test_fuzz_json_holds_and_replaces_a_named_file_whole(tmp_path):
    result = tmp_path / "result.json"
    code, out, err = run("fuzz", "--kind", "full", "--examples", "20", "--seed", "1",
                         "--workers", "1", "--quiet", "--out", str(tmp_path / "out"),
                         "--json", str(result))
    r = json.loads(result.read_text())
    assert (code, r["verdict"]) in {(0, "holds"), (1, "vacuous")}, out + err
    assert r["property"] is None and r["trace"] is None and r["examples"] >= 20
    code, out, err = run("fuzz", "--kind", "full", "--examples", "5", "--seed", "2",
                         "--workers", "1", "--quiet", "--out", str(tmp_path / "out"),
                         "--json", str(result))
    assert code in (0, 1) and json.loads(result.read_text())["examples"] < r["examples"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    code, out, err = run("fuzz", "--kind", "full", "--json", str(tmp_path))
    assert code == 2 and "is a folder" in err and "Traceback" not in err
