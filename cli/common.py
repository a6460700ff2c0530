"""What every command shares: the usage error (exit 2) and output folders
checked before a run starts."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


class UsageError(Exception):
    """Bad input or usage: one clear line, exit 2."""


CREATED: list[Path] = []  # output folders made by usable_out, removed at exit if empty


def usable_out(path: str, flag: str = "--out") -> None:
    """Refuse an output folder that cannot take files, before the run starts
    (exit 2): an existing file, a folder that cannot be written, a missing
    one that cannot be created. A folder created here and left empty is
    removed when the command ends."""
    p = Path(path)
    if not str(path).strip():
        raise UsageError(f"{flag} '': name a folder")
    try:  # every OSError is one line: a name too long, a loop of links, ...
        if p.exists() and not p.is_dir():
            raise UsageError(f"{flag} {path}: exists and is not a folder")
        made = []
        q = p
        while not q.exists() and not q.is_symlink():
            made.append(q)
            q = q.parent
        for d in reversed(made):
            d.mkdir()
            CREATED.append(d)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".kvcheck-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {str(path)[:120]}: cannot write there "
                         f"({e.strerror or e})") from None


def remove_created() -> None:
    while CREATED:
        with contextlib.suppress(OSError):
            CREATED.pop().rmdir()  # only if still empty
