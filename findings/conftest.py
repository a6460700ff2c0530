# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The findings' tests import their helpers from kvcheck_utils.py, in this
folder: pytest loads this file before them and puts the folder on the path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
