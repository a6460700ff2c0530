"""One test per nightly matrix row (written by ``scripts/nightly.py`` to the
file in ``KVCHECK_NIGHTLY_MATRIX_FILE``): fuzz the row's target, kind and
policy for its time budget with the shared persistent example database, and
fail with the counterexample's timeline, picture and reproducer when a
property breaks. pytest-xdist runs the rows in parallel (see the script's
docstring for why xdist)."""

import json
import os
from pathlib import Path

import pytest

from tests.nightly.runner import run_row

_MATRIX = json.loads(Path(os.environ["KVCHECK_NIGHTLY_MATRIX_FILE"]).read_text())
ROWS = _MATRIX["rows"]


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_row(row):
    result = run_row(row, seconds=_MATRIX["seconds"], db_path=_MATRIX["db"],
                     reports=Path(_MATRIX["reports"]))
    if not result["ok"]:
        pytest.fail(f"{row['id']}: {result['verdict']}: {result['detail']}", pytrace=False)
