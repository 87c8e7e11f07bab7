"""Job environments stored once each: the `envs` table (schema 5).

A user's environment is most of a job's spec: 5-10 KiB is usual where modules or conda set PATH,
LD_LIBRARY_PATH and the rest, and every job of a sweep carries the same one. Stored inside each
job's spec, 100k queued jobs with a 6 KB environment made a 594 MB database, and a restart parsed
the same environment 100k times (12 s of CPU, against 4.4 s for the same jobs with a 280-byte
environment). So an environment of more than INLINE_MAX bytes is stored once, under the digest of
its JSON, and the job's row names it (`jobs.env_id`, its spec text then has no `env` key); a smaller
one stays inside the spec, where a lookup would cost more than it saves. Rows written before schema
5, and arrays (whose one row already holds the environment once for all their tasks), are inline.

The environment goes in the same change as its job: a rolled-back submit leaves no row behind. Ids
are AUTOINCREMENT, so one deleted after its last job is never handed out again; an id rolled back
can be, so the writer's reader forgets what it parsed at every rollback (`EnvReader.forget`). The
digest is what in-memory sharing keys on (compact.py): it names the content, never an id.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections import OrderedDict

from pydantic_core import SchemaSerializer, core_schema, from_json

INLINE_MAX = 512  # bytes of environment JSON kept inside the spec
CACHE_SIZE = 1024  # environments a reader keeps parsed (a restart reads each distinct one once)
# pydantic's own serialiser of a dict[str, str], as a spec's env is written (json.dumps takes 3x as long,
# and a TypeAdapter costs the daemon's start 0.1 s to build)
_ENV_JSON = SchemaSerializer(core_schema.dict_schema(core_schema.str_schema(), core_schema.str_schema()))


class MissingEnvironment(Exception):
    """A job's row names an environment the database does not hold, or holds damaged."""


def surely_inline(env: dict[str, str]) -> bool:
    """A bound that needs no encoding: a character is at most 6 bytes of JSON (`\\u001f`), so the
    usual small environment is told inline by a sum, not a dump."""
    return (sum(map(len, env)) + sum(map(len, env.values())) + len(env)) * 6 + 2 <= INLINE_MAX


def env_json(env: dict[str, str]) -> bytes | None:
    """The environment as stored apart (its JSON), or None for one small enough to stay inline."""
    if surely_inline(env):
        return None
    text = _ENV_JSON.to_json(env)
    return text if len(text) > INLINE_MAX else None


def digest(text: bytes) -> bytes:
    return hashlib.blake2b(text, digest_size=32).digest()


def store_env(db: sqlite3.Connection, text: bytes, key: bytes) -> int:
    """The id of the environment `text` (whose digest is `key`), inserting it if it is new; inside
    the caller's change."""
    row = db.execute("SELECT id FROM envs WHERE digest = ?", (key,)).fetchone()
    if row is not None:
        return int(row[0])
    cur = db.execute("INSERT INTO envs (digest, env) VALUES (?, ?)", (key, text.decode("utf-8")))
    assert cur.lastrowid is not None
    return cur.lastrowid


def prune_envs(db: sqlite3.Connection, env_ids: list[int]) -> None:
    """Delete those of `env_ids` that no job names any more (after their jobs were deleted)."""
    for start in range(0, len(env_ids), 500):
        chunk = env_ids[start : start + 500]
        db.execute(f"DELETE FROM envs WHERE id IN ({', '.join('?' for _ in chunk)}) "
                   "AND NOT EXISTS (SELECT 1 FROM jobs WHERE jobs.env_id = envs.id)", chunk)


class EnvReader:
    """Environments by id, each parsed once while it is in use (a bounded LRU)."""

    def __init__(self, db: sqlite3.Connection, capacity: int = CACHE_SIZE) -> None:
        self._db = db
        self._capacity = capacity
        self._cache: OrderedDict[int, tuple[dict[str, str], bytes]] = OrderedDict()

    def forget(self) -> None:
        """After a rollback: an id this connection saw inside the undone change may come back for another."""
        self._cache.clear()

    def get(self, env_id: int) -> tuple[dict[str, str], bytes]:
        """(environment, digest of its JSON) of `env_id`; MissingEnvironment if it is not stored."""
        found = self._cache.get(env_id)
        if found is not None:
            self._cache.move_to_end(env_id)
            return found
        row = self._db.execute("SELECT env, digest FROM envs WHERE id = ?", (env_id,)).fetchone()
        if row is None:
            raise MissingEnvironment(f"environment {env_id} is named by a job but not in the database")
        env = from_json(row[0])
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise MissingEnvironment(f"environment {env_id} in the database is not an object of strings")
        self._cache[env_id] = found = (env, bytes(row[1]))
        if len(self._cache) > self._capacity:
            self._cache.popitem(last=False)
        return found
