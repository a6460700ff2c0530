"""The Hypothesis example database the fuzzers share.

A directory by default (``DirectoryBasedExampleDatabase``); a Redis database
when ``KVCHECK_REDIS_URL`` is set, so several machines share one corpus.
Either way a failure found once is replayed first on every later run.

A URL that is not a Redis URL, or a server that does not answer within
:data:`REDIS_TIMEOUT_S`, raises :class:`DatabaseError` (one line; the CLI
exits 2), as does a database path that is empty or names a file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

REDIS_SCHEMES = ("redis", "rediss", "unix")
REDIS_TIMEOUT_S = 5.0


class DatabaseError(ValueError):
    """The example database named by a flag or ``KVCHECK_REDIS_URL`` is unusable."""


def _where(url: str) -> str:
    """The URL without its password, for messages."""
    u = urlsplit(url)
    host = u.hostname or ""
    port = f":{u.port}" if u.port else ""
    return f"{u.scheme}://{host}{port}{u.path if u.scheme == 'unix' else ''}"


def redis_url() -> str | None:
    """``KVCHECK_REDIS_URL`` if set and not empty, checked to be a Redis URL."""
    url = os.environ.get("KVCHECK_REDIS_URL")
    if not url:
        return None
    try:
        u = urlsplit(url.strip())
        u.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:
        raise DatabaseError(f"KVCHECK_REDIS_URL is not a URL ({e})") from None
    if u.scheme not in REDIS_SCHEMES or not (u.hostname or u.path):
        raise DatabaseError(f"KVCHECK_REDIS_URL {url[:60]!r} is not a Redis URL "
                            f"(redis://HOST:PORT/DB, rediss://..., unix:///PATH)")
    return url.strip()


def open_database(path: str | Path | None = None):
    """The example database: Redis where ``KVCHECK_REDIS_URL`` is set (it must
    answer a ping), else the directory ``path`` (default ``.hypothesis/kvcheck``)."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    url = redis_url()
    if url:
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError as e:  # pragma: no cover - redis is a pinned dependency
            raise DatabaseError(f"KVCHECK_REDIS_URL is set but redis is not installed: {e}") \
                from None
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S,
                                          socket_timeout=REDIS_TIMEOUT_S)
            client.ping()
        except (redis.RedisError, ValueError, OSError) as e:
            msg = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise DatabaseError(f"KVCHECK_REDIS_URL {_where(url)}: no Redis server answers "
                                f"({msg})") from None
        return RedisExampleDatabase(client, key_prefix=b"kvcheck:")
    if path is not None and not str(path).strip():
        raise DatabaseError("--db '': name a folder")
    p = Path(path or ".hypothesis/kvcheck")
    try:
        if p.exists() and not p.is_dir():
            raise DatabaseError(f"example database {p}: exists and is not a folder")
        # made and tried here: Hypothesis would go on without a database it
        # cannot write (a folder under a file, under /proc, read-only)
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".kvcheck-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise DatabaseError(f"example database {str(p)[:120]}: cannot write there "
                            f"({e.strerror or type(e).__name__})") from None
    return DirectoryBasedExampleDatabase(str(p))


def recording(inner, borrow: dict[bytes, bytes] | None = None):
    """``inner`` wrapped to count the saved examples Hypothesis fetched to
    replay (``.replayed``; its primary corpus, not the secondary or pareto
    ones). ``borrow`` {key: other key}: a fetch of ``key`` also yields the
    failures saved under the other key (the same setting on the gate's base),
    so they are replayed first; they are counted in ``.borrowed`` and never
    deleted or moved (they stay the base's)."""
    from hypothesis.database import ExampleDatabase

    borrow = borrow or {}

    class RecordingDatabase(ExampleDatabase):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.replayed = 0
            self.lent: set[bytes] = set()

        @property
        def borrowed(self) -> int:
            return len(self.lent)

        def fetch(self, key: bytes):
            values = list(self.inner.fetch(key))
            if not key.endswith((b".secondary", b".pareto")):
                self.replayed += len(values)
            if key in borrow:
                own = set(values)
                extra = [v for v in self.inner.fetch(borrow[key]) if v not in own]
                self.lent.update(extra)
                values += extra
            yield from values

        def save(self, key: bytes, value: bytes) -> None:
            self.inner.save(key, value)

        def delete(self, key: bytes, value: bytes) -> None:
            if value not in self.lent:
                self.inner.delete(key, value)

        def move(self, src: bytes, dest: bytes, value: bytes) -> None:
            if value not in self.lent:
                self.inner.move(src, dest, value)

    return RecordingDatabase()
