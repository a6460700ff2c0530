"""``python -m bench``: run the benchmarks (see :mod:`bench.core`)."""

import sys

from bench.core import main

sys.exit(main())
