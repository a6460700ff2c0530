"""Mutation testing on the real vLLM (scripts/mutants.py, ``make mutants``).

Each mutant is one edit to vLLM 0.33.0's own freeing or accounting code that
the checker was never written against: window off-by-ones for sliding,
chunked-local, Mamba and hybrid models, block rounding, in-flight counters
reset or drained wrongly, the deferred-free fence switched off or one step
early, reference counts dropped or not taken, rollbacks forgotten. Every one
must be killed by a property the mutant is expected to trip, with a short
counterexample; a harmless edit and the unmodified release (``control``)
must pass. The release must be installed (``make test`` does it): a missing
install fails here, it never skips.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import mutants  # noqa: E402

pytestmark = pytest.mark.vllm

ROWS = [None, *mutants.MUTANTS]


@pytest.mark.parametrize("m", ROWS, ids=[m.name if m else "control" for m in ROWS])
def test_mutant_has_its_expected_outcome(m, tmp_path):
    row = mutants.run_one(m, examples=150, seed=1, out=tmp_path / "out", work=tmp_path / "work")
    assert row.ok, (f"{row.name}: wanted {row.wanted} "
                    f"{'by property ' + str(row.expect) if row.expect else ''}, "
                    f"got {row.outcome}: {row.message}")
    if row.outcome == "killed":
        assert row.events is not None and row.events <= 10, row
        assert Path(row.trace).is_file(), "the counterexample trace was not kept"
        assert row.message.startswith("VIOLATION property"), row.message


def test_an_anchor_that_moved_is_a_clear_error(tmp_path):
    moved = mutants.Mutant("moved", "v1/core/kv_cache_manager.py", "no such line", "x",
                           "an edit whose anchor is gone", ("--kind", "full"), frozenset({1}))
    with pytest.raises(mutants.AnchorError, match="occurs 0 times"):
        mutants.mutant_tree(moved, tmp_path)
    assert mutants.main(["--only", "no-such-mutant"]) == 2


def test_a_mutant_tree_edits_one_file_and_links_the_rest(tmp_path):
    m = next(x for x in mutants.MUTANTS if x.name == "optimistic-basis")
    pkg = mutants.mutant_tree(m, tmp_path) / "vllm"
    edited = pkg / m.file
    assert not edited.is_symlink() and m.new in edited.read_text()
    assert m.old not in edited.read_text()
    assert (pkg / "v1" / "core" / "block_pool.py").is_symlink()
