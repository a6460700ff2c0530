"""Counterexample reports: the picture's data, the PNG, the timeline, the
pytest reproducer (fails on the buggy target, passes on the fixed one), the
CLI wiring, and the fuzz progress line."""

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model.events import AddRequest, Schedule, Trace, sliding
from properties.replay import format_timeline, replay
from report.report import build_grid, render_png, write_report, write_reproducer
from tests.vllm_targets import vllm_target

ROOT = Path(__file__).resolve().parent.parent


def known(policy: str = "optimistic") -> Trace:
    """The seed bug: sliding W=16, B=16, budget 64, async depth 2. Step 0
    computes [0, 64); scheduling step 1 frees on the optimistic count 64
    (skipped 49: logical blocks 0..2) while step 0, unprocessed, reads them."""
    cfg = sliding(16, block_size=16, num_blocks=64, max_num_batched_tokens=64, depth=2,
                  policy=policy)
    return Trace(cfg, [AddRequest("r0", 100, 8), Schedule(), Schedule()],
                 {"target": "reference"})


def pytest_file(path: Path, env_extra: dict, cwd: Path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCHECK_TARGET", "KVCHECK_POLICY") and not k.startswith("PYTEST_XDIST")}
    env.update(env_extra)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(path)], capture_output=True, text=True, cwd=cwd, env=env,
                       timeout=900)
    return p.returncode, p.stdout + p.stderr


# ------------------------------------------------------------- the grid



def test_grid_follows_a_slot_whose_hit_was_copied_then_handed_another_block():
    # a prefix hit ending inside block 1 is copied into block 2, the slot's
    # own (CopyObs); the slot later takes block 3: the grid follows both moves
    from model.events import Config, Group
    from model.observations import AllocObs, CopyObs, Observed
    from properties.replay import ReplayResult, Row

    cfg = Config(groups=(Group("full"),), block_size=4, num_blocks=8,
                 max_num_batched_tokens=8, max_num_seqs=4, max_model_len=32,
                 prefix_caching=True)
    evs = [AddRequest("r0", 6, 2), Schedule(), Schedule()]
    obs = [Observed([]),
           Observed([AllocObs(1, 0, "r0", 0, cached=True), CopyObs(1, 2, 0, "r0", 0)]),
           Observed([AllocObs(3, 0, "r0", 0)])]
    rows = [Row(i, e, o, ()) for i, (e, o) in enumerate(zip(evs, obs, strict=True))]
    g = build_grid(ReplayResult(Trace(cfg, evs), rows, [], {}))
    assert g.cell("r0", 0, 1, 0).block == 2
    assert g.cell("r0", 0, 2, 0).state == "live" and g.cell("r0", 0, 2, 0).block == 3

def test_grid_shows_freed_block_under_unprocessed_window():
    rr = replay(known(), "reference")
    assert rr.first is not None and rr.first.prop == 1
    g = build_grid(rr)
    m = g.mark
    assert m is not None and m.prop == 1 and m.rid == "r0" and m.group == 0
    assert m.row == 2 and isinstance(g.rows[m.row].event, Schedule)
    assert g.rows[1].step == 0 and g.rows[2].step == 1
    cell = g.cell("r0", 0, m.row, m.logical)
    assert cell.state == "freed" and cell.block == m.block
    w = g.freed_under_window()
    assert w is not None, "the freed block must lie under an unprocessed step's window"
    assert w.step == 0 and not w.dead and w.covers(m.logical)
    assert (w.start, w.end) == (0, 64) and (w.first, w.last) == (0, 3)
    freed = [lg for lg in range(g.width) if g.cell("r0", 0, m.row, lg).state == "freed"]
    assert freed == [0, 1, 2]
    for lg in freed:
        assert [x.step for x in g.windows_over("r0", 0, m.row, lg)] == [0]
    # before the second Schedule, the same blocks were live under step 0's window
    assert [g.cell("r0", 0, 1, lg).state for lg in range(4)] == ["live"] * 4
    # step 1's window starts at position 64 - 16 + 1 = 49: logical 3 on
    w1 = [x for x in g.windows_at(m.row, "r0", 0) if x.step == 1]
    assert len(w1) == 1 and (w1[0].first, w1[0].last) == (3, 6)


def test_grid_settled_twin_has_no_mark_and_no_free():
    rr = replay(known("settled"), "reference")
    assert rr.first is None
    g = build_grid(rr)
    assert g.mark is None and g.freed_under_window() is None
    states = {c.state for rows in g.cells.values() for row in rows for c in row}
    assert "freed" not in states and "live" in states


def test_png_of_known_counterexample(tmp_path):
    import matplotlib.image as mpimg

    rr = replay(known(), "reference")
    path = render_png(build_grid(rr), tmp_path / "known.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    img = mpimg.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 300
    # the violation box is drawn in pure red (#d50000) somewhere
    r, gch, b = img[..., 0], img[..., 1], img[..., 2]
    assert ((r > 0.8) & (gch < 0.05) & (b < 0.05)).sum() > 50


def test_timeline_story(tmp_path):
    text = format_timeline(replay(known(), "reference"))
    lines = text.splitlines()
    bad = [ln for ln in lines if ln.startswith(">>  #2")]
    assert bad and "Schedule()  -> step 1" in bad[0]
    assert re.search(r"r0 returns blocks [0-9@, ]+ \(window\)", text)
    assert "p=0 f=100 c=100" in text and "p=0 f=64 c=64" in text
    table = next(ln for ln in lines[lines.index(bad[0]):] if ln.strip().startswith("table"))
    assert re.search(r">\d+\*<", table), table  # the violating block, returned now
    assert table.count("*") == 3
    assert any(ln.strip().startswith("step 0") and "[===" in ln and "reads [0, 64)" in ln
               for ln in lines)
    assert "VIOLATION property 1" in text
    assert "went back to the pool while step 0, unprocessed" in text


def test_timeline_when_all_hold():
    text = format_timeline(replay(known("settled"), "reference"))
    assert text.rstrip().endswith("all properties hold") and ">>" not in text


# ------------------------------------------------------------ reproducer


def test_reproducer_fails_on_buggy_policy_passes_on_settled(tmp_path):
    path = write_reproducer(known(), tmp_path / "test_seed_bug.py", "reference")
    src = path.read_text()
    assert str(ROOT) in src and "KVCHECK_TARGET" in src
    compile(src, str(path), "exec")
    rc, out = pytest_file(path, {}, tmp_path)
    assert rc == 1, out
    assert "property 1 (freed-while-read)" in out and "1 failed" in out
    rc, out = pytest_file(path, {"KVCHECK_TARGET": "reference", "KVCHECK_POLICY": "settled"},
                          tmp_path)
    assert rc == 0, out
    assert "1 passed" in out


def test_reproducer_names_a_missing_repo(tmp_path):
    path = write_reproducer(known(), tmp_path / "test_moved.py", "reference")
    rc, out = pytest_file(path, {"KVCHECK_ROOT": str(tmp_path / "nowhere")}, tmp_path)
    assert rc == 1 and "kvcheck not found" in out


@pytest.mark.vllm
def test_reproducer_fails_on_vllm_0_25_1_passes_on_0_33_0(tmp_path):
    for v in ("0.25.1", "0.33.0"):
        vllm_target(v)
    rr = replay(known(), "reference")
    rep = write_report(rr, tmp_path, "seed-bug", "vllm@0.25.1")
    assert rep.reproducer is not None and rep.png is not None, rep.errors
    rc, out = pytest_file(rep.reproducer, {}, tmp_path)  # default: the target it names
    assert rc == 1, out
    assert "property 1 (freed-while-read)" in out, out
    assert "target vllm@0.25.1 crashed" not in out, out
    rc, out = pytest_file(rep.reproducer, {"KVCHECK_TARGET": "vllm@0.33.0"}, tmp_path)
    assert rc == 0, out


# ------------------------------------------------------------------- CLI


def kvcheck(*args, cwd):
    env = dict(os.environ, KVCHECK_NO_VENV="1")
    p = subprocess.run([sys.executable, str(ROOT / "kvcheck"), *args], capture_output=True,
                       text=True, cwd=cwd, env=env, timeout=600)
    return p.returncode, p.stdout, p.stderr


def _printed(out: str, what: str) -> Path:
    m = re.search(rf"^{what}: (\S+)", out, re.M)
    assert m, f"no '{what}:' line in:\n{out}"
    return Path(m.group(1))


def test_cli_fuzz_writes_picture_and_reproducer(tmp_path):
    code, out, err = kvcheck("fuzz", "--kind", "sliding", "--policy", "optimistic", "--depth",
                             "2", "--examples", "300", "--seed", "0", "--out",
                             str(tmp_path / "ce"), "--quiet", cwd=tmp_path)
    assert code == 1, out + err
    trace = _printed(out, "trace saved")
    png = _printed(out, "picture")
    repro = _printed(out, "reproducer")
    assert png == trace.with_suffix(".png") and png.read_bytes()[:4] == b"\x89PNG"
    assert repro.parent == trace.parent and repro.name.startswith("test_")
    # the report lines come last
    tail = out.strip().splitlines()[-2:]
    assert tail[0].startswith("picture:") and tail[1].startswith("reproducer:")
    rc, rout = pytest_file(repro, {}, tmp_path)
    assert rc == 1 and "property 1" in rout, rout


def test_cli_no_report(tmp_path):
    code, out, _ = kvcheck("fuzz", "--kind", "sliding", "--policy", "optimistic", "--depth",
                           "2", "--examples", "300", "--seed", "0", "--out", str(tmp_path),
                           "--quiet", "--no-report", cwd=tmp_path)
    assert code == 1 and "picture:" not in out
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("test_*.py"))


def test_cli_replay_writes_report_under_counterexamples(tmp_path):
    t = known().save(tmp_path / "in" / "seed.json")
    code, out, _ = kvcheck("replay", str(t), cwd=tmp_path)
    assert code == 1, out
    png = _printed(out, "picture")
    assert (tmp_path / png).resolve() == (tmp_path / "counterexamples" / "seed.png").resolve()
    assert (tmp_path / "counterexamples" / "test_seed.py").exists()
    assert not list((tmp_path / "in").glob("*.png"))  # the input's folder is left alone
    code, out, _ = kvcheck("replay", str(t), "--policy", "settled", cwd=tmp_path)
    assert code == 0 and "picture:" not in out


def test_help_shows_examples_and_report_flag():
    for sub in ("fuzz", "replay", "prove", "check"):
        code, out, _ = kvcheck(sub, "--help", cwd=ROOT)
        assert code == 0 and "example" in out
    code, out, _ = kvcheck("fuzz", "--help", cwd=ROOT)
    assert "--no-report" in out


# -------------------------------------------------------------- progress


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class FakeMachine:
    pass


def _machine(examples, events):
    from properties.machine import RunStats

    cls = type("M", (FakeMachine,), {"stats": RunStats(examples=examples)})
    cls.stats.events.update(events)
    return cls()


def test_progress_tty_single_line(monkeypatch):
    from report.progress import Progress

    monkeypatch.setenv("COLUMNS", "200")
    s, clock = io.StringIO(), FakeClock()
    p = Progress("fuzz reference sliding/settled", stream=s, tty=True, clock=clock)
    for i in range(1, 41):
        clock.t = i * 0.1
        p("setup", _machine(i * 10, {"Schedule": i * 7, "Process": i * 3}))
    out = s.getvalue()
    assert "\n" not in out and out.count("\r") >= 10
    last = out.split("\r")[-1]
    assert "390 examples" in last and "/s" in last and "0:00:03" in last
    assert "Schedule 273" in last and "Process 117" in last
    p.close()
    assert s.getvalue().endswith("\r")
    monkeypatch.setenv("COLUMNS", "40")  # never wider than the terminal
    s2 = io.StringIO()
    p2 = Progress("fuzz", stream=s2, tty=True, clock=clock)
    clock.t += 1
    p2("setup", _machine(5, {"Schedule": 5, "Process": 4, "AddRequest": 3}))
    assert max(len(x) for x in s2.getvalue().split("\r")) <= 39


def test_progress_quiet_off_a_terminal():
    from report.progress import Progress

    s, clock = io.StringIO(), FakeClock()
    p = Progress("fuzz", stream=s, clock=clock)  # StringIO is no terminal
    assert not p.tty and p.every == 30.0
    for i in range(290):
        clock.t = i * 0.1
        p("teardown", _machine(i, {"Schedule": i}))
    assert s.getvalue() == ""
    clock.t = 31.0
    p("teardown", _machine(300, {"Schedule": 300}))
    assert s.getvalue().count("\n") == 1 and "300 examples" in s.getvalue()
    silent = Progress("fuzz", stream=io.StringIO(), every=0)
    silent("setup", _machine(1, {}))
    assert silent.stream.getvalue() == ""


def test_progress_hooked_into_fuzz():
    from properties.machine import FuzzSpec, fuzz
    from report.progress import Progress

    calls = []
    s = io.StringIO()
    p = Progress("fuzz", stream=s, tty=False, every=1e-9)

    def cb(phase, machine):
        calls.append(phase)
        p(phase, machine)

    res = fuzz(FuzzSpec(kind="full", policy="settled"), examples=15, seed=1, on_example=cb)
    assert calls.count("setup") == res.stats.examples
    assert calls.count("teardown") >= res.stats.examples
    assert p.examples == res.stats.examples and p.events == dict(res.stats.events)
    assert s.getvalue().count("\n") >= res.stats.examples
