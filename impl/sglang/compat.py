"""Which SGLang releases the ``sglang@VERSION`` target runs, and where they live.

Needs neither SGLang nor torch (scripts/install-sglang.sh imports it first).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUPPORTED = ("0.5.23",)


def release_problem(version: str) -> str | None:
    """Why ``version`` cannot be installed or driven, or None."""
    if version not in SUPPORTED:
        return (f"sglang {version!r} is not supported (supported: {', '.join(SUPPORTED)}; "
                f"the target drives one release's scheduler-side objects)")
    return None


def install_dir(version: str) -> Path:
    return REPO / ".sglang" / version


def install_command(version: str) -> str:
    return f"make sglang SGLANG={version}"
