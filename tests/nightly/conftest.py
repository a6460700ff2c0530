"""The nightly rows run only under ``scripts/nightly.py`` (``make nightly``),
which writes the matrix and sets ``KVCHECK_NIGHTLY_MATRIX_FILE``; ``make test``
leaves them out."""

import os

collect_ignore = [] if os.environ.get("KVCHECK_NIGHTLY_MATRIX_FILE") else ["test_nightly_fuzz.py"]
