"""The gate over CI's parallel jobs (gate/shards.py): ``--shard I/N`` splits
the rows alike on every machine, ``--list-rows`` says them, ``kvcheck merge``
joins the shards' reports into the one a whole run gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gate.shards import ShardError, load_costs, parse_shard, split

ROOT = Path(__file__).resolve().parent.parent
KVCHECK = ROOT / "kvcheck"


def kvcheck(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    p = subprocess.run([sys.executable, str(KVCHECK), *args], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def test_a_shard_is_i_of_n():
    assert parse_shard("2/4") == (2, 4) and parse_shard(" 1 / 1 ") == (1, 1)
    for bad in ("0/2", "3/2", "x", "1/0", "-1/2", "1/2/3", ""):
        with pytest.raises(ShardError, match="give I/N"):
            parse_shard(bad)


def test_the_split_partitions_the_rows_and_balances_their_time():
    costs = load_costs()
    assert len(costs) > 200  # the committed costs of a vLLM gate run
    rows = [{"id": k.partition(":")[2], "target": "vllm@0.33.0"} for k in sorted(costs)
            if k.startswith("vllm:")] + [{"id": "a-row-no-run-timed", "target": "vllm@X"}]
    costs = {r["id"]: costs.get(f"vllm:{r['id']}", 0) for r in rows}
    for n in (1, 2, 3, 7):
        parts = split(rows, n)
        ids = [r["id"] for p in parts for r in p]
        assert sorted(ids) == sorted(r["id"] for r in rows) and len(ids) == len(set(ids))
        assert parts == split(list(rows), n), "the same split every time"
        loads = [sum(costs.get(r["id"], 0) for r in p) for p in parts]
        assert max(loads) - min(loads) <= max(costs.values()), loads
    # a part keeps the rows' order (the gate starts rare rows first)
    first = split(rows, 2)[0]
    assert [r["id"] for r in first] == [r["id"] for r in rows if r in first]


def test_list_rows_of_the_shards_partition_the_matrix():
    code, whole, err = kvcheck("gate", "--target", "reference", "--list-rows")
    assert code == 0, err
    parts = []
    for i in (1, 2, 3):
        code, out, err = kvcheck("gate", "--target", "reference", "--list-rows",
                                 "--shard", f"{i}/3")
        assert code == 0, err
        parts.append(out.split())
    assert sorted(sum(parts, [])) == sorted(whole.split())
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # no costs kept: even counts
    code, _, err = kvcheck("gate", "--target", "reference", "--shard", "4/3")
    assert code == 2 and err.count("\n") == 1 and "--shard '4/3'" in err


def test_merged_shards_give_the_rows_and_verdict_of_one_run(tmp_path):
    args = ["--target", "reference", "--kind", "full", "--minutes", "1", "--seed", "3",
            "--quiet"]
    shards = []
    for i in (1, 2):
        code, out, err = kvcheck("gate", *args, "--shard", f"{i}/2",
                                 "--reports", str(tmp_path / f"s{i}"))
        assert code == 0, out + err
        assert f"(shard {i}/2 of 36, of " in out and "0.5 min of the budget" in out
        shards.append(tmp_path / f"s{i}" / "latest")
    code, out, err = kvcheck("merge", *map(str, shards), "--reports", str(tmp_path / "m"))
    assert code == 0, out + err
    assert "36 rows (2 report(s) joined" in out and out.strip().endswith(
        f"JUnit {(tmp_path / 'm').resolve()}/{(tmp_path / 'm' / 'latest').resolve().name}"
        "/junit.xml")
    merged = json.loads((tmp_path / "m" / "latest" / "gate.json").read_text())
    # what ran: kvcheck's commit, the machine, each row's seed and examples
    assert merged["provenance"]["kvcheck"] and merged["provenance"]["machine"]["cpus"] >= 1
    assert all(r["seed"] == 3 and r["examples"] > 0 for r in merged["rows"])
    code, out, err = kvcheck("gate", *args, "--reports", str(tmp_path / "whole"))
    whole = json.loads((tmp_path / "whole" / "latest" / "gate.json").read_text())
    assert sorted(r["id"] for r in merged["rows"]) == sorted(r["id"] for r in whole["rows"])
    assert (merged["verdict"], merged["exit"]) == (whole["verdict"], whole["exit"]) == \
        ("PASS", code)
    cases = ET.parse(tmp_path / "m" / "latest" / "junit.xml").getroot().iter("testcase")
    assert len(list(cases)) == 36
    # what cannot be joined: one line, exit 2
    code, _, err = kvcheck("merge", str(shards[0]), str(shards[0]), "--reports",
                           str(tmp_path / "m"))
    assert code == 2 and "the shards overlap" in err and err.count("\n") == 1
    other = tmp_path / "other"
    other.mkdir()
    d = json.loads((shards[1] / "gate.json").read_text())
    (other / "gate.json").write_text(json.dumps({**d, "target": "vllm@0.33.0"}))
    code, _, err = kvcheck("merge", str(shards[0]), str(other), "--reports", str(tmp_path / "m"))
    assert code == 2 and "shards of one run share target and base" in err
    code, _, err = kvcheck("merge", str(tmp_path / "nothing"), "--reports", str(tmp_path / "m"))
    assert code == 2 and "no gate.json there" in err
