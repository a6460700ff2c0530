"""Every input to the CLI's contract (issue 14): one line and exit 2 for bad
input, never a traceback, never a file of the user's overwritten; the saved
counterexample describes the trace as saved."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import re
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.main import main
from model.events import (
    MAX_MODEL_LEN,
    MAX_NESTING,
    MAX_NUM_BLOCKS,
    AddRequest,
    Schedule,
    Trace,
    TraceError,
    config_for,
)
from properties.replay import replay
from report.report import save_counterexample, write_report

ROOT = Path(__file__).resolve().parent.parent
FUZZ_NAME = "reference-sliding-optimistic"  # the name fuzz gives the run below
FUZZ = ["fuzz", "--kind", "sliding", "--policy", "optimistic", "--depth", "2",
        "--examples", "300", "--seed", "0", "--quiet"]


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process; (exit status, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, out: str, err: str, expect: int = 2) -> str:
    assert code == expect, (code, out, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def base_trace(**cfg) -> dict:
    return {"version": 1,
            "config": {"groups": [{"kind": "sliding", "param": 16}], "block_size": 16,
                       "num_blocks": 64, "max_num_batched_tokens": 64, "depth": 2,
                       "policy": "optimistic", **cfg},
            "events": [{"type": "AddRequest", "id": "r0", "prompt_len": 100,
                        "max_new_tokens": 8}, {"type": "Schedule"}, {"type": "Schedule"}]}


def snapshot(folder: Path, skip: Path | None = None) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and (skip is None or skip not in p.parents)}


# ------------------------------------------------------- output never destroys


def test_fuzz_keeps_files_beside_its_name_and_saves_all_three_under_a_new_one(tmp_path,
                                                                               capsys):
    out = tmp_path / "ce"
    out.mkdir()
    mine = {f"{FUZZ_NAME}.png": b"my picture", f"test_{FUZZ_NAME.replace('-', '_')}.py":
            b"my test", "reference-sliding-optimistic-1.json": b"my trace"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    code, text, err = cli(capsys, *FUZZ, "--out", str(out))
    assert code == 1, text + err
    for name, data in mine.items():  # byte for byte
        assert (out / name).read_bytes() == data
    saved = {line.split(": ", 1)[0]: Path(line.split(": ", 1)[1].split()[0])
             for line in text.splitlines()
             if line.startswith(("trace saved:", "picture:", "reproducer:"))}
    # neither NAME (its picture exists) nor NAME-1 (its trace exists): NAME-2 for all three
    assert saved["trace saved"] == out / f"{FUZZ_NAME}-2.json"
    assert saved["picture"] == out / f"{FUZZ_NAME}-2.png"
    assert saved["reproducer"] == out / f"test_{FUZZ_NAME.replace('-', '_')}_2.py"
    assert saved["picture"].read_bytes()[:4] == b"\x89PNG"
    assert not list(out.glob(".kvcheck-*"))  # no temporary file left behind
    # the saved message is what a replay of the saved trace reports
    t = Trace.load(saved["trace saved"])
    assert t.meta["violation"] == str(replay(t, "reference").first)
    assert "Found on reference: property 1" in saved["reproducer"].read_text()


def test_replay_keeps_a_picture_and_reproducer_already_in_counterexamples(tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "seed.json"
    p.write_text(json.dumps(base_trace()))
    ce = tmp_path / "counterexamples"
    ce.mkdir()
    (ce / "seed.png").write_bytes(b"keep me")
    (ce / "test_seed.py").write_bytes(b"keep me too")
    code, out, err = cli(capsys, "replay", str(p))
    assert code == 1, out + err
    assert (ce / "seed.png").read_bytes() == b"keep me"
    assert (ce / "test_seed.py").read_bytes() == b"keep me too"
    assert "picture: counterexamples/seed-1.png" in out
    assert "reproducer: counterexamples/test_seed_1.py" in out
    assert (ce / "seed-1.png").read_bytes()[:4] == b"\x89PNG"


def test_a_stale_message_is_replaced_by_the_replay_of_the_trace_as_saved(tmp_path):
    t = Trace.from_json(base_trace())
    stale = "property 1 (freed-while-read): block 3 (logical 2 of r2, positions [32, 48))"
    t = Trace(t.config, t.events, {"target": "reference", "violation": stale})
    rr = replay(t, "reference")
    rep = save_counterexample(rr, tmp_path, "x", "reference")
    saved = Trace.load(rep.trace)
    assert saved.meta["violation"] == str(rr.first) != stale
    assert "r2" not in rep.reproducer.read_text()
    # a replay's report (no trace written) says the same
    rep2 = write_report(rr, tmp_path, "y", "reference")
    src = rep2.reproducer.read_text()
    assert "r2" not in src and "logical 2 of r0" in " ".join(src.split())


def test_a_name_taken_meanwhile_is_given_back_and_the_next_tried(tmp_path, monkeypatch):
    """A writer that takes a name between the check and the link (here: the
    picture appears just before it is linked) loses nothing of its own."""
    rr = replay(Trace.from_json(base_trace()), "reference")
    import report.report as report

    real = report._place

    def racing(tmp: Path, final: Path) -> None:
        if final.name == "x.png" and not final.exists():
            final.write_bytes(b"someone else's")
        real(tmp, final)

    monkeypatch.setattr(report, "_place", racing)
    rep = save_counterexample(rr, tmp_path, "x", "reference")
    assert (tmp_path / "x.png").read_bytes() == b"someone else's"
    assert not (tmp_path / "x.json").exists()  # our half of the name was given back
    assert rep.trace == tmp_path / "x-1.json" and rep.png == tmp_path / "x-1.png"


def _save_one(args: tuple[str, int]) -> str:
    path, _ = args
    t = Trace(config_for("sliding"), [AddRequest("r0", 10, 2), Schedule()])
    return str(t.save(path))


def test_concurrent_savers_each_get_their_own_file(tmp_path):
    target = str(tmp_path / "t.json")
    with multiprocessing.get_context("fork").Pool(6) as pool:
        paths = pool.map(_save_one, [(target, i) for i in range(6)])
    assert len(set(paths)) == 6
    files = sorted(tmp_path.iterdir())
    assert len(files) == 6  # no temporary file left, none lost
    for f in files:
        assert Trace.load(f).events[0].id == "r0"


def _read_only_dir(tmp_path: Path) -> Path:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    with contextlib.suppress(OSError):
        (d / "probe").write_text("")
        (d / "probe").unlink()
        return Path("/sys")  # root writes anywhere: sysfs refuses even root
    return d


@pytest.mark.parametrize("how", ["file", "under-a-file", "read-only", "cannot-create"])
@pytest.mark.parametrize("cmd", ["fuzz", "check"])
def test_an_unusable_out_is_refused_before_the_run(tmp_path, capsys, how, cmd):
    f = tmp_path / "a-file"
    f.write_text("mine")
    out = {"file": f, "under-a-file": f / "sub" / "dir",
           "read-only": _read_only_dir(tmp_path), "cannot-create": Path("/proc/kvcheck/x")}[how]
    args = [*FUZZ] if cmd == "fuzz" else ["check", "--examples", "1", "--skip", "prove"]
    code, out_text, err = cli(capsys, *args, "--out", str(out))
    line = one_line_error(code, out_text, err)
    assert "--out" in line and str(out) in line
    assert "examples" not in out_text  # refused before the run, nothing was fuzzed
    assert f.read_text() == "mine"


def test_a_created_out_folder_left_empty_is_removed(tmp_path, capsys):
    out = tmp_path / "new" / "deeper"
    code, text, err = cli(capsys, "fuzz", "--kind", "sliding", "--examples", "5", "--seed", "1",
                          "--quiet", "--out", str(out))
    assert code in (0, 1) and "trace saved" not in text, text + err  # held, or vacuous
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------- malformed traces


def _write(tmp_path: Path, data: bytes | str | dict) -> Path:
    p = tmp_path / "bad.json"
    if isinstance(data, dict):
        data = json.dumps(data)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def _with(path: list, value, **cfg) -> dict:
    d = base_trace(**cfg)
    x = d
    for k in path[:-1]:
        x = x[k]
    x[path[-1]] = value
    return d


BAD_TRACES = {
    "latin-1": json.dumps(base_trace()).replace('"r0"', '"r\u00e9"').encode("latin-1"),
    "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "nested past the limit": _with(["meta"], {"note": json.loads("[" * MAX_NESTING + "]"
                                                                 * MAX_NESTING)}),
    "5,000-digit integer": json.dumps(base_trace()).replace('"num_blocks": 64',
                                                            '"num_blocks": ' + "7" * 5000),
    "4,000-digit integer": json.dumps(base_trace()).replace('"num_blocks": 64',
                                                            '"num_blocks": ' + "7" * 4000),
    "NaN": json.dumps(base_trace()).replace('"num_blocks": 64', '"num_blocks": NaN'),
    "policy a list": _with(["config", "policy"], ["settled"]),
    "policy an object": _with(["config", "policy"], {"a": 1}),
    "hazard a list": _with(["config", "hazard"], ["ordered"]),
    "event type a list": _with(["events", 1, "type"], ["Schedule"]),
    "event type an object": _with(["events", 1, "type"], {}),
    "chunked_local block_size '16'": _with(["config", "groups"], [{"kind": "chunked_local",
                                                                   "param": 32}],
                                           block_size="16"),
    "chunked_local block_size null": _with(["config", "groups"], [{"kind": "chunked_local",
                                                                   "param": 32}],
                                           block_size=None),
    "chunked_local block_size 0": _with(["config", "groups"], [{"kind": "chunked_local",
                                                                "param": 32}], block_size=0),
    "meta.target an int": _with(["meta"], {"target": 5}),
    "meta.target a list": _with(["meta"], {"target": ["reference"]}),
    "num_blocks 10**12": base_trace(num_blocks=10**12),
    "num_blocks 10**9": base_trace(num_blocks=10**9),
    "num_blocks past the limit": base_trace(num_blocks=MAX_NUM_BLOCKS + 1),
    "prompt_len 10**9": _with(["events", 0, "prompt_len"], 10**9, max_model_len=2 * 10**9),
    "prompt_len 10**9 in a small model": _with(["events", 0, "prompt_len"], 10**9),
    "max_model_len past the limit": base_trace(max_model_len=MAX_MODEL_LEN + 1),
    "window past the limit": _with(["config", "groups"], [{"kind": "sliding",
                                                           "param": MAX_MODEL_LEN + 1}]),
    "first_bad_block 10**30": _with(["events", 2], {"type": "FailLoad", "id": "r0",
                                                    "first_bad_block": 10**30}),
    "id of 10,000 characters": _with(["events", 0, "id"], "r" * 10_000),
    "spec_tokens 10**6": base_trace(spec_tokens=10**6),
    # meta.props narrows what a replay checks: never silently (base_trace violates p1)
    "meta.props a string": _with(["meta"], {"props": "abc"}),
    "meta.props of strings": _with(["meta"], {"props": ["1"]}),
    "meta.props past 7": _with(["meta"], {"props": [9]}),
    "meta.props an int": _with(["meta"], {"props": 5}),
    "meta.props nested": _with(["meta"], {"props": [[1]]}),
}


@pytest.mark.parametrize("name", list(BAD_TRACES))
def test_a_bad_trace_is_one_line_exit_2(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    p = _write(tmp_path, BAD_TRACES[name])
    before = p.read_bytes()
    for cmd in (["replay", str(p)], ["diff", str(p), "--right", "reference"]):
        line = one_line_error(*cli(capsys, *cmd))
        assert line.startswith("kvcheck: error: ") and str(p) in line
        assert len(line) < 300
    assert p.read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.json"]


def test_the_limits_are_checked_before_anything_is_allocated():
    d = base_trace(num_blocks=10**12)
    with pytest.raises(TraceError, match="num_blocks .* over the limit"):
        Trace.from_json(d)


def test_diff_on_an_event_the_state_does_not_allow_is_exit_2(tmp_path, capsys):
    p = _write(tmp_path, _with(["events"], [{"type": "Process"}]))
    for cmd in ("replay", "diff"):
        args = [cmd, str(p)] + (["--right", "reference"] if cmd == "diff" else ["--no-report"])
        line = one_line_error(*cli(capsys, *args))
        assert "event 0 (Process) is not valid here" in line


# ------------------------------------------------------- flags and environment


@pytest.mark.parametrize("args, fragment", [
    (["check", "--examples", "0"], "--examples"),
    (["fuzz", "--attention-every", "-1"], "--attention-every"),
    (["fuzz", "--policy", ""], "unknown policy ''"),
    (["fuzz", "--db", ""], "--db ''"),
    (["fuzz", "--out", ""], "--out ''"),
    (["prove", "--policy", ""], "unknown policy ''"),
    # a model drafter beside a hybrid's groups: Mamba mixes only, which need these
    (["fuzz", "--kind", "hybrid", "--drafter", "eagle"], "--no-external"),
    (["fuzz", "--kind", "hybrid", "--drafter", "eagle", "--no-external", "--prefix-caching",
      "off"], "--prefix-caching on"),
    (["fuzz", "--kind", "ring", "--drafter", "eagle"], "driven beside Mamba only"),
])
def test_a_bad_flag_is_one_line_exit_2(tmp_path, capsys, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(*cli(capsys, *args))
    assert fragment in line
    assert not list(tmp_path.iterdir())


def test_replay_policy_empty_is_exit_2(tmp_path, capsys):
    p = _write(tmp_path, base_trace())
    assert "unknown policy ''" in one_line_error(*cli(capsys, "replay", str(p), "--policy", ""))


def test_replay_target_empty_is_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = _write(tmp_path, base_trace())
    assert "--target ''" in one_line_error(*cli(capsys, "replay", str(p), "--target", ""))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["bad.json"]


def test_a_trace_found_is_saved_elsewhere_when_out_fails_after_the_run(tmp_path, capsys):
    """An --out checked before the run that cannot take the result after it (a
    file took its place): the trace goes to a new temporary folder, said in a
    line, and the file in the way is untouched."""
    from cli.main import save_trace

    out = tmp_path / "out"
    out.write_bytes(b"not a folder")
    trace = Trace.from_json(base_trace())
    path = save_trace(trace, out, "crash-sliding.json")
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"cannot write in {out}") and str(path.parent) in line
    assert path.parent != out and Trace.load(path).events == trace.events
    assert out.read_bytes() == b"not a folder"


@pytest.mark.parametrize("name", ["KVCHECK_VLLM_START_TIMEOUT", "KVCHECK_HANG_TIMEOUT"])
@pytest.mark.parametrize("value", ["abc", "", "-5", "0", "nan", "inf"])
def test_timeouts_must_be_seconds(tmp_path, capsys, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    p = _write(tmp_path, base_trace())
    line = one_line_error(*cli(capsys, "replay", str(p), "--no-report"))
    assert name in line


@pytest.mark.parametrize("url, fragment", [
    ("not a url", "is not a Redis URL"),
    ("http://localhost:6379", "is not a Redis URL"),
    ("redis://localhost:port/0", "not a URL"),
    ("redis://127.0.0.1:1/0", "no Redis server answers"),
    ("redis://user:secret@127.0.0.1:1/0", "no Redis server answers"),
])
def test_redis_url_unusable_is_one_line_exit_2(tmp_path, capsys, monkeypatch, url, fragment):
    monkeypatch.setenv("KVCHECK_REDIS_URL", url)
    line = one_line_error(*cli(capsys, *FUZZ, "--db", str(tmp_path / "db"),
                               "--out", str(tmp_path / "ce")))
    assert fragment in line and "secret" not in line
    assert not (tmp_path / "ce").exists() and not (tmp_path / "db").exists()


def test_every_environment_variable_the_cli_reads_is_validated():
    """The variables kvcheck's own code reads (outside the reproducers it
    writes, which read theirs under pytest) are the ones tested above."""
    read = set()
    for folder in ("cli", "model", "properties", "impl"):
        for f in (ROOT / folder).rglob("*.py"):
            src = f.read_text()
            for key in ("environ.get(\"", "environ[\"", "getenv(\""):
                for chunk in src.split(key)[1:]:
                    read.add(chunk.split('"')[0])
    read -= {"KVCHECK_ROOT", "KVCHECK_TARGET", "KVCHECK_POLICY"}  # the reproducer's, in its text
    # set by kvcheck for its own worker processes (impl/worker.py), never by a user
    read -= {"KVCHECK_WORKER_SETUP", "KVCHECK_WORKER_VLLM", "KVCHECK_FLIGHT"}
    # set by kvcheck for SGLang and Triton's interpreter in its own worker
    # (impl/sglang/driver.py), never read
    read -= {"SGLANG_SWA_EVICTION_INTERVAL", "TRITON_INTERPRET"}
    assert read <= {"KVCHECK_REDIS_URL", "KVCHECK_VLLM_START_TIMEOUT", "KVCHECK_HANG_TIMEOUT"}, read


# ------------------------------------------- the CLI itself, property-based

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.sampled_from([10**9, 10**12, 10**40])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=6)

PLACES = [["version"], ["config"], ["config", "groups"], ["config", "groups", 0, "kind"],
          ["config", "groups", 0, "param"], *(["config", k] for k in (
              "block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs",
              "max_model_len", "spec_tokens", "depth", "policy", "hazard", "prefix_caching")),
          ["events"], ["events", 0], ["events", 1], ["events", 1, "type"],
          *(["events", 0, k] for k in ("id", "prompt_len", "max_new_tokens", "external_tokens",
                                        "variant")),
          ["meta"], ["meta", "props"], ["meta", "target"], ["meta", "violation"]]


@st.composite
def trace_files(draw) -> bytes:
    """A trace file: the good one with one part replaced, removed or added,
    oversized, or bytes that are not a trace at all."""
    how = draw(st.sampled_from(["good", "replace", "remove", "oversize", "raw", "good",
                                "twice", "odd id"]))
    d = base_trace(policy=draw(st.sampled_from(["settled", "optimistic"])))
    d["meta"] = {}
    if how == "twice":  # a key given twice in one object: refused, never one silently
        key = draw(st.sampled_from(['"policy": ', '"version": ', '"id": ', '"type": ']))
        text = json.dumps(d)
        at = text.index(key)
        end = text.index(",", at)
        return (text[:end] + ", " + text[at:end] + text[end:]).encode()
    if how == "odd id":  # ids any terminal must be able to print (escaped)
        rid = draw(st.sampled_from(["r\ud800", "ré", "r\x1b[2J", "r\u202e", "r" * 300]))
        for ev in d["events"]:
            if "id" in ev:
                ev["id"] = rid
        d["meta"] = draw(st.sampled_from([{}, {"props": [3]}, {"props": [2, 3]}]))
    if how == "raw":
        n = draw(st.sampled_from([40, 1000, 100_000]))
        return draw(st.sampled_from([b"[" * n + b"]" * n, b'{"version": 1, "config": ' + b"7"
                                     * 5000 + b"}", b"\xff\xfe{}", b""]) | st.binary(max_size=30))
    if how != "good":
        path = draw(st.sampled_from(PLACES))
        x = d
        for k in path[:-1]:
            x = x[k]
        if how == "remove":
            x.pop(path[-1], None) if isinstance(x, dict) else x.pop(path[-1])
        elif how == "oversize":
            x[path[-1]] = draw(st.sampled_from([10**9, 10**12, MAX_NUM_BLOCKS + 1,
                                                MAX_MODEL_LEN + 1, "x" * 10_000]))
        else:
            x[path[-1]] = draw(JSON)
    return json.dumps(d).encode()


def _files(folder: Path, out: str) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and out not in p.relative_to(folder).parts}


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        code = main(argv)
    return code, o.getvalue(), e.getvalue()


def _contract(code: int, out: str, err: str) -> None:
    from hypothesis import event

    event(f"exit {code}")
    assert "Traceback" not in out + err
    assert code in (0, 1, 2, 3), code
    if code == 3:  # the target cannot run what was asked: one line that says so
        assert err.strip().splitlines()[-1].startswith("kvcheck: "), err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvcheck: "), err
    elif code in (0, 1):
        assert not err.strip(), err
        assert re.search(r"^(verdict: |\S+ and \S+ (agree|disagree))", out, re.M), out


@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(data=trace_files(), cmd=st.sampled_from(["replay", "diff"]),
       report=st.booleans(), policy=st.sampled_from([None, None, "optimistic", "", "hopeful"]),
       target=st.sampled_from([None, None, "reference", "", "tpu"]))
def test_cli_on_malformed_traces_keeps_the_contract(data, cmd, report, policy, target):
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        folder = Path(tmp)
        (folder / "t.json").write_bytes(data)
        before = _files(folder, "counterexamples")
        if cmd == "replay":
            argv = ["replay", "t.json", *([] if report else ["--no-report"])]
            argv += [] if policy is None else ["--policy", policy]
            argv += [] if target is None else ["--target", target]
        else:
            argv = ["diff", "t.json", "--left", "reference", "--right", target or "reference"]
        _contract(*_run_cli(argv))
        assert _files(folder, "counterexamples") == before  # only the output folder changes
        ce = folder / "counterexamples"
        if ce.exists():
            names = [p.name for p in ce.iterdir()]
            assert all(n.endswith(".png") or n.startswith("test_") for n in names), names


@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["sliding", "chunked_local", "mamba", "hybrid", "hisparse", ""]),
       policy=st.sampled_from([None, "optimistic", "", "hopeful"]),
       nums=st.fixed_dictionaries({}, optional={
           "--depth": st.sampled_from([1, 2, 4, 0, 6]),
           "--spec-tokens": st.sampled_from([0, 2, -1, 10]),
           "--block-size": st.sampled_from([16, 4, 0, 3, 64]),
           "--steps": st.sampled_from([4, 1, -1]),
           "--attention-every": st.sampled_from([0, -1]),
           "--props": st.sampled_from(["1,2", "1", "", "9", "a", "1,,3"]),
           "--seed": st.integers(-5, 5),
           "--drafter": st.sampled_from(["eagle", "mtp", "ngram"])}),
       out=st.sampled_from(["ce", "new/deeper", "a-file", "a-file/sub", ""]),
       examples=st.sampled_from([2, 1, 0, -1]))
def test_cli_on_odd_fuzz_flags_keeps_the_contract(kind, policy, nums, out, examples):
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        folder = Path(tmp)
        (folder / "a-file").write_text("mine")
        argv = ["fuzz", "--quiet", "--kind", kind, "--out", out, "--examples", str(examples)]
        argv += [] if policy is None else ["--policy", policy]
        for flag, v in nums.items():
            argv += [flag, str(v)]
        out_part = Path(out).parts[0] if out else "\0"
        before = _files(folder, out_part)
        _contract(*_run_cli(argv))
        assert _files(folder, out_part) == before
        assert (folder / "a-file").read_text() == "mine"


# ------------------------------------------------------- long traces


def _long_decode(pairs: int, policy: str = "settled") -> Trace:
    d = base_trace(policy=policy, max_model_len=4096)
    d["events"] = [{"type": "AddRequest", "id": "r0", "prompt_len": 64, "max_new_tokens": 2000}]
    d["events"] += [{"type": "Schedule"}, {"type": "Process"}] * pairs
    return Trace.from_json(d)


def test_a_long_trace_draws_its_last_events_as_the_full_grid_would():
    from report.report import TIMELINE_EVENTS, build_grid, render_timeline

    rr = replay(_long_decode(150), "reference")
    full, cut = build_grid(rr), build_grid(rr, shown=40)
    assert len(full.rows) == 301 and len(cut.rows) == 40
    assert cut.first_index == full.rows[-40].index == 261
    assert [r.index for r in cut.rows] == [r.index for r in full.rows[-40:]]
    for lane in cut.lanes:
        key = (lane.rid, lane.group)
        for r in range(40):
            a, b = full.cells[key][261 + r], cut.cells[key][r]
            n = max(len(a), len(b))
            assert a + [full.cell(*key, 261 + r, n)] * (n - len(a)) == \
                b + [cut.cell(*key, r, n)] * (n - len(b)), r
            assert [(w.step, w.first, w.last) for w in full.windows_at(261 + r)] == \
                [(w.step, w.first, w.last) for w in cut.windows_at(r)]
    text = render_timeline(rr)
    assert f"not drawn: the last {TIMELINE_EVENTS} events are shown" in text
    assert len(re.findall(r"^(?:>>|  )  #\d+ ", text, re.M)) == TIMELINE_EVENTS


def test_a_cut_grid_still_shows_the_violation():
    from report.report import build_grid

    d = base_trace()
    d["events"] = [e for i in range(25) for e in (
        {"type": "AddRequest", "id": f"w{i}", "prompt_len": 4, "max_new_tokens": 1},
        {"type": "Abort", "id": f"w{i}"})] + d["events"]
    rr = replay(Trace.from_json(d), "reference")
    assert rr.first is not None and rr.first.prop == 1
    grid = build_grid(rr, shown=5)
    assert len(grid.rows) == 5 and grid.mark is not None and grid.mark.row == 4
    assert grid.cell(grid.mark.rid, grid.mark.group, 4, grid.mark.logical).state == "freed"
    assert grid.freed_under_window() is not None


# ------------------------------------------------ second round (issue 28)


def _subprocess(*args: str, env: dict | None = None, cwd: Path | None = None,
                timeout: float = 300):
    import os
    import subprocess
    import sys

    e = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    e.update(env or {})
    return subprocess.run([sys.executable, str(ROOT / "kvcheck"), *args], capture_output=True,
                          text=True, env=e, cwd=cwd or ROOT, timeout=timeout)


@pytest.mark.parametrize("rid, env", [("r\ud800", {}), ("réq", {"PYTHONIOENCODING": "ascii"})])
def test_an_id_the_terminal_cannot_print_is_escaped(tmp_path, rid, env):
    d = base_trace()
    for ev in d["events"]:
        if "id" in ev:
            ev["id"] = rid
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d))  # a lone surrogate is valid JSON (\ud800)
    r = _subprocess("replay", str(p), "--no-report", env=env, cwd=tmp_path)
    assert r.returncode in (0, 1) and "Traceback" not in r.stdout + r.stderr, r.stderr
    assert "verdict:" in r.stdout and ("\\ud800" in r.stdout or "\\xe9" in r.stdout)
    # the report too: its reproducer keeps an id UTF-8 cannot write as an escape
    r = _subprocess("replay", str(p), env=env, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr
    (py,) = (tmp_path / "counterexamples").glob("test_*.py")
    compile(py.read_text(), str(py), "exec")


@pytest.mark.parametrize("text, says", [
    ('{"version": true, "config": {}, "events": []}', "unsupported version True"),
    ('{"version": 1, "version": 1, "config": {}, "events": []}', "'version' appears twice"),
])
def test_booleans_for_numbers_and_duplicate_keys_are_refused(tmp_path, capsys, text, says):
    p = tmp_path / "t.json"
    p.write_text(text)
    assert says in one_line_error(*cli(capsys, "replay", str(p)))
    d = base_trace()
    raw = json.dumps(d).replace('"policy": "optimistic"',
                                '"policy": "optimistic", "policy": "settled"')
    p.write_text(raw)
    assert "'policy' appears twice" in one_line_error(*cli(capsys, "replay", str(p)))


def test_a_fifo_is_not_a_trace(tmp_path, capsys):
    import os

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    assert "not a regular file" in one_line_error(*cli(capsys, "replay", str(fifo)))


def test_a_run_the_target_refuses_entirely_is_one_line_exit_3(tmp_path, capsys):
    code, out, err = cli(capsys, "fuzz", "--drafter", "eagle", "--examples", "20", "--quiet",
                         "--workers", "1", "--out", str(tmp_path / "ce"))
    line = one_line_error(code, out, err, expect=3)
    assert "runs none of the examples asked for" in line and "drafter eagle" in line


def test_outputs_and_databases_that_cannot_be_written_are_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    long = "x" * 300
    line = one_line_error(*cli(capsys, *FUZZ, "--out", str(tmp_path / long)))
    assert "File name too long" in line and len(line) < 200
    for db in (tmp_path / "file" / "db", Path("/proc/kvcheck-db")):
        line = one_line_error(*cli(capsys, *FUZZ, "--db", str(db),
                                   "--out", str(tmp_path / "ce")))
        assert "cannot write there" in line or "not a folder" in line
    assert (tmp_path / "file").read_text() == "mine"


def test_an_unreachable_redis_is_refused_without_db_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVCHECK_REDIS_URL", "redis://127.0.0.1:1/0")
    assert "no Redis server answers" in one_line_error(*cli(capsys, "prove", "--kind", "full"))


def test_check_refuses_nothing_to_check_and_an_unknown_target(tmp_path, capsys):
    skip = [x for part in ("prove", "fuzz", "power", "attention") for x in ("--skip", part)]
    out = ["--out", str(tmp_path / "r")]
    assert "every part is skipped" in one_line_error(*cli(capsys, "check", *skip, *out))
    assert "bogus" in one_line_error(*cli(capsys, "check", "--target", "bogus", *out))


def test_check_never_writes_over_an_earlier_report(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    skip = [x for part in ("prove", "fuzz", "attention") for x in ("--skip", part)]
    for _ in range(2):
        code, out, _ = cli(capsys, "check", *skip, "--out", "r")
        assert code == 0, out
    runs = [p for p in (tmp_path / "r" / "check").iterdir() if p.name != "latest"]
    assert len(runs) == 2 and all((p / "check.md").is_file() for p in runs)
    (tmp_path / "r" / "check" / "latest").unlink()
    (tmp_path / "r" / "check" / "latest").write_text("mine")
    assert "not kvcheck's link" in one_line_error(*cli(capsys, "check", *skip, "--out", "r"))


def test_named_outputs_are_regular_files_written_through_links_with_their_mode(
        tmp_path, capsys):
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    line = one_line_error(*cli(capsys, *FUZZ, "--examples", "5", "--json", str(fifo),
                               "--out", str(tmp_path / "ce")))
    assert "not a regular file" in line and stat.S_ISFIFO(fifo.stat().st_mode)
    mine = tmp_path / "mine.json"
    mine.write_text("old")
    mine.chmod(0o644)
    link = tmp_path / "link.json"
    link.symlink_to(mine)
    code, out, err = cli(capsys, *FUZZ, "--examples", "5", "--json", str(link),
                         "--out", str(tmp_path / "ce"))
    assert code in (0, 1) and link.is_symlink(), err
    assert json.loads(mine.read_text())["verdict"] and stat.S_IMODE(mine.stat().st_mode) == 0o644


def test_a_file_where_an_output_folder_goes_is_one_line(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "check").write_text("mine")
    skip = [x for part in ("prove", "fuzz", "attention") for x in ("--skip", part)]
    line = one_line_error(*cli(capsys, "check", *skip, "--out", str(tmp_path / "r")))
    assert "cannot make the run folder there" in line
    assert (tmp_path / "r" / "check").read_text() == "mine"
    long = tmp_path / ("a" * 300 + ".py")
    trace = ROOT / "traces" / "attention" / "swa-unordered-optimistic.json"
    line = one_line_error(*cli(capsys, "export", str(trace), "--vllm-test", str(long)))
    assert "cannot write there" in line


def test_no_command_is_one_line_on_stderr():
    r = _subprocess()
    assert r.returncode == 2 and not r.stdout and "name a command" in r.stderr


@pytest.mark.parametrize("sig, code, cmd", [
    ("SIGTERM", 143, "fuzz"), ("SIGHUP", 129, "fuzz"), ("SIGTERM", 143, "gate")])
def test_a_terminating_signal_ends_the_run_as_ctrl_c_does(tmp_path, sig, code, cmd):
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["TMPDIR"] = str(tmp_path)
    # the gate's rows go on in threads of their own while it stops: none may
    # start a worker (and its temporary files) after the signal
    args = ([*FUZZ, "--examples", "100000", "--workers", "2", "--out", str(tmp_path / "ce")]
            if cmd == "fuzz" else
            ["gate", "--target", "reference", "--minutes", "0.5", "--workers", "2",
             "--reports", str(tmp_path / "g")])
    p = subprocess.Popen([sys.executable, str(ROOT / "kvcheck"), *args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("kvcheck-worker-*.log")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0 if cmd == "fuzz" else 6.0)
    p.send_signal(getattr(signal, sig))
    out, err = p.communicate(timeout=60)
    assert p.returncode == code, (out, err)
    assert err.strip().splitlines()[-1] == f"kvcheck: stopped by {sig}"
    assert not list(tmp_path.glob("kvcheck-*")), list(tmp_path.iterdir())
