"""The gate a reviewer runs: its base, attribution (introduced / also on base /
fixed by this change), verdicts that do not depend on the machine's load,
its few lines of output, and its bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gate.attribution import fixed_by_change, replay_on_base
from gate.base import Base, changed_lines, default_base
from gate.known import by_name, fix_files, known_findings, name_of, trace_path, with_fix
from gate.matrix import gate_matrix, narrow, row_id, target_label
from gate.report import GateRun, summary, write_junit
from gate.rows import exit_status
from impl.target import Capabilities
from model.events import Trace
from properties.machine import FuzzResult, FuzzSpec, RunStats
from report.output import OutputError, fresh_run_dir

ROOT = Path(__file__).resolve().parent.parent
KVCHECK = ROOT / "kvcheck"
FIX_SHARERS = "+".join(f"findings/{d}/fix.diff" for d in (  # findings 1-3 together
    "01-failed-load-recompute-reads-null", "02-failed-load-blocks-stay-cached",
    "03-failed-load-in-flight-output-delivered"))
FIX_MAMBA = "findings/05-mamba-align-load-one-block-short/fix.diff"


def gate(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    p = subprocess.run([sys.executable, str(KVCHECK), "gate", *args], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def result(status, i=0, length=None, prop=None, known=None, seconds=2.0, exit_=0, **kw):
    r = {"id": f"row{i}", "target": "vllm@X", "kind": "sliding", "status": status,
         "verdict": status, "detail": "property 1 (freed-while-read): block 4 ...",
         "length": length, "prop": prop, "known": known, "known_label": known,
         "examples": 10, "seconds": seconds, "exit": exit_, "ok": exit_ == 0, "vacuous": []}
    r.update(kw)
    return r


# ------------------------------------------------------------------- matrix


def test_row_ids_short_stable_and_without_path_or_policy():
    caps = Capabilities(kinds=frozenset({"full", "sliding"}), fixed_policy="settled")
    rows, _ = gate_matrix("vllm@/tmp/some/checkout", caps)
    same, _ = gate_matrix("vllm@0.33.0", caps)
    assert [r["id"] for r in rows] == [r["id"] for r in same]  # the folder is not in it
    ids = {r["id"] for r in rows}
    assert len(ids) == len(rows) and max(map(len, ids)) <= 40
    assert "sliding-unordered-d3-k2-pc-fl" in ids and "full-ordered-d1-k0-nopc" in ids
    assert not any("settled" in i or "/" in i for i in ids)
    assert target_label("vllm@/tmp/pr") == "vllm-tree"
    assert row_id("sliding", {"depth": 2}, "reference", "optimistic") == \
        "reference-sliding-optimistic-d2"
    assert [r["id"] for r in narrow(rows, ["sliding-ordered-d1-*"])] == [
        "sliding-ordered-d1-k0-nopc", "sliding-ordered-d1-k0-pc",
        "sliding-ordered-d1-k2-nopc", "sliding-ordered-d1-k2-pc"]
    assert {r["kind"] for r in narrow(rows, kinds=["full"])} == {"full"}
    assert all("-fl" in r["id"] for r in narrow(rows, ["-fl"]))


def test_matrix_leaves_out_what_a_kind_cannot_run():
    caps = Capabilities(kinds=frozenset({"ring", "cross", "sliding"}), fixed_policy="settled",
                        ordered_only={"cross": "no connectors"},
                        kind_max_depth={"cross": (2, "no pipeline parallelism")})
    rows, notes = gate_matrix("vllm@0.33.0", caps)
    of = {k: [r for r in rows if r["kind"] == k] for k in ("ring", "cross", "sliding")}
    # a ring takes no prefix hits and lies beside full attention (two groups:
    # no failed loads on a release), but runs behind a connector
    assert {r["knobs"]["prefix_caching"] for r in of["ring"]} == {False}
    assert {r["knobs"]["hazard"] for r in of["ring"]} == {"ordered", "unordered"}
    assert not any(r["knobs"]["failed_loads"] for r in of["ring"])
    assert len(of["ring"]) == 12
    # cross attention: ordered only, depth 1-2
    assert {(r["knobs"]["hazard"], r["knobs"]["depth"]) for r in of["cross"]} == {
        ("ordered", 1), ("ordered", 2)}
    assert len(of["cross"]) == 4
    # a single-group kind keeps the whole cross product
    assert len(of["sliding"]) == 36 and any(r["knobs"]["failed_loads"] for r in of["sliding"])
    assert "cross: ordered rows only (no connectors)" in notes
    assert any(n.startswith("ring: no failed-load rows") for n in notes)
    wider, _ = gate_matrix("vllm@0.33.0", caps, hybrid_failed_loads=True)
    assert any(r["knobs"]["failed_loads"] for r in wider if r["kind"] == "ring")


def test_feature_rows_the_target_lacks_are_left_out_with_its_reason():
    from gate.base import default_base
    from gate.matrix import feature_rows
    from gate.run import _runnable
    from impl.target import make_target

    target = make_target("reference")
    rows = feature_rows("reference", target.capabilities)
    assert {r["knobs"]["depth"] for r in rows} == {1, 2} and all(r["feature"] for r in rows)
    kept, notes = _runnable(rows, target, default_base("reference"))
    # the reference has no model drafters; it has mixed block sizes and fine hash units
    assert {r["knobs"].get("drafter") for r in kept} == {None}
    assert {r["id"] for r in kept} >= {"hybrid-ordered-d1-k0-pc-b4-mixed",
                                       "hybrid-ordered-d2-k0-pc-unit-fine"}
    assert len(notes) == len(rows) - len(kept) and len(notes) > 0
    assert all("left out, the target refuses it (reference: drafts come from prompt lookup"
               in n for n in notes)


# ----------------------------------------------------------- the verdicts


def test_exit_status_and_verdict_words():
    assert exit_status([result("holds"), result("on base")]) == 0
    assert exit_status([result("holds"), result("not covered", exit_=4)]) == 4
    assert exit_status([result("not covered", exit_=4), result("introduced", exit_=1)]) == 1
    assert exit_status([result("introduced", exit_=1), result("introduced", exit_=3)]) == 3
    base = Base("vllm@0.33.0", "given")
    run = GateRun("vllm@/pr", base, None, 2, 3, 170, [result("introduced", exit_=3)], code=3)
    assert run.verdict == "FAIL"  # an introduced crash fails, exit 3
    assert GateRun("vllm@/pr", base, None, 2, 3, 170, [], code=3).verdict == "TARGET FAILED"
    assert GateRun("vllm@/pr", base, None, 2, 3, 170, [], code=4).verdict == "INCOMPLETE"


def test_summary_stays_within_60_lines_and_names_what_matters():
    base = Base("vllm@0.33.0", "the release the checkout is laid over")
    res = [result("introduced", i, length=3 + i % 5, prop=1, exit_=1,
                  verdict="introduced: p1 (freed-while-read)",
                  trace=f"/r/counterexamples/row{i}.json") for i in range(30)]
    res += [result("on base", 100 + i, length=6, prop=2, known=f"finding {i % 12}",
                   verdict="also on base: p2 (null-read)") for i in range(60)]
    res += [result("not covered", 200 + i, exit_=4, vacuous=["rollback_near_free"],
                   verdict="not covered (lacks rollback_near_free)") for i in range(40)]
    res += [result("holds", 300 + i) for i in range(92)]
    run = GateRun("vllm@/pr", base, None, 2, 3.0, 190, res, code=1)
    lines = summary(run)
    assert len(lines) <= 60, len(lines)
    text = "\n".join(lines)
    assert "introduced 30 · also on base 60 · fixed 0 · hold 92 · not covered 40" in text
    assert "- row0: p1 (freed-while-read), 3 events" in text  # the shortest first
    assert "and 22 more in gate.md" in text
    assert "shortest counterexample: 3 events" in text
    assert "rerun with --minutes" in text and "verdict: FAIL (exit 1)" in text
    md = "\n".join(summary(run, md=True))
    assert md.startswith("## gate vllm@/pr against base vllm@0.33.0") and "`row0`" in md


def test_junit_fails_introduced_skips_not_covered_and_the_base_s_bugs(tmp_path):
    path = tmp_path / "j.xml"
    path.write_text("an earlier report")
    write_junit([result("introduced", 0, exit_=1), result("not covered", 1, exit_=4),
                 result("on base", 2, verdict="also on base: p2 (null-read), known: finding 1"),
                 result("holds", 3)], path, "kvcheck-gate")
    text = path.read_text()
    assert text.count("<failure") == 1 and text.count("<skipped") == 2
    assert 'failures="1"' in text and 'skipped="2"' in text
    # a row that tested nothing past a bug the base has says which
    assert 'message="also on base: p2 (null-read), known: finding 1"' in text


def test_each_run_writes_a_fresh_folder_and_a_latest_link(tmp_path):
    a = fresh_run_dir(tmp_path)
    b = fresh_run_dir(tmp_path)
    assert a != b and a.is_dir() and b.is_dir()
    assert (tmp_path / "latest").resolve() == b.resolve()
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").write_text("the user's")
    with pytest.raises(OutputError, match="not kvcheck's link"):
        fresh_run_dir(tmp_path)
    assert (tmp_path / "latest").read_text() == "the user's"


# ------------------------------------------------------------------- base


def test_default_base():
    assert default_base("vllm@0.33.0").same
    b = default_base(f"vllm@0.33.0+{FIX_MAMBA}")
    assert b.target == "vllm@0.33.0" and not b.same and b.release == "0.33.0"
    assert default_base("reference").same


@pytest.mark.vllm
def test_checkout_without_git_is_compared_with_the_release_it_is_laid_over(tmp_path):
    tree = tmp_path / "pr"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "mutants.py"), "--tree",
                    "swa-window-one-short", str(tree)], check=True, capture_output=True)
    b = default_base(f"vllm@{tree}")
    assert b.target == "vllm@0.33.0" and not b.same and b.release == "0.33.0"
    ch = changed_lines(f"vllm@{tree}", b.target)
    assert list(ch.files) == ["vllm/v1/core/single_type_kv_cache_manager.py"]
    assert ch.lines == 1 and "1 changed line in 1 file" in ch.text()
    # a method added with a blank line before it: its two lines that run
    tree = tmp_path / "cross"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "mutants.py"), "--tree",
                    "cross-freed-as-window", str(tree)], check=True, capture_output=True)
    ch = changed_lines(f"vllm@{tree}", "vllm@0.33.0")
    (rel, lines), = ch.files.items()
    text = (tree / rel).read_text().splitlines()
    assert [text[n - 1].strip()[:27] for n in lines] == [
        "def get_num_skipped_tokens(", "return num_computed_tokens"]


# ---------------------------------------------------------- attribution


def _res(name):
    t = Trace.load(trace_path(name))
    f = by_name(name)
    spec = FuzzSpec(target="vllm@0.33.0", kind=t.config.groups[0].kind)
    if f.prop is None:
        return FuzzResult(spec, RunStats(), crash=f"ValueError: {f.text}", trace=t)
    from properties.invariants import Violation

    return FuzzResult(spec, RunStats(), violation=Violation(f.prop, f.text), trace=t)


@pytest.mark.vllm
def test_a_counterexample_is_introduced_only_where_the_base_holds():
    res = _res("failed-load-recompute-reads-null-sliding")
    assert replay_on_base(res, Base("vllm@0.33.0", "given")).fails  # pre-existing
    fixed = replay_on_base(res, Base(f"vllm@0.33.0+{FIX_SHARERS}", "given"))
    assert not fixed.fails  # seen against a base with the fix: the change brought it
    assert replay_on_base(res, Base("x", "given", same=True)).fails


@pytest.mark.vllm
def test_fixed_by_this_change_and_the_known_name():
    import time

    base = Base("vllm@0.33.0", "given", release="0.33.0")
    fixed, done, total = fixed_by_change(base, f"vllm@0.33.0+{FIX_MAMBA}",
                                         time.monotonic() + 400)
    assert done == total and total >= 20
    names = {Path(f.trace).stem for f in fixed}
    assert names == {"mamba-align-load-admits-one-block-short"}, names
    assert fixed[0].label.startswith("finding 5, Mamba align") and "PR #46892" in fixed[0].label
    # finding 5's crash with other numbers is named by its shape, everywhere
    res = _res("mamba-align-load-admits-one-block-short")
    res.crash = "ValueError: Cannot get 4 free blocks from the pool"
    findings = known_findings()
    assert name_of(res, findings, None) == ("mamba-align-load-admits-one-block-short", "")


@pytest.mark.vllm
def test_finding_3_seen_through_another_kind_is_named_by_its_fix():
    t = Trace.load(ROOT / "traces" / "vllm" / "failed-load-in-flight-output-sliding-0.33.0.json")
    from properties.jobs import replay_beside

    rr = replay_beside(t, "vllm@0.33.0")
    res = FuzzResult(FuzzSpec(target="vllm@0.33.0", kind="sliding"), RunStats(),
                     violation=rr.first, trace=t)
    known, how = name_of(res, known_findings(), "0.33.0")
    assert by_name(known).number == 3 and how == " (gone on its fix)"


# ------------------------------------------------------------ end to end


@pytest.mark.vllm
def test_gate_of_a_slip_fails_with_it_introduced_and_the_release_does_not(tmp_path):
    tree = tmp_path / "pr"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "mutants.py"), "--tree",
                    "swa-window-one-short", str(tree)], check=True, capture_output=True)
    rows = ["sliding-ordered-d1-k0-*", "sliding-unordered-d1-k0-nopc-fl"]
    args = ["--minutes", "1.5", "--seed", "1", "--workers", "1", "--quiet",
            *[x for r in rows for x in ("--rows", r)]]
    code, out, err = gate("--target", f"vllm@{tree}", "--base", "vllm@0.33.0",
                          "--reports", str(tmp_path / "pr-reports"), *args)
    assert code == 1, out + err
    lines = out.strip().splitlines()
    assert len(lines) <= 60 and lines[0].startswith(f"gate vllm@{tree} against base vllm@0.33.0")
    assert "changed: 1 changed line in 1 file" in out
    assert "changed lines executed: 1 of 1" in out  # the probe traced the slip's line
    assert "introduced (fails on the target, holds on the base):" in out
    assert "p1 (freed-while-read)" in out and lines[-1].startswith("verdict: FAIL (exit 1)")
    g = json.loads((tmp_path / "pr-reports" / "latest" / "gate.json").read_text())
    intro = [r for r in g["rows"] if r["status"] == "introduced"]
    assert intro and all(r["known"] is None and Path(r["trace"]).is_file() for r in intro)
    # the slip's own property (a window one short frees a block still read);
    # finding 1's null read after a failed load is the base's, never the change's
    assert all(r["prop"] == 1 for r in intro), [r["verdict"] for r in intro]

    code, out, err = gate("--target", "vllm@0.33.0", "--reports",
                          str(tmp_path / "base-reports"), *args)
    assert code in (0, 4), out + err
    assert "against base vllm@0.33.0 (the release itself" in out and "FAIL" not in out


@pytest.mark.vllm
def test_a_known_finding_a_change_exposes_is_named_by_its_fix_on_the_change(tmp_path):
    """A counterexample on a pull request's tree that the base cannot show
    (another eviction order reaches a failed load's block by another trace)
    is the known finding when it holds once that finding's fix is applied to
    the pull request's tree itself (vllm@PATH+FIX.diff)."""
    from gate.known import exposed

    tree = tmp_path / "pr"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "mutants.py"), "--tree",
                    "cached-evicted-first", str(tree)], check=True, capture_output=True)
    res = _res("failed-load-in-flight-output-delivered")
    findings = known_findings()
    assert by_name(exposed(res, findings, f"vllm@{tree}", "0.33.0"), findings).number == 3
    # a slip's own counterexample matches no finding's fix: it stays introduced
    slip = _res("failed-load-in-flight-output-delivered")
    from properties.invariants import Violation

    slip.violation = Violation(1, "property 1 (freed-while-read): block 4 returned")
    assert exposed(slip, findings, f"vllm@{tree}", "0.33.0") is None


@pytest.mark.vllm
def test_a_row_looks_past_the_bugs_its_base_shows_alike(tmp_path):
    """A change that fixes finding 5, gated on a row where finding 1 fails
    most examples on both trees: each such example is passed over (replayed
    on the base in the row's run), the row runs on past them, finds nothing
    of the change's own, and lists the base's bug, named."""
    code, out, err = gate("--target", with_fix("vllm@0.33.0", FIX_MAMBA), "--base",
                          "vllm@0.33.0", "--rows", "sliding-unordered-d1-k0-nopc-fl",
                          "--minutes", "1", "--workers", "1", "--seed", "1", "--quiet",
                          "--reports", str(tmp_path / "r"))
    assert code in (0, 4), out + err
    (row,) = json.loads((tmp_path / "r" / "latest" / "gate.json").read_text())["rows"]
    assert row["status"] == "on base" and row["passed_over"] >= 1, row
    assert row["examples"] > row["passed_over"]  # it went on past them
    pv = json.loads((tmp_path / "r" / "latest" / "gate.json").read_text())["provenance"]
    assert pv["seed"] == 1 and set(pv["vllm_releases"].values()) == {"0.33.0"}
    assert by_name(row["known"]).number in (1, 2, 3), row["known"]
    assert "introduced 0" in out


def test_bad_gate_input_is_one_line_and_exit_2(tmp_path):
    for args, says in ((["--target", "vllm@0.33"], "not a release number"),
                       (["--target", f"vllm@{tmp_path}/none"], "neither a vLLM release"),
                       (["--target", "reference", "--minutes", "0.05"], "below the"),
                       (["--target", "reference", "--rows", "nothing-like-this"], "no row"),
                       (["--target", "reference", "--base", "vllm@0.33.0"], "not the engine")):
        code, out, err = gate(*args, "--reports", str(tmp_path / "r"), timeout=120)
        assert code == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1 and says in err, (args, err)
        assert "Traceback" not in err


def test_changed_lines_missed_and_rows_that_execute_them_first():
    from gate.base import Changes
    from gate.coverage import WEIGHT, Probe, _group, hit_weight, prioritize

    ch = Changes({"vllm/a.py": [3, 4, 5, 9], "vllm/b.py": [1]})
    p = Probe({"vllm/a.py": {4}}, {("sliding", "ordered", False, None, None, None)}, 2, 1.0)
    assert p.count() == 1 and "1 of 5" in p.text(ch)
    assert p.missed(ch) == ["vllm/a.py:3", "vllm/a.py:5", "vllm/a.py:9", "vllm/b.py:1"]
    caps = Capabilities(kinds=frozenset({"full", "sliding"}), fixed_policy="settled")
    rows, _ = gate_matrix("vllm@0.33.0", caps)
    out = prioritize(rows, p)
    first = [r for r in out if r.get("executes_changes")]
    assert len(out) == len(rows) and out[:len(first)] == first and first
    # 12 of the 72 rows execute it: together they get half the budget
    assert len(first) == 12 and hit_weight(12, 60) == 5.0
    assert all(r["kind"] == "sliding" and r["knobs"]["hazard"] == "ordered"
               and r.get("weight") == 5.0 for r in first)
    assert hit_weight(60, 12) == WEIGHT  # where most rows execute it, three shares each
    # full attention's rows marked by reading only: after the rows the probe
    # saw, three shares each, and the rows it saw keep half the budget
    p.groups_read = {g for g in (_group(r) for r in rows) if g[0] == "full"}
    out = prioritize(rows, p)
    read = [r for r in out if r.get("executes_changes") and r["kind"] == "full"]
    assert read and out[:len(first)] == [r for r in out if r["kind"] == "sliding"
                                         and r["knobs"]["hazard"] == "ordered"]
    assert out[len(first):len(first) + len(read)] == read
    assert all(r["weight"] == WEIGHT for r in read)
    rest = len(rows) - len(first) - len(read)
    assert out[0]["weight"] == hit_weight(12, rest + WEIGHT * len(read)) > 5.0


def test_a_change_inside_a_manager_class_marks_the_kinds_it_manages(tmp_path):
    from gate.base import Changes
    from gate.coverage import MANAGERS, kinds_of_changes

    f = tmp_path / MANAGERS
    f.parent.mkdir(parents=True)
    f.write_text("\n".join([
        "class SingleTypeKVCacheManager:",                         # 1
        "    pass",                                                # 2
        "class FullAttentionManager(SingleTypeKVCacheManager):",   # 3
        "    x = 1",                                               # 4
        "class SinkFullAttentionManager(FullAttentionManager):",   # 5
        "    x = 2",                                               # 6
        "class CrossAttentionManager(SingleTypeKVCacheManager):",  # 7
        "    x = 3",                                               # 8
        "def helper():",                                           # 9
        "    return 1",                                            # 10
        "class RSWAManager(FullAttentionManager):",                # 11
        "    pass", ""]))

    def kinds(*lines):
        return kinds_of_changes(Changes({MANAGERS: list(lines)}), tmp_path)

    assert kinds(8) == {"cross"}
    assert kinds(6) == {"sink"}
    # full attention's rows, the kinds inheriting it, those beside it, hybrids
    assert kinds(4) == {"full", "sink", "rswa", "ring", "cross", "hybrid"}
    assert kinds(2) >= {"full", "sliding", "mamba", "chunked_local", "cross", "hybrid"}
    assert kinds(10) == set()  # outside every class: only the probe can tell
    assert kinds_of_changes(Changes({"vllm/v1/core/kv_cache_utils.py": [3]}), tmp_path) == set()


def test_a_run_against_a_base_passes_over_what_the_base_fails_alike():
    """The gate's rows look past the base's own bugs: an example failing on
    the base the same way (there: the very same target) is rejected, counted
    and kept aside, and the run reports only a failure of its own."""
    from properties.jobs import base_fails
    from properties.machine import fuzz

    spec = FuzzSpec(target="reference", kind="sliding", policy="optimistic", depth=2)
    alone = fuzz(spec, examples=300, seed=3)
    assert alone.violation is not None  # the control: this setting fails
    res = fuzz(FuzzSpec(target="reference", kind="sliding", policy="optimistic", depth=2),
               examples=300, seed=3, base_fails=base_fails("reference"))
    assert res.violation is None and res.crash is None
    assert res.stats.on_base >= 1
    own = res.base_result()
    assert own is not None and own.violation.prop == alone.violation.prop
    assert own.trace is not None and own.verdict == "violation"
    # a base that never fails alike leaves the run as it was
    res = fuzz(FuzzSpec(target="reference", kind="sliding", policy="optimistic", depth=2),
               examples=300, seed=3, base_fails=lambda *a: False)
    assert res.violation is not None and res.stats.on_base == 0 and res.base_result() is None


# ------------------------------------------------ fuzz --base, replay --base


def kvcheck(*args, timeout=600, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    p = subprocess.run([sys.executable, str(KVCHECK), *args], capture_output=True, text=True,
                       cwd=cwd, env=env, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.vllm
def test_replay_with_a_base_says_introduced_on_base_or_fixed(tmp_path):
    trace = str(trace_path("failed-load-recompute-reads-null-sliding"))
    fixed = with_fix("vllm@0.33.0", FIX_SHARERS)
    code, out, err = kvcheck("replay", trace, "--target", "vllm@0.33.0", "--base", fixed,
                             "--no-report", cwd=tmp_path)
    assert code == 1 and f"introduced: the base {fixed} holds on it" in out, out + err
    code, out, err = kvcheck("replay", trace, "--target", fixed, "--base", "vllm@0.33.0",
                             "--no-report", cwd=tmp_path)
    assert code == 0, out + err
    assert "fixed by the target: the base vllm@0.33.0 violates property 2 (null-read)" in out
    code, out, err = kvcheck("replay", trace, "--target", "vllm@0.33.0",
                             "--base", f"vllm@0.33.0+{ROOT / FIX_MAMBA}", "--no-report",
                             cwd=tmp_path)
    assert code == 0 and "also on base" in out, out + err  # another fix: still there
    code, out, err = kvcheck("replay", trace, "--target", "vllm@0.33.0", "--base", "reference",
                             cwd=tmp_path)
    assert code == 2 and "not the engine" in err and len(err.strip().splitlines()) == 1


@pytest.mark.vllm
def test_fuzz_with_a_base_attributes_its_counterexample(tmp_path):
    tree = tmp_path / "pr"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "mutants.py"), "--tree",
                    "swa-window-one-short", str(tree)], check=True, capture_output=True)
    args = ["fuzz", "--kind", "sliding", "--depth", "1", "--seed", "1", "--workers", "1",
            "--quiet", "--no-report"]
    # the slip, against the release it is laid over: introduced
    code, out, err = kvcheck(*args, "--no-failed-loads", "--target", f"vllm@{tree}",
                             "--base", "vllm@0.33.0", "--out", str(tmp_path / "a"),
                             "--json", str(tmp_path / "a.json"))
    assert code == 1, out + err
    assert "introduced: the base vllm@0.33.0 holds on it" in out
    assert json.loads((tmp_path / "a.json").read_text())["attribution"] == "introduced"
    # finding 1 on the release, against a base with another finding's fix: on base
    other = f"vllm@0.33.0+{ROOT / FIX_MAMBA}"
    code, out, err = kvcheck(*args, "--target", "vllm@0.33.0", "--base", other,
                             "--out", str(tmp_path / "b"), "--json", str(tmp_path / "b.json"))
    assert code == 0, out + err
    assert "known: finding 1" in out and f"also on base {other}" in out
    assert json.loads((tmp_path / "b.json").read_text())["attribution"] == "on base"


def test_the_bases_saved_failures_are_replayed_first_and_kept(tmp_path):
    from properties.database import open_database, recording
    from properties.machine import database_key, fuzz

    failing = FuzzSpec(target="reference", kind="sliding", policy="optimistic", depth=2)
    res = fuzz(failing, examples=300, seed=3, database=open_database(tmp_path / "db"))
    assert res.violation is not None
    key = database_key(failing)
    saved = list(open_database(tmp_path / "db").fetch(key))
    assert saved  # the key Hypothesis itself filed the failure under
    holding = FuzzSpec(target="reference", kind="sliding", policy="settled", depth=2)
    db = recording(open_database(tmp_path / "db"), {database_key(holding): key})
    again = fuzz(holding, examples=20, seed=3, database=db)
    assert again.violation is None and again.crash is None
    assert db.borrowed == len(saved) and db.replayed == 0
    assert sorted(open_database(tmp_path / "db").fetch(key)) == sorted(saved)  # still its own
    db = recording(open_database(tmp_path / "db"), {key: key + b"-none"})
    assert fuzz(failing, examples=20, seed=4, database=db).violation is not None
    assert db.replayed >= 1 and db.borrowed == 0


def test_the_findings_a_change_may_fix_are_replayed_first():
    from gate.attribution import finding_traces, likely_first

    paths = finding_traces()
    named = likely_first(paths, f"vllm@0.33.0+{FIX_MAMBA}", set())
    assert named[0].stem == "mamba-align-load-admits-one-block-short"
    assert sorted(named) == sorted(paths)  # every trace, only reordered
    by_file = likely_first(paths, "vllm@/tmp/pr", {"vllm/v1/core/sched/scheduler.py"})
    first = json.loads(by_file[0].read_text())["meta"]["fixed_by"]
    assert any("vllm/v1/core/sched/scheduler.py" in p.read_text() for p in fix_files(first))
    assert likely_first(paths, "vllm@/tmp/pr", set()) == paths  # no hint: as they were


def test_a_row_without_a_given_seed_records_the_one_it_ran_with(tmp_path):
    from gate.matrix import make_row
    from gate.rows import run_row

    row = make_row("reference", "full", "settled", {"depth": 1, "spec_tokens": 0})
    seeds = {run_row(row, 1.5, None, tmp_path, seed=None)["seed"] for _ in range(2)}
    assert len(seeds) == 2 and all(isinstance(s, int) and s > 0 for s in seeds)
    assert run_row(row, 1.5, None, tmp_path, seed=7)["seed"] == 7
