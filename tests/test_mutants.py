"""Mutation testing (scripts/mutants.py, ``make mutants``).

Each mutant is one edit to vLLM 0.33.0's own freeing or accounting code, or
to the reference manager's, that the checker was never written against:
window off-by-ones for sliding, chunked-local, Mamba and hybrid models, block
rounding, in-flight counters reset or drained wrongly, the deferred-free fence
switched off or one step early, reference counts dropped or not taken,
rollbacks forgotten. Every one must be killed by a property the mutant is
expected to trip, with a short counterexample; a harmless edit and the
unmodified trees (the ``control`` rows) must pass. The vLLM rows need the
release installed (``make test`` does it): a missing install fails here, it
never skips.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import mutants  # noqa: E402

ROWS = [pytest.param(m, id=m.name, marks=[pytest.mark.vllm] if m.subject == "vllm" else [])
        for m in mutants.MUTANTS]


def test_every_subject_has_a_control_and_mutants_of_every_outcome():
    for subject in ("vllm", "reference"):
        rows = [m for m in mutants.MUTANTS if m.subject == subject]
        # one control per tree: the release, and each fixed tree rows edit
        assert sum(not m.file and not m.base for m in rows) == 1, f"{subject}: one control row"
        for base in {m.base for m in rows if m.base}:
            assert sum(not m.file and m.base == base for m in rows) == 1, (subject, base)
        assert sum(m.outcome == "killed" for m in rows) >= 7, subject
    assert len({m.name for m in mutants.MUTANTS}) == len(mutants.MUTANTS)


@pytest.mark.parametrize("m", ROWS)
def test_mutant_has_its_expected_outcome(m, tmp_path):
    row = mutants.run_one(m, examples=150, seed=1, out=tmp_path / "out", work=tmp_path / "work")
    assert row.ok, (f"{row.name}: wanted {row.wanted} "
                    f"{'by property ' + str(row.expect) if row.expect else ''}, "
                    f"got {row.outcome}: {row.message}")
    if row.outcome == "killed":
        assert row.events is not None and row.events <= m.max_events, row
        assert Path(row.trace).is_file(), "the counterexample trace was not kept"
        assert row.message.startswith("VIOLATION property"), row.message
        if row.prop == 3:  # says which way the pool is off, or what in it broke
            assert "block(s)" in row.message or "pool integrity: block" in row.message, \
                row.message


def test_an_anchor_that_moved_is_a_clear_error(tmp_path):
    moved = mutants.Mutant("moved", "impl/reference/managers.py", "no such line", "x",
                           "an edit whose anchor is gone", ("--kind", "full"), frozenset({1}),
                           subject="reference")
    with pytest.raises(mutants.AnchorError, match="occurs 0 times"):
        mutants.mutant_tree(moved, tmp_path / "moved")
    assert mutants.main(["--only", "no-such-mutant"]) == 2


@pytest.mark.parametrize("name,linked", [
    pytest.param("optimistic-basis", "vllm/v1/core/block_pool.py", marks=pytest.mark.vllm),
    ("ref-fence-one-step-early", "impl/reference/block_pool.py"),
])
def test_a_mutant_tree_edits_one_file_and_links_the_rest(tmp_path, name, linked):
    m = next(x for x in mutants.MUTANTS if x.name == name)
    tree = mutants.mutant_tree(m, tmp_path / "t")
    edited = tree / ("vllm" if m.subject == "vllm" else "") / m.file
    assert not edited.is_symlink() and m.new in edited.read_text()
    assert m.old not in edited.read_text()
    assert (tree / linked).is_symlink()
    original = (mutants.INSTALLED if m.subject == "vllm" else mutants.ROOT) / m.file
    assert m.old in original.read_text(), "the original file was changed"
