"""The Hypothesis example database the fuzzers share.

A directory by default (``DirectoryBasedExampleDatabase``); a Redis database
when ``KVCHECK_REDIS_URL`` is set, so several machines share one corpus.
Either way a failure found once is replayed first on every later run.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase


def open_database(path: str | Path | None = None) -> ExampleDatabase:
    url = os.environ.get("KVCHECK_REDIS_URL")
    if url:
        try:
            import redis
            from hypothesis.extra.redis import RedisExampleDatabase
        except ImportError as e:  # pragma: no cover - redis is a pinned dependency
            raise RuntimeError(f"KVCHECK_REDIS_URL is set but redis is not installed: {e}") from e
        client = redis.Redis.from_url(url)
        client.ping()
        return RedisExampleDatabase(client, key_prefix=b"kvcheck:")
    return DirectoryBasedExampleDatabase(str(path or ".hypothesis/kvcheck"))
