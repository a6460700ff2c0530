"""Where kvcheck writes, so that no file a user made is written over.

* A default output (``check.md``, ``gate.md``, ``gate.json``, the nightly's
  reports) goes into a fresh run folder ``PARENT/<time>/`` and
  ``PARENT/latest`` is pointed at it (:func:`fresh_run_dir`); a ``latest``
  that is not kvcheck's link is refused before the run.
* A path the user names for an output (``--junit PATH``, ``--json PATH``) is
  replaced atomically, as pytest writes ``--junitxml`` (:func:`replace_file`):
  two runs naming the same path leave one whole file, the last one's.
* Counterexamples are saved under a fresh name (``cli.main.save_trace``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path


class OutputError(ValueError):
    """An output kvcheck will not write (exit 2, one line)."""


def fresh_run_dir(parent: Path) -> Path:
    """A new folder under ``parent`` named by the time, and ``parent/latest``
    pointing at it (a ``latest`` that is not kvcheck's link is refused)."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where the folder goes, a folder not writable
        raise OutputError(f"{str(parent)[:200]}: cannot make the run folder there "
                          f"({e.strerror or e})") from None
    latest = parent / "latest"
    if latest.exists() and not latest.is_symlink():
        raise OutputError(f"{latest} exists and is not kvcheck's link; move it away")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    try:
        for n in range(1000):
            d = parent / (stamp if n == 0 else f"{stamp}-{n}")
            try:
                d.mkdir()
                break
            except FileExistsError:
                continue
        else:
            raise OutputError(f"{parent}: no fresh run folder name left for {stamp}")
        tmp = parent / f".latest-{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(d.name)
        os.replace(tmp, latest)
    except OSError as e:
        raise OutputError(f"{str(parent)[:200]}: cannot make the run folder there "
                          f"({e.strerror or e})") from None
    return d


def check_named_file(path: str, flag: str) -> None:
    """Refuse, before the run, a named output that cannot be written: empty,
    a folder, in a folder that is missing or not writable (exit 2)."""
    if not str(path).strip():
        raise OutputError(f"{flag} '': name a file")
    p = Path(path)
    try:
        if p.is_dir():
            raise OutputError(f"{flag} {path}: is a folder; name a file")
        if p.exists() and not p.is_file():  # a FIFO, a device, a socket
            raise OutputError(f"{flag} {path}: not a regular file; name a file")
        folder = p.parent
        if not folder.is_dir():
            raise OutputError(f"{flag} {path}: {folder} is not a folder")
    except OSError as e:
        raise OutputError(f"{flag} {str(path)[:80]}: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: cannot write in {folder}")


def replace_file(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over
    ``path`` (atomically: a reader sees the old file or the new, whole), as
    pytest writes ``--junitxml``: through a symbolic link to the file it
    names, keeping an existing file's mode (a new one's: 0666 less the umask)."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
