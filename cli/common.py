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
    try:
        long = next((c for c in p.parts if len(os.fsencode(c)) > _name_max(p)), None)
    except (OSError, UnicodeError):
        long = None
    if long is not None:
        raise UsageError(f"{flag} {path[:80]}...: a name in it is longer than the "
                         f"{_name_max(p)} bytes a file name may have")
    try:
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
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def _name_max(p: Path) -> int:
    """The longest file name the file system under ``p`` takes, in bytes."""
    q = p
    while not q.exists() and q != q.parent:
        q = q.parent
    try:
        return os.pathconf(q if str(q) else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def remove_created() -> None:
    while CREATED:
        with contextlib.suppress(OSError):
            CREATED.pop().rmdir()  # only if still empty
